"""Tokens laid out in blocks of one task each, for per-token task
conditioning of packed rows.

A packed row holds examples of several tasks, and each token must be
conditioned by its own example's task. Rather than run every token through
all T tasks' weights, `task_blocks` sorts each data shard's tokens by task
into blocks of one task each (`traced_mesh.batch_shards`, `block_size`); a block then
costs one product with a copy of its task's weights (`take_tasks`), and
the outputs go back to their tokens.
Used by the adapters (`methods/adapters.py`, one adapter a token) and by
HyperPrompt's packed attention (`layers.dot_product_attention`, each query
scored against its own task's prompt columns only).

Gradient forms (`T5Config.gradient_form`): 'written' takes the gradient of
the block layout's permutation as a gather (`_permute_rows`), which XLA's
CPU compiler runs far faster than the scatter-add of autodiff; 'autodiff'
is JAX's own derivative of the plain gather, the form for TPUs and GPUs,
whose compilers scatter large rows well; 'auto' picks 'written' on CPU and
'autodiff' elsewhere (`resolve_gradient_form`). Both give the same values
and gradients. Each block's copy of its task's weights (`take_tasks`) takes
its gradient as a one-hot product in either form: a scatter-add into a
table of T rows serialises its many updates of few rows (the shape that
cost 127x on an H100, docs/performance.md) and runs element by element on
a CPU.
"""

import math

from flax import struct
import jax
from jax import lax
import jax.numpy as jnp

from hyperprompt_jax.t5 import traced_mesh


Array = jax.Array
GRADIENT_FORMS = ('auto', 'written', 'autodiff')


def check_gradient_form(form: str) -> None:
  if form not in GRADIENT_FORMS:
    raise ValueError(f'T5Config.gradient_form={form!r}; expected one of '
                     f'{list(GRADIENT_FORMS)}.')


def resolve_gradient_form(form: str) -> str:
  """'written' or 'autodiff' for a `T5Config.gradient_form`: 'auto' is
  'written' where the model is compiled for a CPU
  (`traced_mesh.target_platform`),
  else 'autodiff'."""
  check_gradient_form(form)
  if form == 'auto':
    return 'written' if traced_mesh.target_platform() == 'cpu' else 'autodiff'
  return form


@struct.dataclass
class TaskBlocks:
  """Tokens laid out in blocks of one task each, per data shard
  (`task_blocks`): S shards of n = N / S tokens, K blocks of `block`
  positions a shard.

  Attributes:
    source: `[S, K * block]`: the token (of its shard's n) at each block
      position; n at the blocks' padding, which reads a zero row.
    destination: `[S, n]`: each token's block position in its shard.
    block_tasks: `[S, K]`: each block's task (0 for a block of padding
      only).
    form: the gradient form of its gathers, 'written' or 'autodiff'
      (module docstring).
  """

  source: Array
  destination: Array
  block_tasks: Array
  form: str = struct.field(pytree_node=False, default='written')

  @property
  def tasks(self) -> Array:
    """`[S * K]`: the task of each block of `to_blocks`."""
    return self.block_tasks.reshape(-1)

  def to_blocks(self, x: Array) -> Array:
    """`x [N, d]` -> `[S * K, block, d]`, zeros at the padding; shard s's
    blocks are `[s * K, (s + 1) * K)`."""
    shards, per_shard = self.destination.shape
    out = jax.vmap(self._permute)(x.reshape(shards, per_shard, -1),
                                  self.source, self.destination)
    return out.reshape(self.tasks.shape[0], -1, x.shape[-1])

  def from_blocks(self, y: Array) -> Array:
    """`y [S * K, block, d]` -> each token's row `[N, d]`."""
    shards = self.source.shape[0]
    out = jax.vmap(self._permute)(y.reshape(shards, -1, y.shape[-1]),
                                  self.destination, self.source)
    return out.reshape(-1, y.shape[-1])

  def take(self, a: Array) -> Array:
    """`a [T, ...]` -> each block's task's `[S * K, ...]` (`take_tasks`)."""
    return take_tasks(a, self.tasks)

  def _permute(self, x: Array, index: Array, back: Array) -> Array:
    if self.form == 'written':
      return _permute_rows(x, index, back)
    return _gather_rows(x, index)


def block_size(count: int, num_tasks: int, copied_rows: int) -> int:
  """Positions per block for `count` tokens (a data shard's) of up to
  `num_tasks` tasks, where a block costs a copy of `copied_rows` rows of
  its task's weights (an adapter's W_down and W_up: 2 b; HyperPrompt's
  prompt keys and values: 2 l).

  Every block position is computed (the layout is static): K = N / c + T
  blocks of c hold N tokens and up to c - 1 positions of padding a task,
  so blocks of c cost about (N / c + T) w copied rows and N + T c
  positions, least at c = sqrt(w N / T): 181 at N = 4,096, T = 8 for
  HyperFormer++'s adapters (b = 32), 128 for the Vanilla adapter's (b =
  16) and for HyperPrompt's prompts (l = 16).
  """
  return max(1, min(count, round(math.sqrt(copied_rows * count
                                           / num_tasks))))


def task_blocks(task_ids: Array, num_tasks: int, block: int,
                shards: int = 1) -> TaskBlocks:
  """Lays the tokens of `task_ids` (`[rows, length]`) out by task, within
  each of `shards` data shards (contiguous runs of rows): each task's
  tokens of a shard (in their order) fill whole blocks of `block`
  positions, the last one padded, so every block holds one task's
  tokens. K = the blocks that the shard's n = N / S tokens and at most T
  (block - 1) positions of padding take (static; `block_size`).

  Blocks per shard keep the layout on the shard's devices: laying out the
  whole batch at once sorts across shards, and XLA then gathers the
  batch's tokens and activations onto every device (all-gathers and
  all-reduces of `[N, d]` in the compiled step on 8 simulated devices).
  `block` is for a shard's n tokens (`batch_task_blocks` picks both).
  """
  rows = task_ids.shape[0]
  if rows % shards:
    raise ValueError(f'{rows} rows do not split into {shards} data shards.')
  by_shard = task_ids.reshape(shards, -1).astype(jnp.int32)
  return jax.vmap(lambda ids: _one_shard(ids, num_tasks, block))(by_shard)


def batch_task_blocks(task_ids: Array, num_tasks: int, copied_rows: int,
                      gradient_form: str = 'auto') -> TaskBlocks:
  """`task_blocks` of a batch (`task_ids [rows, length]`) where the model
  runs: per data shard (`batch_shards`), in blocks of `block_size` for a
  shard's tokens and `copied_rows` rows of weights a block; gathers of
  `gradient_form` (`T5Config.gradient_form`)."""
  shards = traced_mesh.batch_shards(task_ids.shape[0])
  block = block_size(task_ids.size // shards, num_tasks, copied_rows)
  blocks = task_blocks(task_ids, num_tasks, block, shards)
  return blocks.replace(form=resolve_gradient_form(gradient_form))


def _one_shard(flat: Array, num_tasks: int, block: int) -> TaskBlocks:
  """`task_blocks` of one shard's tokens (`flat [n]`)."""
  count = flat.shape[0]
  num_blocks = -(-(count + num_tasks * (block - 1)) // block)
  order = jnp.argsort(flat, stable=True)  # token indices by task
  sorted_tasks = flat[order]
  per_task = jnp.bincount(flat, length=num_tasks)
  padded = -(-per_task // block) * block
  task_start = jnp.cumsum(padded) - padded        # in the block layout
  first = jnp.cumsum(per_task) - per_task         # in `order`
  rank = jnp.arange(count, dtype=jnp.int32) - first[sorted_tasks]
  position = (task_start[sorted_tasks] + rank).astype(jnp.int32)
  destination = jnp.zeros(count, jnp.int32).at[order].set(position)
  source = jnp.full(num_blocks * block, count, jnp.int32).at[position].set(
      order.astype(jnp.int32))
  block_tasks = jnp.zeros(num_blocks, jnp.int32).at[position // block].set(
      sorted_tasks)
  return TaskBlocks(source, destination, block_tasks)


@jax.custom_vjp
def _permute_rows(x: Array, index: Array, back: Array) -> Array:
  """`x[index]`, zero rows where `index` is len(x) (the blocks' padding),
  whose gradient is a gather too: `back` (`[len(x)]`) gives each row of `x`
  its one place in `index`. XLA would scatter-add the cotangent of a plain
  gather, which it cannot know to be a permutation (and a CPU scatters
  slowly)."""
  return _gather_rows(x, index)


def _gather_rows(x: Array, index: Array) -> Array:
  return x.at[index].get(mode='fill', fill_value=0)


def _permute_rows_fwd(x, index, back):
  return _gather_rows(x, index), back


def _permute_rows_bwd(back, g):
  return _gather_rows(g, back), None, None


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def take_tasks(a: Array, tasks: Array) -> Array:
  """`a[tasks]` (`a [T, ...]`, int `tasks` of any shape: `tasks.shape +
  a.shape[1:]`), its gradient a product with the one-hot tasks
  (`_take_tasks_written`), not a scatter-add into T rows. The gather of
  every per-task table of the model."""
  out = _take_tasks_written(a, tasks.reshape(-1))
  return out.reshape(tasks.shape + a.shape[1:])


@jax.custom_vjp
def _take_tasks_written(a: Array, tasks: Array) -> Array:
  """`a[tasks]` whose gradient is a product with the one-hot tasks: XLA
  would scatter-add the cotangent of a plain gather, which its CPU compiler
  runs element by element (fwd + bwd of a packed adapter, 4,096 tokens, b
  32: 17.8 ms with it, 10.6 ms this) and a GPU serialises over the few
  rows."""
  return jnp.take(a, tasks, axis=0)


def _take_tasks_fwd(a, tasks):
  return _take_tasks_written(a, tasks), (tasks, a.shape[0])


def _take_tasks_bwd(residuals, g):
  tasks, num_tasks = residuals
  one_hot = jax.nn.one_hot(tasks, num_tasks, dtype=g.dtype)
  # HIGHEST: a TPU sums float32 in bfloat16 passes otherwise.
  return jnp.einsum('gt,g...->t...', one_hot, g,
                    precision=lax.Precision.HIGHEST), None


_take_tasks_written.defvjp(_take_tasks_fwd, _take_tasks_bwd)
