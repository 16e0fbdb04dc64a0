"""Per-task bottleneck adapters: the Vanilla Adapter baseline and its maths.

The Vanilla Adapter is Houlsby et al. (2019) as HyperPrompt's §4 uses it;
HyperFormer++ (`hyperformer.py`) shares the arithmetic. Every block gets two
adapters per task, after the self-attention and after the FFN sublayer (none
after the decoder's cross-attention), on the sublayer's output h before
dropout and the residual:

    h -> h + norm(W_up act(W_down h + b_down) + b_up),

W_down [d, b], W_up [b, d], b = d / reduction; `norm` is the identity here,
HyperFormer++'s generated post layer norm there. The task ids gather each
example's adapters, so no example pays for another task's. On packed rows
each token takes its own task's adapter by `AdapterConfig.packed_form`
(docs/performance.md, "Forms"): 'task_blocks' (`t5/task_blocks.py`),
'pallas' (`segment_kernels.per_task_matmul`, tokens left in place) or
'auto' ('pallas' compiled for a TPU).

Parameters under `<stack>/adapter/`, M layers, T tasks, kinds 'attention'
and 'mlp': `{kind}_down [M, T, d, b]`, `{kind}_down_bias [M, T, b]`,
`{kind}_up [M, T, b, d]`, `{kind}_up_bias [M, T, d]`, initialised near the
identity as Houlsby's (weights N(0, 0.01^2), zero biases). Adafactor takes
absolute steps on them (`optimizers.PARAMETER_SCALE`): under T5's relative
steps this start, far below the working scale, barely moves
(docs/methods.md, "Optimizer").
"""

import functools
from typing import Any, Callable, Optional

from flax import linen as nn
from flax import struct
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from hyperprompt_jax.t5 import layers
from hyperprompt_jax.t5 import segment_kernels
from hyperprompt_jax.t5 import task_blocks as task_blocks_lib
from hyperprompt_jax.t5 import traced_mesh

Array = jax.Array
PLACEMENTS = ('both', 'encoder', 'decoder')
PACKED_FORMS = ('auto', 'task_blocks', 'pallas')
# The method's face (read by `methods.REGISTRY`): the T5Config field that
# holds its config, its parameter scopes and logical axis names, the gin
# variant files that select it, `check` and `is_active`.
CONFIG_FIELD = 'adapter'
SCOPES = ('adapter',)
AXIS_NAMES = ('tasks', 'hyper_layers', 'adapter_bottleneck')
VARIANT_FILES = ('variants/adapter.gin',)
KINDS = ('attention', 'mlp')  # the sublayers an adapter follows
WEIGHT_INIT_STDDEV = 1e-2


@struct.dataclass
class AdapterConfig:
  """Vanilla adapters' settings (gin: `adapters.AdapterConfig`).

  See gin/variants/adapter.gin.

  Attributes:
    placement: the stacks with adapters: 'both', 'encoder' or 'decoder'.
    reduction: the bottleneck is b = d / reduction.
    activation: a flax.linen activation name.
    packed_form: 'auto', 'task_blocks' or 'pallas'.
  """

  placement: str = 'both'
  reduction: int = 32
  activation: str = 'relu'
  packed_form: str = 'auto'


def check_placement(placement: str, owner: str) -> None:
  if placement not in PLACEMENTS:
    raise ValueError(f'{owner}.placement (PLACEMENT) must be one of '
                     f'{PLACEMENTS}, got {placement!r}.')


def check_reduction(reduction: int, emb_dim: int, macro: str) -> None:
  if reduction <= 0 or emb_dim % reduction:
    raise ValueError(
        f'{macro}={reduction} must be a positive divisor of d_model='
        f'{emb_dim} (the adapter bottleneck is b = d / {macro}).')


def check_packed_form(form: str, owner: str) -> None:
  if form not in PACKED_FORMS:
    raise ValueError(f'{owner}.packed_form must be one of {PACKED_FORMS}, '
                     f'got {form!r}.')


def resolve_packed_form(form: str) -> str:
  """'auto' -> 'pallas' compiled for a TPU, else 'task_blocks'."""
  if form != 'auto':
    return form
  return 'pallas' if traced_mesh.target_platform() == 'tpu' else 'task_blocks'


def check_adapter_config(cfg: AdapterConfig, emb_dim: int) -> None:
  """Raises ValueError on settings that cannot build the adapters."""
  check_placement(cfg.placement, 'AdapterConfig')
  check_reduction(cfg.reduction, emb_dim, 'ADAPTER_REDUCTION')
  check_packed_form(cfg.packed_form, 'AdapterConfig')
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
    norm_scale: `[M, T, d]`, HyperFormer++'s post layer norm, or None.
    norm_bias: `[M, T, d]`, or None.
  """

  down: Array
  down_bias: Array
  up: Array
  up_bias: Array
  norm_scale: Optional[Array] = None
  norm_bias: Optional[Array] = None


def unstack(a: Array) -> list[Array]:
  """`a [K, ...]` -> K arrays `[...]`, by one split.

  Its gradient is one concatenate. `a[k]`'s is `a`'s shape padded with zeros,
  and XLA adds the K pads inside every fusion that reads their sum, several in
  Adafactor (docs/performance.md, "Packing").
  """
  return [jnp.squeeze(part, 0) for part in jnp.split(a, a.shape[0])]


def per_layer(weights: dict[str, AdapterWeights]
              ) -> list[dict[str, AdapterWeights]]:
  """`{kind: AdapterWeights}` of `[M, T, ...]` -> each layer's, `[T, ...]`."""
  leaves, treedef = jax.tree.flatten(weights)
  layers_of = [unstack(a) for a in leaves]
  return [treedef.unflatten([parts[m] for parts in layers_of])
          for m in range(len(layers_of[0]))]


_LAYER_NORM_EPSILON = 1e-6


def layer_norm(x: Array, scale: Array, bias: Array) -> Array:
  """Standard layer norm over the last axis, in float32; returns `x`'s dtype.

  Centred, with bias, epsilon 1e-6; `scale` and `bias` broadcast against `x`.
  Not `layers.LayerNorm`, which is T5's RMS norm with a parameter of its own.
  """
  x32 = jnp.asarray(x, jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + _LAYER_NORM_EPSILON)
  return jnp.asarray(y * scale + bias, x.dtype)


_HIGHEST = jax.lax.Precision.HIGHEST  # a TPU sums float32 in bfloat16 passes


def _dot(spec: str, a: Array, b: Array) -> Array:
  """`jnp.einsum` in the operands' dtype, accumulated in float32."""
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def adapt_groups(activation: Callable[[Array], Array], x: Array,
                 down: Array, down_bias: Array, up: Array, up_bias: Array,
                 norm: Optional[tuple[Array, Array]]) -> Array:
  """The adapter's output for groups of tokens of one task each.

  `norm(W_up act(W_down x + b_down) + b_up)`; the caller adds it to h. The
  gradient is written out (`_adapt_groups_bwd`) so that every matmul reaches
  XLA:CPU's fast kernels: the weight gradients contract over a group's tokens
  and want the bottleneck laid out `[G, b, L]`, which autodiff does not give
  (XLA folds a transpose back), so the backward pass forms the bottleneck and
  its cotangent again in that layout (docs/performance.md, "Forms").

  Args:
    activation: elementwise, e.g. `jax.nn.relu`.
    x: `[G, L, d]`, in the activations' dtype (matmuls accumulate in
      float32).
    down: W_down as `[G, b, d]`.
    down_bias: `[G, b]`.
    up: W_up, `[G, b, d]`.
    up_bias: `[G, d]`.
    norm: None, or HyperFormer++'s post layer norm `(scale, bias)`, `[G, d]`
      each.

  Returns:
    `[G, L, d]` in `x`'s dtype.
  """
  return _adapt_groups_fwd(activation, x, down, down_bias, up, up_bias,
                           norm)[0]


def adapt_groups_autodiff(activation: Callable[[Array], Array], x: Array,
                          down: Array, down_bias: Array, up: Array,
                          up_bias: Array,
                          norm: Optional[tuple[Array, Array]]) -> Array:
  """`adapt_groups` with JAX's gradient (`gradient_form='autodiff'`)."""
  return _adapt_groups_fwd(activation, x, down, down_bias, up, up_bias,
                           norm)[0]


def _adapt_groups_fwd(activation, x, down, down_bias, up, up_bias, norm):
  dtype = x.dtype
  pre = _dot('gld,gbd->glb', x, down.astype(dtype)) + down_bias[:, None]
  z = activation(pre).astype(dtype)
  if norm is None:
    out = _dot('glb,gbd->gld', z, up.astype(dtype)) + up_bias[:, None]
    inv_std = None
  else:
    out, inv_std = _norm_up_fwd(z, up, up_bias, *norm)
  return (out.astype(dtype),
          (x, down, down_bias, up, up_bias, norm, pre, inv_std))


def _adapt_groups_bwd(activation, residuals, g):
  x, down, down_bias, up, up_bias, norm, pre, inv_std = residuals
  dtype = x.dtype
  down_x = down.astype(dtype)
  pre_t = _dot('gbd,gld->gbl', down_x, x) + down_bias[..., None]  # [G, b, L]
  z_t = activation(pre_t).astype(dtype)
  if norm is None:
    up_x = up.astype(dtype)
    dz, dz_t = _dot('gld,gbd->glb', g, up_x), _dot('gbd,gld->gbl', up_x, g)
    # [z; 1]^T g: the bias's gradient (sum_l g) as one more row of W_up's,
    # where a sum of its own read g in float32, converted.
    ones = jnp.ones_like(z_t[:, :1])
    zt_g = _dot('gbl,gld->gbd', jnp.concatenate([z_t, ones], axis=1), g)
    d_up, d_up_bias = zt_g[:, :-1], zt_g[:, -1]
    d_norm = None
  else:
    z = activation(pre).astype(dtype)
    dz, dz_t, d_up, d_up_bias, d_norm = _norm_up_bwd(
        z, z_t, up, up_bias, norm[0], inv_std, g)
  d_pre = jax.vjp(activation, pre)[1](dz)[0]
  d_pre_t = jax.vjp(activation, pre_t)[1](dz_t)[0]
  dx = _dot('glb,gbd->gld', d_pre.astype(dtype), down_x)
  d_down = _dot('gbl,gld->gbd', d_pre_t.astype(dtype), x)
  return (dx.astype(dtype), d_down.astype(down.dtype),
          jnp.sum(d_pre, axis=1).astype(down_bias.dtype),
          d_up.astype(up.dtype), d_up_bias.astype(up_bias.dtype), d_norm)


adapt_groups.defvjp(_adapt_groups_fwd, _adapt_groups_bwd)


def _centred_terms(up32: Array, c: Array):
  """W_up and its bias centred over d, and the norm's second moments.

  `gram = U U^T / d [G, b, b]`, `cross = U k^T / d [G, b]`.
  """
  d = up32.shape[-1]
  uc = up32 - jnp.mean(up32, axis=-1, keepdims=True)
  cc = c - jnp.mean(c, axis=-1, keepdims=True)
  gram = jnp.einsum('gbd,gcd->gbc', uc, uc, precision=_HIGHEST) / d
  cross = jnp.einsum('gbd,gd->gb', uc, cc, precision=_HIGHEST) / d
  return uc, cc, gram, cross


def _inv_std(z32: Array, cc: Array, gram: Array, cross: Array) -> Array:
  """1 / std over d of each row of o = z W_up + c, `[G, L]`.

  o centred is z U + k, so var = z gram z^T + 2 z cross + mean_d(k^2).
  """
  var = (jnp.sum(jnp.einsum('glb,gbc->glc', z32, gram, precision=_HIGHEST)
                 * z32, axis=-1)
         + 2 * jnp.einsum('glb,gb->gl', z32, cross, precision=_HIGHEST)
         + jnp.mean(jnp.square(cc), axis=-1)[:, None])
  return jax.lax.rsqrt(jnp.maximum(var, 0.) + _LAYER_NORM_EPSILON)


def _norm_up_fwd(z, up, up_bias, scale, bias):
  """HyperFormer++'s up projection and post layer norm, per group.

  Float32 `layer_norm(z W_up + up_bias, scale, bias)` `[G, L, d]`, and 1 / std
  `[G, L]`. The norm never sees its `[L, d]` input: with U, k = W_up, up_bias
  centred over d, a normed row is inv_std (z U + k) and inv_std comes from the
  bottleneck (`_inv_std`), so the forward is one matmul, (z inv_std) (U
  scale). A norm over the output kept it for the backward pass and read it
  several times (docs/performance.md, "Packing").
  """
  z32 = jnp.asarray(z, jnp.float32)
  uc, cc, gram, cross = _centred_terms(jnp.asarray(up, jnp.float32), up_bias)
  inv_std = _inv_std(z32, cc, gram, cross)
  out = _dot('glb,gbd->gld', (z32 * inv_std[..., None]).astype(z.dtype),
             (uc * scale[:, None]).astype(z.dtype))
  out = out + inv_std[..., None] * (cc * scale)[:, None] + bias[:, None]
  return out, inv_std


def _norm_up_bwd(z, z_t, up, up_bias, scale, inv_std, g):
  """The gradient of `_norm_up_fwd`, given `z` also as `z_t [G, b, L]`.

  Returns (dz, dz_t, d_up, d_up_bias, (d_scale, d_bias)). The layer norm's
  gradient at o is do = inv_std (gs - mean_d(gs) - beta y), gs = g scale,
  y = inv_std (z U + k), beta = mean_d(gs y), taken through o = z W_up + c
  and rewritten through z, U and k. The mean_d(gs) terms vanish from dz (U's
  rows sum to 0 over d) and centre dW_up and dc. What needs the cotangent
  comes from three matmuls: g [U scale; k scale]^T, its transpose for dz_t,
  and [z inv_std, inv_std, 1]^T g.
  """
  d, b, dtype = up.shape[-1], z.shape[-1], z.dtype
  z32, z32_t = jnp.asarray(z, jnp.float32), jnp.asarray(z_t, jnp.float32)
  uc, cc, gram, cross = _centred_terms(jnp.asarray(up, jnp.float32), up_bias)
  g_weights = jnp.concatenate([uc * scale[:, None], (cc * scale)[:, None]],
                              axis=1).astype(dtype)              # [G, b+1, d]
  gs_up = _dot('gld,gbd->glb', g, g_weights)
  gs_uc, gs_k = gs_up[..., :b], gs_up[..., b]
  gs_uc_t = _dot('gbd,gld->gbl', g_weights[:, :b], g)           # [G, b, L]
  ones = jnp.ones_like(inv_std)[:, None]
  z_rows = jnp.concatenate([z32_t * inv_std[:, None], inv_std[:, None], ones],
                           axis=1)                               # [G, b+2, L]
  zt_g = _dot('gbl,gld->gbd', z_rows.astype(dtype), g)          # [G, b+2, d]
  zt_g, col_g_inv_std, col_g = zt_g[:, :b], zt_g[:, b], zt_g[:, b + 1]
  beta = inv_std / d * (jnp.sum(gs_uc * z32, axis=-1) + gs_k)   # [G, L]
  # y U^T = inv_std (z U + k) U^T = d inv_std (z gram + cross), in both
  # layouts (gram is symmetric).
  y_up = d * inv_std[..., None] * (
      jnp.einsum('glb,gbc->glc', z32, gram, precision=_HIGHEST)
      + cross[:, None])
  y_up_t = d * inv_std[:, None] * (
      jnp.einsum('gbc,gcl->gbl', gram, z32_t, precision=_HIGHEST)
      + cross[..., None])
  dz = inv_std[..., None] * (gs_uc - beta[..., None] * y_up)
  dz_t = inv_std[:, None] * (gs_uc_t - beta[:, None] * y_up_t)
  # The beta y terms of dW_up and dc: sum_l w_l (z_l U + k), w = inv_std^2
  # beta.
  w = jnp.square(inv_std) * beta
  zw = jnp.einsum('glb,gl->gb', z32, w, precision=_HIGHEST)
  zwz = jnp.einsum('gbl,gl,glc->gbc', z32_t, w, z32, precision=_HIGHEST)
  zt_gs = zt_g * scale[:, None]
  d_up = (zt_gs - jnp.mean(zt_gs, axis=-1, keepdims=True)
          - jnp.einsum('gbc,gcd->gbd', zwz, uc, precision=_HIGHEST)
          - zw[..., None] * cc[:, None])
  col_gs = scale * col_g_inv_std
  d_up_bias = (col_gs - jnp.mean(col_gs, axis=-1, keepdims=True)
               - jnp.einsum('gb,gbd->gd', zw, uc, precision=_HIGHEST)
               - jnp.sum(w, axis=1)[:, None] * cc)
  d_scale = jnp.sum(zt_g * uc, axis=1) + cc * col_g_inv_std    # sum_l g y
  return dz, dz_t, d_up, d_up_bias, (d_scale, col_g)


class LayerAdapters:
  """One layer's adapters bound to the batch's task ids.

  `weights`: `{kind: AdapterWeights}` of `[T, ...]` (`per_layer`); task ids
  `[batch]`, or `[batch, length]` when `packed`. `gradient_form`: as
  `T5Config`'s; `packed_form`: as `AdapterConfig`'s.
  """

  def __init__(self, weights: dict[str, AdapterWeights],
               task_ids: Optional[Array], activation: str,
               packed: bool = False, gradient_form: str = 'auto',
               packed_form: str = 'auto'):
    if task_ids is None:
      raise ValueError(
          'Adapters need task_ids (int32 [batch]) but none were given: pass '
          'task_ids to encode / decode / __call__ (the feature converter adds '
          'them).')
    self.weights = weights
    self.task_ids = task_ids
    self.activation = layers.activation(activation)
    self.packed = packed
    self.form = task_blocks_lib.resolve_gradient_form(gradient_form)
    self.packed_form = resolve_packed_form(packed_form)

  def __call__(self, h: Array, kind: str) -> Array:
    """`h [batch, length, d]` after sublayer `kind` -> adapted `h`."""
    w = self.weights[kind]
    if self.packed:
      return h + self._per_token(h, w, self.task_ids)
    return h + self._adapt(h, w, self.task_ids)

  def _adapt(self, x: Array, w: AdapterWeights, group_tasks: Array
             ) -> Array:
    """`x [G, length, d]`, group g through task `group_tasks[g]`'s adapter."""

    def take(a):  # each group's task: [groups, ...]
      return task_blocks_lib.take_tasks(a, group_tasks)

    # W_down as [groups, b, d], the layout `adapt_groups` takes it in; the
    # transpose is of the [T, d, b] weights, not of the groups' copies.
    norm = (None if w.norm_scale is None
            else (take(w.norm_scale), take(w.norm_bias)))
    adapt = adapt_groups if self.form == 'written' else adapt_groups_autodiff
    return adapt(self.activation, x, take(jnp.swapaxes(w.down, -1, -2)),
                 take(w.down_bias), take(w.up), take(w.up_bias), norm)

  def _per_token(self, h: Array, w: AdapterWeights, task_ids: Array
                 ) -> Array:
    """Packed rows: each token through its own task's adapter, without `h + .`.

    'pallas': `adapt_on_chip`. Else the tokens are laid out in blocks of one
    task (`task_blocks`), each block one `[block, d] x [d, b]` matmul: a token
    costs one adapter plus the blocks' padding and weight copies, and a data
    shard's tokens stay on its devices. All T tasks' adapters on every token
    would cost T adapters a token and keep `[batch, length, T, b]`.
    """
    if self.packed_form == 'pallas':
      return adapt_on_chip(self.activation, h, w, task_ids)
    n, length, d = h.shape
    num_tasks = w.down.shape[0]
    # A block copies its task's W_down and W_up: 2 b rows of d.
    blocks = task_blocks_lib.batch_task_blocks(task_ids, num_tasks,
                                               2 * w.up.shape[-2], self.form)
    x = blocks.to_blocks(h.reshape(n * length, d))  # [S * K, block, d]
    out = self._adapt(x, w, blocks.tasks)
    return blocks.from_blocks(out).reshape(n, length, d)


_DOWN_PROJECTION = 'adapter_down_projection'


def adapt_on_chip(activation: Callable[[Array], Array], h: Array,
                  w: AdapterWeights, task_ids: Array) -> Array:
  """The adapter's output for packed rows, each token by its task's weights.

  `h [batch, length, d]`, `task_ids [batch, length]`; the caller adds the
  output to h. No per-token copy of the weights: W_up's bias is one more row
  of W_up against a ones column of the bottleneck, and so is HyperFormer++'s
  norm (`_norm_weights`). The backward pass keeps `h` and the down projection
  only (`_tokens_on_chip`).
  """
  up = jnp.concatenate([w.up, w.up_bias[:, None]], axis=1)  # [T, b + 1, d]
  if w.norm_scale is None:
    gram = None
  else:
    up, gram = _norm_weights(up, w.norm_scale, w.norm_bias)
  # In the activations' dtype, as the kernels take them (the backward pass
  # keeps them); W_down as `[T, b, d]`, its wide side last
  # (`per_task_matmul`).
  return _tokens_on_chip(activation, h,
                         jnp.swapaxes(w.down, -1, -2).astype(h.dtype),
                         w.down_bias, up.astype(h.dtype), gram, task_ids)


def _norm_weights(up: Array, scale: Array, bias: Array) -> tuple[Array, Array]:
  """HyperFormer++'s post layer norm as weights on the bottleneck `u`.

  With `W = up [T, b + 1, d]` centred over d (Wc), a row's centred output is
  u Wc and its variance u (Wc Wc^T / d) u^T, so the normed row is
  `[inv_std u; 1] [Wc ⊙ scale; bias]`. Returns those weights `[T, b + 2, d]`
  and the gram `[T, b + 1, b + 1]`, float32.
  """
  up32 = up.astype(jnp.float32)
  centred = up32 - jnp.mean(up32, axis=-1, keepdims=True)
  gram = jnp.einsum('tbd,tcd->tbc', centred, centred,
                    precision=_HIGHEST) / up.shape[-1]
  weights = jnp.concatenate([centred * scale[:, None], bias[:, None]], axis=1)
  return weights, gram


# Saving only the down projection: an array of b columns fills a TPU's
# 128 lanes, and keeping the bottleneck, pre-activations and variances held
# far more temporaries than MTL's step (docs/performance.md, "On a TPU
# slice, from this host").
@functools.partial(
    jax.checkpoint, static_argnums=(0,),
    policy=jax.checkpoint_policies.save_only_these_names(_DOWN_PROJECTION))
def _tokens_on_chip(activation: Callable[[Array], Array], h: Array,
                    down: Array, down_bias: Array, up: Array,
                    gram: Optional[Array], task_ids: Array) -> Array:
  """`adapt_on_chip`'s tokens, given its `[T, ...]` weights.

  `down [T, b, d]`, `down_bias [T, b]`, `up [T, b + 1, d]` (W_up and its
  bias) or, with the norm, `_norm_weights`' `[T, b + 2, d]` and `gram`.
  """
  projection = checkpoint_name(
      segment_kernels.per_task_matmul(h, down, task_ids, transposed=True),
      _DOWN_PROJECTION)
  pre = projection + task_blocks_lib.take_tasks(down_bias, task_ids)
  z = activation(pre).astype(h.dtype)
  u = jnp.concatenate([z, jnp.ones_like(z[..., :1])], axis=-1)
  if gram is None:
    return segment_kernels.per_task_matmul(u, up, task_ids)
  u32 = u.astype(jnp.float32)
  variance = jnp.sum(
      segment_kernels.per_task_matmul(u32, gram, task_ids,
                                      precision=_HIGHEST) * u32, axis=-1)
  inv_std = jax.lax.rsqrt(jnp.maximum(variance, 0) + _LAYER_NORM_EPSILON)
  normed_u = jnp.concatenate(
      [(u32 * inv_std[..., None]).astype(u.dtype), jnp.ones_like(u[..., :1])],
      axis=-1)
  return segment_kernels.per_task_matmul(normed_u, up, task_ids)


def _flatten_layer_adapters(adapters: LayerAdapters):
  return ((adapters.weights, adapters.task_ids),
          (adapters.activation, adapters.packed, adapters.form,
           adapters.packed_form))


def _unflatten_layer_adapters(aux, children) -> LayerAdapters:
  # Not through __init__: its check is on what the caller passed, and the
  # activation is already the function.
  adapters = object.__new__(LayerAdapters)
  adapters.weights, adapters.task_ids = children
  (adapters.activation, adapters.packed, adapters.form,
   adapters.packed_form) = aux
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
    """Returns `{kind: AdapterWeights}` for 'attention' and 'mlp'."""
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
