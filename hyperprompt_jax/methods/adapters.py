"""Per-task bottleneck adapters: the "Vanilla Adapter" baseline (Houlsby et
al., 2019, as HyperPrompt's §4 uses it) and the adapter arithmetic that
HyperFormer++ (`hyperformer.py`) shares.

Every Transformer block of a stack gets two adapters per task, one after the
self-attention sublayer and one after the FFN sublayer (none after the
decoder's cross-attention). An adapter maps the sublayer's output h, before
dropout and the block's residual,

    h -> h + norm(W_up act(W_down h + b_down) + b_up),

with W_down [d, b], W_up [b, d] and b = d / reduction (32: b = 24 at T5
base); `norm` is the identity here and HyperFormer++'s generated post layer
norm there. The task of each example selects its adapters (a gather by
`task_ids`, so no example pays for another task's adapter); in packed rows
each token goes through its own task's adapter, the tokens grouped into
blocks of one task (`LayerAdapters._per_token`, `task_blocks`).

Parameters (under `<stack>/adapter/`), M layers, T tasks, kinds `attention`
(the encoder's attention, the decoder's self-attention) and `mlp`:
    {kind}_down [M, T, d, b], {kind}_down_bias [M, T, b],
    {kind}_up [M, T, b, d],   {kind}_up_bias [M, T, d]
initialised as Houlsby's near-identity adapters (and HyperFormer's code):
weights N(0, 0.01^2), biases zero. Adafactor takes absolute steps on them
(`optimizers.PARAMETER_SCALE`): T5's steps relative to a parameter's scale
grow it by at most a factor (1 + rate) a step, which leaves this start, one
to three orders below the adapter's working scale, near where it is (on the
task-separation test the adapter stays at chance; `optimizers.py` has the
measurements).
"""

from typing import Any, Optional

from flax import linen as nn
from flax import struct
import jax
import jax.numpy as jnp

from hyperprompt_jax.model import layers

Array = jax.Array
PLACEMENTS = ('both', 'encoder', 'decoder')
# The method's face (read by `methods.REGISTRY`): the T5Config field that
# holds its config, its parameter scopes and logical axis names, the gin
# variant files that select it, `check` and `is_active`.
CONFIG_FIELD = 'adapter'
SCOPES = ('adapter',)
AXIS_NAMES = ('tasks', 'hyper_layers', 'adapter_bottleneck')
VARIANT_FILES = ('variants/adapter.gin',)
PACKING_REFUSAL = None  # packed rows: each token its own task
KINDS = ('attention', 'mlp')  # the sublayers an adapter follows
WEIGHT_INIT_STDDEV = 1e-2


@struct.dataclass
class AdapterConfig:
  """gin: `adapters.AdapterConfig` (see gin/variants/adapter.gin)."""

  placement: str = 'both'   # 'both' | 'encoder' | 'decoder'
  reduction: int = 32       # bottleneck b = d / reduction
  activation: str = 'relu'  # a flax.linen activation name


def check_placement(placement: str, owner: str) -> None:
  if placement not in PLACEMENTS:
    raise ValueError(f'{owner}.placement (PLACEMENT) must be one of '
                     f'{PLACEMENTS}, got {placement!r}.')


def check_reduction(reduction: int, emb_dim: int, macro: str) -> None:
  if reduction <= 0 or emb_dim % reduction:
    raise ValueError(
        f'{macro}={reduction} must be a positive divisor of d_model='
        f'{emb_dim} (the adapter bottleneck is b = d / {macro}).')


def check_adapter_config(cfg: AdapterConfig, emb_dim: int) -> None:
  """Raises ValueError on settings that cannot build the adapters."""
  check_placement(cfg.placement, 'AdapterConfig')
  check_reduction(cfg.reduction, emb_dim, 'ADAPTER_REDUCTION')
  layers.activation(cfg.activation)


def check(cfg: AdapterConfig, model_config: Any) -> None:
  check_adapter_config(cfg, model_config.emb_dim)


def is_active(cfg: Any, stack: str) -> bool:
  """Whether an adapter config (Vanilla or HyperFormer++) adapts `stack`."""
  return cfg is not None and cfg.placement in ('both', stack)


@struct.dataclass
class AdapterWeights:
  """One kind of adapter for every layer and task.

  Attributes:
    down: `[M, T, d, b]`.
    down_bias: `[M, T, b]`.
    up: `[M, T, b, d]`.
    up_bias: `[M, T, d]`.
    norm_scale, norm_bias: `[M, T, d]` post layer norm (HyperFormer++), or
      None (no norm).
  """

  down: Array
  down_bias: Array
  up: Array
  up_bias: Array
  norm_scale: Optional[Array] = None
  norm_bias: Optional[Array] = None


def layer_norm(x: Array, scale: Array, bias: Array,
               epsilon: float = 1e-6) -> Array:
  """Standard layer norm (centred, with bias) over the last axis; `scale`
  and `bias` broadcast against `x` (HyperFormer++: per example).

  Not `layers.LayerNorm`: that is T5's RMS norm with a parameter of its own;
  HyperFormer++ generates a standard layer norm's scale and bias per task.
  """
  x32 = jnp.asarray(x, jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + epsilon)
  return jnp.asarray(y * scale + bias, x.dtype)


class LayerAdapters:
  """A stack's adapters bound to one layer and the batch's task ids
  (`[batch]`, or per token `[batch, length]` when `packed`)."""

  def __init__(self, weights: dict[str, AdapterWeights], layer: int,
               task_ids: Optional[Array], activation: str,
               packed: bool = False):
    if task_ids is None:
      raise ValueError(
          'Adapters need task_ids (int32 [batch]) but none were given: pass '
          'task_ids to encode / decode / __call__ (the feature converter adds '
          'them).')
    self.weights = weights
    self.layer = layer
    self.task_ids = task_ids
    self.activation = layers.activation(activation)
    self.packed = packed

  def __call__(self, h: Array, kind: str) -> Array:
    """`h [batch, length, d]` -> adapted `[batch, length, d]`; `kind`:
    'attention' or 'mlp', the sublayer `h` comes from."""
    w = self.weights[kind]
    if self.packed:
      if w.norm_scale is None:
        return h + self._per_token(h, w, self.task_ids)
      # With HyperFormer++'s float32 layer norm, recomputed from `h` in the
      # backward pass: saved, its intermediates and the blocks' gathered
      # weights raised the step's peak from 1.20x to 1.26x MTL's, at the
      # same step time; the Vanilla adapter's peak does not change, and
      # recomputing costs it time (docs/performance.md, Packing).
      return h + jax.checkpoint(self._per_token)(h, w, self.task_ids)

    def take(a):  # layer m, then each example's task: [batch, ...]
      return None if a is None else jnp.take(a[self.layer], self.task_ids,
                                             axis=0).astype(h.dtype)

    down, down_bias, up, up_bias = map(take, (w.down, w.down_bias, w.up,
                                              w.up_bias))
    z = self.activation(jnp.einsum('nld,ndb->nlb', h, down)
                        + down_bias[:, None])
    out = jnp.einsum('nlb,nbd->nld', z, up) + up_bias[:, None]
    if w.norm_scale is not None:
      out = layer_norm(out, take(w.norm_scale)[:, None],
                       take(w.norm_bias)[:, None])
    return h + out

  def _per_token(self, h: Array, w: AdapterWeights, task_ids: Array
                 ) -> Array:
    """Packed rows (`task_ids [batch, length]`): each token through its own
    task's adapter, without the adapter update `h -> h + .`.

    The tokens are laid out by task in blocks of one task each
    (`task_blocks`), every block goes through its task's adapter as one
    `[block, d] x [d, b]` matmul, and the outputs go back to their tokens.
    So a token costs one adapter, as unpacked, plus the blocks' padding
    (at most 1/8). Sending every token through all T tasks' `W_down` and
    zeroing the other tasks' bottlenecks (the form before) cost T adapters
    a token and kept `[batch, length, T, b]` for the backward pass: 1.12x
    MTL's FLOPs and 1.17x its peak at HyperFormer++'s b = d / 16
    (docs/performance.md, Packing).
    """
    n, length, d = h.shape
    num_tasks = w.down.shape[1]
    blocks = task_blocks(task_ids, num_tasks)
    x = blocks.to_blocks(h.reshape(n * length, d))  # [K, block, d]

    def take(a):  # layer m, then each block's task: [K, ...]
      return jnp.take(a[self.layer], blocks.block_tasks,
                      axis=0).astype(h.dtype)

    z = self.activation(jnp.einsum('kcd,kdb->kcb', x, take(w.down))
                        + take(w.down_bias)[:, None])
    out = jnp.einsum('kcb,kbd->kcd', z, take(w.up)) + take(w.up_bias)[:, None]
    if w.norm_scale is not None:
      out = layer_norm(out, take(w.norm_scale)[:, None],
                       take(w.norm_bias)[:, None])
    return blocks.from_blocks(out).reshape(n, length, d)


@struct.dataclass
class TaskBlocks:
  """Tokens laid out in blocks of one task each (`task_blocks`).

  Attributes:
    source: `[K * block]`: the token at each block position (the token
      count N at the blocks' padding, which reads a zero row).
    destination: `[N]`: each token's block position.
    block_tasks: `[K]`: each block's task (0 for a block of padding only).
  """

  source: Array
  destination: Array
  block_tasks: Array

  def to_blocks(self, x: Array) -> Array:
    """`x [N, d]` -> `[K, block, d]`, zeros at the padding."""
    rows = jnp.concatenate([x, jnp.zeros_like(x[:1])])
    back = jnp.concatenate([self.destination,
                            jnp.array([self.source.shape[0]], jnp.int32)])
    out = _permute_rows(rows, self.source, back)
    return out.reshape(self.block_tasks.shape[0], -1, x.shape[-1])

  def from_blocks(self, y: Array) -> Array:
    """`y [K, block, d]` -> each token's row `[N, d]`."""
    return _permute_rows(y.reshape(-1, y.shape[-1]), self.destination,
                         self.source)


def task_blocks(task_ids: Array, num_tasks: int,
                max_block: int = 128) -> TaskBlocks:
  """Lays the tokens of `task_ids` (`[batch, length]`) out by task: each
  task's tokens (in their order) fill whole blocks of `block` positions, the
  last one padded, so every block holds one task's tokens.

  `block` = min(max_block, N // (8 T)) (N tokens, at least 1): the padding,
  at most T (block - 1) positions, stays under N / 8; K = the blocks that
  N tokens and that padding take (static).
  """
  flat = task_ids.reshape(-1).astype(jnp.int32)
  count = flat.shape[0]
  block = max(1, min(max_block, count // (8 * num_tasks)))
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
  """`x[index]`, whose gradient is a gather too: `back` (`[len(x)]`) gives
  each row of `x` its one place in `index` (len(index): none, a zero
  cotangent). XLA would scatter-add the cotangent of a plain gather, which
  it cannot know to be a permutation (and a CPU scatters slowly)."""
  return x[index]


def _permute_rows_fwd(x, index, back):
  return x[index], back


def _permute_rows_bwd(back, g):
  g = jnp.concatenate([g, jnp.zeros_like(g[:1])])
  return g[back], None, None


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def _flatten_layer_adapters(adapters: LayerAdapters):
  return ((adapters.weights, adapters.task_ids),
          (adapters.layer, adapters.activation, adapters.packed))


def _unflatten_layer_adapters(aux, children) -> LayerAdapters:
  # Not through __init__: its check is on what the caller passed, and the
  # activation is already the function.
  adapters = object.__new__(LayerAdapters)
  adapters.weights, adapters.task_ids = children
  adapters.layer, adapters.activation, adapters.packed = aux
  return adapters


# A pytree (weights and task ids the leaves): layers under `nn.remat`
# (T5Config.remat_policy) take it inside their LayerConditioning.
jax.tree_util.register_pytree_node(LayerAdapters, _flatten_layer_adapters,
                                   _unflatten_layer_adapters)


class VanillaAdapters(nn.Module):
  """The per-task adapters of one stack (parameters: module docstring)."""

  config: AdapterConfig
  num_tasks: int
  num_layers: int
  emb_dim: int

  @nn.compact
  def __call__(self) -> dict[str, AdapterWeights]:
    """Returns `{kind: AdapterWeights}` for kinds 'attention' and 'mlp'."""
    m, t_, d = self.num_layers, self.num_tasks, self.emb_dim
    b = d // self.config.reduction
    weight = nn.initializers.normal(stddev=WEIGHT_INIT_STDDEV)
    zeros = nn.initializers.zeros
    lead, lead_axes = (m, t_), ('hyper_layers', 'tasks')

    def param(name, init, shape, axes):
      return layers.param_with_axes(name, init, lead + shape, jnp.float32,
                                    axes=lead_axes + axes)

    return {
        kind: AdapterWeights(
            down=param(f'{kind}_down', weight, (d, b),
                       ('embed', 'adapter_bottleneck')),
            down_bias=param(f'{kind}_down_bias', zeros, (b,),
                            ('adapter_bottleneck',)),
            up=param(f'{kind}_up', weight, (b, d),
                     ('adapter_bottleneck', 'embed')),
            up_bias=param(f'{kind}_up_bias', zeros, (d,), ('embed',)),
        )
        for kind in KINDS
    }
