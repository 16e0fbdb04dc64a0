"""Tokens in blocks of one task each, for packed rows' task conditioning.

Each token of a packed row must be conditioned by its own example's task.
Rather than run every token through all T tasks' weights, `task_blocks`
sorts each data shard's tokens by task into blocks of one task
(`block_size`); a block costs one product with a copy of its task's weights
(`take_tasks`), and the outputs go back to their tokens. Used by the
adapters (`methods/adapters.py`) and HyperPrompt's packed attention
(`layers.dot_product_attention`).

Gradient forms (`T5Config.gradient_form`; docs/performance.md, "Forms"):
'written' takes the gradient of the layout's permutation as a gather
(`_permute_rows`), which XLA:CPU runs far faster than autodiff's
scatter-add; 'autodiff' is JAX's, for TPUs and GPUs, whose compilers scatter
large rows well; 'auto' is 'written' on CPU. Values and gradients are the
same. Either way `take_tasks` takes its gradient as a one-hot product: a
scatter-add into T rows serialises its many updates of few rows on a GPU and
runs element by element on a CPU.
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
  """'written' or 'autodiff'; 'auto' is 'written' compiled for a CPU."""
  check_gradient_form(form)
  if form == 'auto':
    return 'written' if traced_mesh.target_platform() == 'cpu' else 'autodiff'
  return form


@struct.dataclass
class TaskBlocks:
  """Tokens laid out in blocks of one task each, per data shard.

  S shards of n = N / S tokens, K blocks of `block` positions a shard.

  Attributes:
    source: `[S, K * block]`, the token (of its shard's n) at each block
      position; n at the padding, which reads a zero row.
    destination: `[S, n]`, each token's block position in its shard.
    block_tasks: `[S, K]`, each block's task (0 for padding only).
    form: the gathers' gradient form, 'written' or 'autodiff'.
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
    """`x [N, d]` -> `[S * K, block, d]`, zeros at the padding."""
    shards, per_shard = self.destination.shape
    out = jax.vmap(self._permute)(x.reshape(shards, per_shard, -1),
                                  self.source, self.destination)
    return out.reshape(self.tasks.shape[0], -1, x.shape[-1])

  def from_blocks(self, y: Array) -> Array:
    """`y [S * K, block, d]` -> each token's row, `[N, d]`."""
    shards = self.source.shape[0]
    out = jax.vmap(self._permute)(y.reshape(shards, -1, y.shape[-1]),
                                  self.destination, self.source)
    return out.reshape(-1, y.shape[-1])

  def take(self, a: Array) -> Array:
    """`a [T, ...]` -> each block's task's, `[S * K, ...]`."""
    return take_tasks(a, self.tasks)

  def _permute(self, x: Array, index: Array, back: Array) -> Array:
    if self.form == 'written':
      return _permute_rows(x, index, back)
    return _gather_rows(x, index)


def block_size(count: int, num_tasks: int, copied_rows: int) -> int:
  """Positions per block for `count` tokens of up to `num_tasks` tasks.

  A block costs a copy of w = `copied_rows` rows of its task's weights (an
  adapter's W_down and W_up: 2 b; HyperPrompt's keys and values: 2 l). Every
  position is computed (the layout is static): K = N / c + T blocks of c hold
  N tokens and the padding, costing about (N / c + T) w copied rows and
  N + T c positions, least at c = sqrt(w N / T).
  """
  return max(1, min(count, round(math.sqrt(copied_rows * count
                                           / num_tasks))))


def task_blocks(task_ids: Array, num_tasks: int, block: int,
                shards: int = 1) -> TaskBlocks:
  """Lays the tokens of `task_ids [rows, length]` out by task, per data shard.

  `shards` splits the rows evenly (else ValueError). Each task's tokens of a
  shard, in order, fill whole blocks of `block` positions, the last padded; K
  is static (`block_size`). Blocks per shard keep the layout on the shard's
  devices: one layout of the whole batch sorts across shards, and XLA then
  gathers every token onto every device.
  """
  rows = task_ids.shape[0]
  if rows % shards:
    raise ValueError(f'{rows} rows do not split into {shards} data shards.')
  by_shard = task_ids.reshape(shards, -1).astype(jnp.int32)
  return jax.vmap(lambda ids: _one_shard(ids, num_tasks, block))(by_shard)


def batch_task_blocks(task_ids: Array, num_tasks: int, copied_rows: int,
                      gradient_form: str = 'auto') -> TaskBlocks:
  """`task_blocks` of a batch where the model runs: per data shard.

  Blocks of `block_size` for a shard's tokens and `copied_rows`, gathers of
  `gradient_form` (`T5Config.gradient_form`).
  """
  shards = traced_mesh.batch_shards(task_ids.shape[0])
  block = block_size(task_ids.size // shards, num_tasks, copied_rows)
  blocks = task_blocks(task_ids, num_tasks, block, shards)
  return blocks.replace(form=resolve_gradient_form(gradient_form))


def _one_shard(flat: Array, num_tasks: int, block: int) -> TaskBlocks:
  """`task_blocks` of one shard's tokens, `flat [n]`."""
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
  """`x[index]` (0 where `index` is len(x)), its gradient a gather by `back`.

  `back` gives each row of `x` its one place in `index`. XLA would scatter-add
  a plain gather's cotangent, not knowing it a permutation.
  """
  return _gather_rows(x, index)


def _gather_rows(x: Array, index: Array) -> Array:
  return x.at[index].get(mode='fill', fill_value=0)


def _permute_rows_fwd(x, index, back):
  return _gather_rows(x, index), back


def _permute_rows_bwd(back, g):
  return _gather_rows(g, back), None, None


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def take_tasks(a: Array, tasks: Array) -> Array:
  """`a[tasks]` for `a [T, ...]`, its gradient a product with the one-hot tasks.

  The gather of every per-task table of the model: `tasks.shape +
  a.shape[1:]`.
  """
  out = _take_tasks_written(a, tasks.reshape(-1))
  return out.reshape(tasks.shape + a.shape[1:])


@jax.custom_vjp
def _take_tasks_written(a: Array, tasks: Array) -> Array:
  """`a[tasks]`, its gradient a product with the one-hot tasks.

  XLA would scatter-add a plain gather's cotangent, element by element on a
  CPU and serialised over the few rows on a GPU.
  """
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
