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
each token goes through its own task's adapter (`LayerAdapters._per_token`).

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
      return h + self._per_token(h, w)

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

  def _per_token(self, h: Array, w: AdapterWeights) -> Array:
    """Packed rows (`task_ids [batch, length]`): each token through its own
    task's adapter, without the adapter update `h -> h + .`.

    Gathering a weight per token would hold `[batch, length, d, b]`; instead
    every token goes down through all T tasks' `W_down` at once (`[batch,
    length, T, b]`, T * b = 192 columns at GLUE's T = 8, T5-base's b = 24:
    small next to the FFN's d_ff) and the other tasks' bottlenecks are zeroed
    before one `[T * b, d]` up-projection, so each token's output is exactly
    its own task's adapter. Vectors (biases, norms) are gathered per token.
    Grouping tokens by task (`jax.lax.ragged_dot`) measured 3.7x slower on a
    CPU (docs/performance.md, Packing).
    """
    num_tasks = w.down.shape[1]
    one_hot = jax.nn.one_hot(self.task_ids, num_tasks, dtype=h.dtype)

    def take(a):  # layer m, then each token's task: [batch, length, ...]
      return jnp.take(a[self.layer], self.task_ids, axis=0).astype(h.dtype)

    z = jnp.einsum('nld,tdb->nltb', h, w.down[self.layer].astype(h.dtype))
    z = self.activation(z + w.down_bias[self.layer].astype(h.dtype))
    z = z * one_hot[..., None]
    out = (jnp.einsum('nltb,tbd->nld', z, w.up[self.layer].astype(h.dtype))
           + take(w.up_bias))
    if w.norm_scale is not None:
      out = layer_norm(out, take(w.norm_scale), take(w.norm_bias))
    return out


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
