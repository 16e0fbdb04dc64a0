"""HyperGrid (Tay et al., ICLR 2021): grid-wise gating of FFN weights.

For a layer input x and a conditioning vector c in R^{d_model} (one per
example), a gated FFN projection computes (Eq. 7, the paper's residual form)

    y = x W + x (G ⊙ W),   G = psi(sigma(grid)),

the grid being `d_r x d_c` (d_r splits d_model, d_c splits d_ff) and psi
repeating each value over its block (`jnp.repeat`, not a tile):

    L2:  grid = (L_r c) ⊗ (L_c c)        (Eq. 3)
    LG:  grid = (L_r c) ⊗ G_c            (Eq. 4)
    GL:  grid = G_r ⊗ (L_c c)            (Eq. 5)
    L:   sigma(L_r c) along d_model, broadcast along d_ff

with L_r [d_model, d_r], L_c [d_model, d_c], G_r [d_r], G_c [d_c] per layer;
sigma comes after the outer product. The Output Gating baseline (§6.4) is
`max(W x, 0) ⊙ sigma(U c)`, U [d_model, n], n = d_ff or n values repeated.

c: a per-stack task embedding, layer-normed, is the single query of each
layer's own attention over [task; tokens] (Sec. 2.1, Eq. 6, T' =
MHSA([T;X])_0): the encoder's self-attention, the decoder's cross-attention
over `encoded`, so no target token reaches a gate and a decoder's gate is
fixed across decode steps. Eq. 6 says neither whether MHSA is a new module
nor whether T is per layer; the paper's parameter costs count neither, so
each layer reuses its attention and one table serves the stack.
'first_token': c is the first token of the layer's normed input (encoder)
or of `encoded` (decoder), as in arXiv 2007.05891, Sec. 3.2.

Compute rule (`gated_matmul_route`), the grid taken as `[k_in, k_out]`
blocks of the kernel `[d_in, d_out]`: an elementwise gate when k_in or k_out
is 1 (L, scalar); blockwise when `length * k_in < d_in` (decoding, short
inputs): partial sums over input blocks or one gated input copy per output
block, whichever intermediate is smaller; else `(1 + G) ⊙ W` folded into a
per-example weight. All are exact. The memory threshold is also about where
time crosses over on a CPU (`python -m hyperprompt_jax.benchmark
--gated_matmul`).

Packed rows: each of a row's S <= `max_segments` examples gets its own c,
from its own tokens only, and its own gated weights, applied by
`packed_form` (docs/performance.md, "Forms"): 'blockwise', 'grouped',
'pallas' (`segment_kernels.py`) or 'auto' (`resolve_packed_form`).

Eqs. 3-5: `GridGate`; psi and Eq. 7: `gated_matmul`, in `GatedDenseGeneral`
inside `GatedMlpBlock` (t5x's parameter names); Eq. 6: `TaskQueryAttention`;
Output Gating: `OutputGate`. A stack's conditioning is one `StackGating`
(built by `conditioning.py`); while decoding, its gates are computed with
the cache and read back (`cached_grid`, `cached_gate`).
"""

import dataclasses
from typing import Any, Callable, Optional

from flax import linen as nn
from flax import struct
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import numpy as np

import hyperprompt_jax
from hyperprompt_jax.t5 import layers
from hyperprompt_jax.t5 import segment_kernels
from hyperprompt_jax.t5 import task_blocks
from hyperprompt_jax.t5 import traced_mesh

Array = jax.Array
VARIANTS = ('l', 'l2', 'lg', 'gl', 'output_gating')
TARGETS = ('wo', 'wi', 'both')
CONDITIONINGS = ('task_attention', 'first_token')
PLACEMENTS = ('both', 'encoder', 'decoder')

# The method's face (read by `methods.REGISTRY`): the T5Config field that
# holds its config, its parameter scopes and logical axis names, the gin
# variant files that select it, `check` and `is_active`.
CONFIG_FIELD = 'hypergrid'
SCOPES = ('hypergrid', 'output_gating')
AXIS_NAMES = ('tasks', 'grid_rows', 'grid_cols')
VARIANT_FILES = ('variants/hypergrid_l.gin', 'variants/hypergrid_l2.gin',
                 'variants/hypergrid_lg.gin', 'variants/hypergrid_gl.gin',
                 'variants/output_gating.gin')
PACKED_FORMS = ('auto', 'blockwise', 'grouped', 'pallas')
# Old packed-form names -> new: the old one warns for one release
# ('token_blocks' read too much like 'task_blocks', another form).
RENAMED_PACKED_FORMS = {'token_blocks': 'blockwise'}


@struct.dataclass
class HyperGridConfig:
  """HyperGrid's settings (gin: `hypergrid.HyperGridConfig`).

  See gin/variants/hypergrid_*.gin.

  Attributes:
    variant: 'l', 'l2', 'lg', 'gl' or 'output_gating'.
    placement: the gated stacks: 'both', 'encoder' or 'decoder'.
    grid_rows: d_r, splits d_model.
    grid_cols: d_c, splits d_ff.
    target: the gated kernels: 'wo', 'wi' (`wi_0` and `wi_1`) or 'both'.
    conditioning: 'task_attention' (Eq. 6) or 'first_token'.
    scalar: Table 7's Scalar HyperGrid, the grid mean-pooled to one gate.
    output_gating_values: Output Gating's n gate values repeated over d_ff;
      0: d_ff.
    max_segments: MAX_SEGMENTS, the most examples a packed row holds (the
      packer closes a row there; a row over it is an error).
    packed_form: how a packed row's tokens meet their own example's gated
      weight: 'auto', 'blockwise', 'grouped' or 'pallas'.
  """

  variant: str = 'lg'
  placement: str = 'both'
  grid_rows: int = 32
  grid_cols: int = 128
  target: str = 'wo'
  conditioning: str = 'task_attention'
  scalar: bool = False
  output_gating_values: int = 0
  max_segments: int = 8
  packed_form: str = 'auto'


def check_hypergrid_config(cfg: HyperGridConfig, emb_dim: int,
                           mlp_dim: int) -> None:
  """Raises ValueError on settings that cannot build HyperGrid."""
  renamed_packed_form(cfg.packed_form)  # warns on an old name
  for name, value, allowed in (('variant', cfg.variant, VARIANTS),
                               ('placement (PLACEMENT)', cfg.placement,
                                PLACEMENTS),
                               ('target (HYPERGRID_TARGET)', cfg.target,
                                TARGETS),
                               ('conditioning (HYPERGRID_CONDITIONING)',
                                cfg.conditioning, CONDITIONINGS),
                               ('packed_form',
                                RENAMED_PACKED_FORMS.get(cfg.packed_form,
                                                         cfg.packed_form),
                                PACKED_FORMS)):
    if value not in allowed:
      raise ValueError(f'HyperGridConfig.{name} must be one of {allowed}, '
                       f'got {value!r}.')
  if cfg.max_segments < 1:
    raise ValueError(f'MAX_SEGMENTS={cfg.max_segments} (HyperGridConfig.'
                     'max_segments) must be >= 1: it bounds the examples of '
                     'a packed row.')
  if cfg.variant == 'output_gating':
    n = cfg.output_gating_values
    if n < 0 or (n and mlp_dim % n):
      raise ValueError(
          f'output_gating_values={n} must be 0 (full size) or divide '
          f'd_ff={mlp_dim}.')
    return
  if cfg.grid_rows <= 0 or emb_dim % cfg.grid_rows:
    raise ValueError(
        f'GRID_ROWS={cfg.grid_rows} must be a positive divisor of d_model='
        f'{emb_dim} (d_r splits the d_model axis into blocks).')
  if cfg.variant != 'l' and (cfg.grid_cols <= 0 or mlp_dim % cfg.grid_cols):
    raise ValueError(
        f'GRID_COLS={cfg.grid_cols} must be a positive divisor of d_ff='
        f'{mlp_dim} (d_c splits the d_ff axis into blocks).')


def check(cfg: HyperGridConfig, model_config: Any) -> None:
  check_hypergrid_config(cfg, model_config.emb_dim, model_config.mlp_dim)


def is_active(cfg: Optional[HyperGridConfig], stack: str) -> bool:
  return cfg is not None and cfg.placement in ('both', stack)


def scope_name(cfg: HyperGridConfig) -> str:
  """Parameter scope: 'output_gating' for the baseline, else 'hypergrid'."""
  return 'output_gating' if cfg.variant == 'output_gating' else 'hypergrid'


def _param(module, name, init, shape, axes):
  return nn_partitioning.param_with_axes(name, init, shape, jnp.float32,
                                         axes=axes, module=module)


class TaskEmbedding(nn.Module):
  """Per-stack task embedding table `[tasks, embed]`, gathered by task id."""

  num_tasks: int
  emb_dim: int

  @nn.compact
  def __call__(self, task_ids: Optional[Array]) -> Array:
    """int32 `[batch]` -> `[batch, embed]`."""
    if task_ids is None:
      raise ValueError(
          'HyperGrid needs task_ids (int32 [batch]) but none were given: pass '
          'task_ids to encode / decode / __call__ (the feature converter adds '
          'them).')
    table = _param(self, 'task_embeddings', nn.initializers.normal(1.0),
                   (self.num_tasks, self.emb_dim), ('tasks', 'embed'))
    return task_blocks.take_tasks(table, task_ids)


class GridGate(nn.Module):
  """One layer's sigmoid gate grid from its conditioning vector (Eqs. 3-5).

  `[batch, d_r, d_c]`, the paper's orientation (L: `[batch, d_r, 1]`; scalar:
  `[batch, 1, 1]`), block-repeated onto a kernel by `gated_matmul`.
  """

  config: HyperGridConfig
  emb_dim: int

  @nn.compact
  def __call__(self, c: Optional[Array], decode: bool = False) -> Array:
    """`c [batch, embed]` -> `[batch, rows, cols]`; `decode` caches it.

    With `decode`, the grid is computed when the cache is created and read from
    its `cached_grid` afterwards (`c` may then be None).
    """
    return _cached(self, 'cached_grid', lambda: self._grid(c), decode)

  def _grid(self, c: Array) -> Array:
    """`c [..., embed]` (packed: `[batch, S, embed]`) -> `[..., rows, cols]`."""
    cfg = self.config
    d, d_r, d_c = self.emb_dim, cfg.grid_rows, cfg.grid_cols
    dense_init = nn.initializers.variance_scaling(1.0, 'fan_in', 'normal')
    c = c.astype(jnp.float32)
    rows = cols = None
    if cfg.variant in ('l', 'l2', 'lg'):
      rows = c @ _param(self, 'local_rows', dense_init, (d, d_r),
                        ('embed', 'grid_rows'))                   # L_r c
    if cfg.variant in ('l2', 'gl'):
      cols = c @ _param(self, 'local_cols', dense_init, (d, d_c),
                        ('embed', 'grid_cols'))                   # L_c c
    if cfg.variant == 'gl':
      rows = jnp.broadcast_to(_param(self, 'global_rows',
                                     nn.initializers.normal(1.0), (d_r,),
                                     ('grid_rows',)), c.shape[:-1] + (d_r,))
    if cfg.variant == 'lg':
      cols = jnp.broadcast_to(_param(self, 'global_cols',
                                     nn.initializers.normal(1.0), (d_c,),
                                     ('grid_cols',)), c.shape[:-1] + (d_c,))
    if cfg.variant == 'l':
      grid = jax.nn.sigmoid(rows)[..., :, None]
    else:
      grid = jax.nn.sigmoid(rows[..., :, None] * cols[..., None, :])
    if cfg.scalar:
      grid = jnp.mean(grid, axis=(-2, -1), keepdims=True)
    return grid


def orient_grid(grid: Array, kernel_rows_are_model: bool) -> Array:
  """Paper orientation `[..., d_r, d_c]` -> the kernel's `[in, out]` blocks.

  `wi` kernels are `[d_model, d_ff]` (same); `wo` `[d_ff, d_model]` (swapped).
  """
  return grid if kernel_rows_are_model else jnp.swapaxes(grid, -2, -1)


def gated_matmul_route(length: int, d_in: int, k_in: int, k_out: int) -> str:
  """The compute rule: 'output', 'input', 'blockwise' or 'fold'."""
  if k_in == 1:
    return 'output'
  if k_out == 1:
    return 'input'
  return 'blockwise' if length * k_in < d_in else 'fold'


def gated_matmul(x: Array, kernel: Array, grid: Array,
                 route: Optional[str] = None) -> Array:
  """`x ((1 + psi(grid)) ⊙ kernel)` per example, by the cheapest route.

  Args:
    x: `[batch, length, d_in]`.
    kernel: `[d_in, d_out]`.
    grid: `[batch, k_in, k_out]` gate values in (0, 1), oriented to the
      kernel; `d_in % k_in == d_out % k_out == 0`.
    route: force 'blockwise' or 'fold' (benchmarks); default: the rule of
      `gated_matmul_route`.

  Returns:
    `[batch, length, d_out]`.
  """
  _, length, d_in = x.shape
  d_out = kernel.shape[1]
  k_in, k_out = grid.shape[1:]
  grid = grid.astype(x.dtype)
  route = route or gated_matmul_route(length, d_in, k_in, k_out)
  if route == 'output':  # gate varies along the output only
    gate = jnp.repeat(grid[:, 0, :], d_out // k_out, axis=-1)
    return (x @ kernel) * (1 + gate)[:, None, :]
  if route == 'input':  # gate varies along the input only
    gate = jnp.repeat(grid[:, :, 0], d_in // k_in, axis=-1)
    return (x * (1 + gate)[:, None, :]) @ kernel
  if route == 'blockwise':
    return _blockwise_gated_matmul(x, kernel, grid[:, None])
  # Fold (1 + G) into a per-example weight [batch, d_in, d_out].
  full_gate = jnp.repeat(jnp.repeat(grid, d_out // k_out, axis=2),
                         d_in // k_in, axis=1)
  return jnp.einsum('bli,bio->blo', x, (1 + full_gate) * kernel)


def _blockwise_gated_matmul(x: Array, kernel: Array, grid: Array) -> Array:
  """The blockwise route, on the side with the smaller intermediate.

  `grid`: `[batch, 1, k_in, k_out]`, or `[batch, length, k_in, k_out]` per
  token (packed rows).
  """
  batch, length, d_in = x.shape
  d_out = kernel.shape[1]
  k_in, k_out = grid.shape[2:]
  if k_out * d_in < k_in * d_out:
    in_gate = jnp.repeat(jnp.swapaxes(grid, -1, -2), d_in // k_in, axis=-1)
    out = jnp.einsum('blri,rio->blro', x[:, :, None, :] * (1 + in_gate),
                     jnp.swapaxes(kernel.reshape(d_in, k_out, d_out // k_out),
                                  0, 1))
    return out.reshape(batch, length, d_out)
  partial = jnp.einsum('blci,cio->blco',
                       x.reshape(batch, length, k_in, d_in // k_in),
                       kernel.reshape(k_in, d_in // k_in, d_out))
  out_gate = 1 + jnp.repeat(grid, d_out // k_out, axis=-1)
  if out_gate.shape[1] == 1:  # one grid per row
    return jnp.einsum('blco,bco->blo', partial, out_gate[:, 0])
  return jnp.einsum('blco,blco->blo', partial, out_gate)


# -- Packed rows: every example gated by its own grid -------------------------
#
# Exact selections are one-hot contractions at HIGHEST precision, not
# gathers: each output is one input times 1, and the gradient a matmul, not
# XLA:CPU's slow scatter.
_EXACT = jax.lax.Precision.HIGHEST


def segment_one_hot(segment_ids: Array, num_segments: int,
                    dtype: Any = jnp.float32) -> Array:
  """Segment ids `[batch, length]` (1..S, 0: padding) -> one-hot `[..., S]`."""
  return (segment_ids[..., None]
          == jnp.arange(1, num_segments + 1)).astype(dtype)


def segment_task_ids(task_ids: Array, segment_ids: Array,
                     num_segments: int) -> Array:
  """Per-token task ids -> each segment's, `[batch, S]` (0: no such segment)."""
  member = segment_one_hot(segment_ids, num_segments, bool)
  return jnp.max(jnp.where(member, task_ids[..., None], 0), axis=1)


def segment_first_tokens(x: Array, segment_ids: Array,
                         num_segments: int) -> Array:
  """`[batch, length, embed]` -> each segment's first, `[batch, S, embed]`."""
  member = segment_one_hot(segment_ids, num_segments, jnp.int32)
  first = member * (jnp.cumsum(member, axis=1) == 1)
  return jnp.einsum('bls,ble->bse', first.astype(x.dtype), x,
                    precision=_EXACT)


def per_token(values: Array, segment_ids: Array) -> Array:
  """Per-segment `[batch, S, ...]` -> per-token `[batch, length, ...]`."""
  batch, num_segments = values.shape[:2]
  flat = values.reshape(batch, num_segments, -1)
  out = jnp.einsum('bls,bsf->blf',
                   segment_one_hot(segment_ids, num_segments, flat.dtype),
                   flat, precision=_EXACT)
  return out.reshape(segment_ids.shape + values.shape[2:])


def max_segments(cfg: Optional[HyperGridConfig]) -> Optional[int]:
  """The bound on examples per packed row the model needs (None: none)."""
  if cfg is None or not any(is_active(cfg, stack)
                            for stack in ('encoder', 'decoder')):
    return None
  return cfg.max_segments


def renamed_packed_form(form: str) -> str:
  """`form` by its current name, warning on an old one."""
  if form not in RENAMED_PACKED_FORMS:
    return form
  new = RENAMED_PACKED_FORMS[form]
  hyperprompt_jax.warn_renamed(
      f"HyperGridConfig.packed_form='{form}' is now '{new}'", stacklevel=3,
      once=True)
  return new


def resolve_packed_form(form: str) -> str:
  """'auto' -> 'pallas' compiled for a TPU, else 'blockwise'; old names renamed.

  docs/performance.md, "Forms".
  """
  form = renamed_packed_form(form)
  if form != 'auto':
    return form
  return 'pallas' if traced_mesh.target_platform() == 'tpu' else 'blockwise'


def packed_gated_matmul(x: Array, kernel: Array, grid: Array,
                        segment_ids: Array, form: str = 'auto',
                        kernel_axes: Optional[tuple[str, str]] = None
                        ) -> Array:
  """`x ((1 + psi(grid[s])) ⊙ kernel)` for each token of segment s + 1.

  Args:
    x: `[batch, length, d_in]`, packed rows.
    kernel: `[d_in, d_out]`.
    grid: `[batch, S, k_in, k_out]`, each segment's gates, oriented to the
      kernel.
    segment_ids: `[batch, length]`, 1..S, 0 on padding; for 'grouped' each
      segment's tokens contiguous, in order, padding last (as packers make
      them; `inputs.check_segments`).
    form: 'blockwise', 'grouped', 'pallas' or 'auto'
      (`resolve_packed_form`).
    kernel_axes: the kernel's logical axes ('pallas' splits it as a mesh
      does).

  Returns:
    `[batch, length, d_out]` (padding tokens: the ungated `x kernel`).
  """
  d_in, d_out = kernel.shape
  k_in, k_out = grid.shape[2:]
  grid = grid.astype(x.dtype)
  if k_in == 1:  # gate varies along the output only
    gate = per_token(grid[:, :, 0, :], segment_ids)
    return (x @ kernel) * (1 + jnp.repeat(gate, d_out // k_out, axis=-1))
  if k_out == 1:  # gate varies along the input only
    gate = per_token(grid[:, :, :, 0], segment_ids)
    return (x * (1 + jnp.repeat(gate, d_in // k_in, axis=-1))) @ kernel
  form = resolve_packed_form(form)
  if form == 'grouped':
    return _grouped_gated_matmul(x, kernel, grid, segment_ids)
  if form == 'pallas':
    return segment_kernels.segment_gated_matmul(x, kernel, grid, segment_ids,
                                                 kernel_axes)
  return _per_token_blockwise_matmul(x, kernel, grid, segment_ids)


# Recomputed in the backward pass: the per-token gated blocks are the
# layer's largest activation.
@jax.checkpoint
def _per_token_blockwise_matmul(x: Array, kernel: Array, grid: Array,
                                segment_ids: Array) -> Array:
  """'blockwise': each token's own gates on the blockwise route."""
  return _blockwise_gated_matmul(x, kernel, per_token(grid, segment_ids))


@jax.checkpoint  # the folded weights are recomputed, not kept
def _grouped_gated_matmul(x: Array, kernel: Array, grid: Array,
                          segment_ids: Array) -> Array:
  """'grouped': per-segment folded weights, one grouped matmul over the rows.

  Each row has S + 1 weights, the last the plain kernel for its padding. The
  FLOPs of one plain matmul where a grouped kernel runs it (GPU, TPU);
  XLA:CPU computes every group densely.
  """
  batch, length, d_in = x.shape
  d_out = kernel.shape[1]
  num_segments, k_in, k_out = grid.shape[1:]
  member = segment_one_hot(segment_ids, num_segments, jnp.int32)
  sizes = member.sum(axis=1)  # [batch, S]
  sizes = jnp.concatenate([sizes, length - sizes.sum(-1, keepdims=True)],
                          axis=-1)
  gate = jnp.repeat(jnp.repeat(grid, d_in // k_in, axis=2), d_out // k_out,
                    axis=3)  # [batch, S, d_in, d_out]
  weights = jnp.concatenate(
      [(1 + gate) * kernel,
       jnp.broadcast_to(kernel, (batch, 1, d_in, d_out))], axis=1)
  return _rowwise_ragged_dot(x, weights, sizes.astype(jnp.int32))


# The most groups one `ragged_dot` takes: the TPU compiler lays the group
# sizes out twice, padded to different tiles, and fails on the bitcast
# between them ("Bitcast cannot have different shape sizes") for some counts
# over 128, on every generation (docs/performance.md, "Forms").
MAX_RAGGED_GROUPS = 128


def _rowwise_ragged_dot(x: Array, weights: Array, sizes: Array) -> Array:
  """Each row's tokens times its own groups' weights, `[batch, length, d_out]`.

  One `ragged_dot` per shard of the batch (`shard_map`): the whole batch's
  group sizes would make GSPMD gather every row everywhere, and the TPU
  compiler takes no batch dimension in a ragged matmul. A shard's rows go
  `MAX_RAGGED_GROUPS // G` at a time.
  """
  groups = weights.shape[1]
  if groups > MAX_RAGGED_GROUPS and traced_mesh.target_platform() == 'tpu':
    raise ValueError(
        f"HyperGridConfig.packed_form='grouped' takes at most "
        f'{MAX_RAGGED_GROUPS - 1} segments a row on a TPU (the TPU '
        f'compiler fails on a ragged matmul of some group counts over '
        f'{MAX_RAGGED_GROUPS}), got MAX_SEGMENTS={groups - 1}: lower '
        "MAX_SEGMENTS or take packed_form='pallas' or 'blockwise'.")

  def flat(x, weights, sizes):
    rows, length, d_in = x.shape
    step = max(1, MAX_RAGGED_GROUPS // groups)
    out = [jax.lax.ragged_dot(x[i:i + step].reshape(-1, d_in),
                              weights[i:i + step].reshape(
                                  -1, *weights.shape[2:]),
                              sizes[i:i + step].reshape(-1))
           for i in range(0, rows, step)]
    return jnp.concatenate(out).reshape(rows, length, -1)

  batch_axes = traced_mesh.batch_axes(x.shape[0])
  if batch_axes is None:
    return flat(x, weights, sizes)
  mesh = traced_mesh.current_mesh()
  spec = jax.sharding.PartitionSpec(batch_axes)
  return jax.shard_map(flat, mesh=mesh, in_specs=(spec, spec, spec),
                       out_specs=spec, axis_names=set(batch_axes),
                       check_vma=False)(x, weights, sizes)


class OutputGate(nn.Module):
  """Output Gating's `sigma(U c)`, repeated to `[batch, d_ff]`."""

  config: HyperGridConfig
  emb_dim: int
  mlp_dim: int

  @nn.compact
  def __call__(self, c: Optional[Array], decode: bool = False) -> Array:
    """`c [batch, embed]` -> `[batch, d_ff]`; `decode` caches it."""
    return _cached(self, 'cached_gate', lambda: self._gate(c), decode)

  def _gate(self, c: Array) -> Array:
    n = self.config.output_gating_values or self.mlp_dim
    u = _param(self, 'gate_projection',
               nn.initializers.variance_scaling(1.0, 'fan_in', 'normal'),
               (self.emb_dim, n), ('embed', 'mlp'))
    # The projection in the activations' dtype, as t5x's dense layers
    # compute (a bfloat16 run's `[batch, S, d_ff]` gate and its gradient are
    # half the bytes), the sigmoid in float32.
    gate = jax.nn.sigmoid((c @ jnp.asarray(u, c.dtype)).astype(jnp.float32))
    return jnp.repeat(gate, self.mlp_dim // n, axis=-1)


def _cached(module: nn.Module, name: str, compute: Callable[[], Array],
            decode: bool) -> Array:
  """`compute()`; while decoding, computed once into the cache."""
  if not decode:
    return compute()
  return module.variable('cache', name, compute).value


class GatedDenseGeneral(layers.DenseGeneral):
  """`layers.DenseGeneral` with Eq. 7's per-example gated kernel.

  `x ((1 + psi(grid)) ⊙ W)`, the same `kernel` parameter; `__call__` marks
  its changes to the base's with `# NEW`.
  """

  grid: Optional[Array] = None  # [batch, (S,) k_in, k_out], kernel-oriented
  segment_ids: Optional[Array] = None  # packed rows: [batch, length]
  packed_form: str = 'auto'

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """`[batch, length, d_in]` -> `[batch, length, d_out]`."""
    if (inputs.ndim != 3 or not isinstance(self.features, int)  # NEW
        or self.axis not in (-1, 2)):
      raise ValueError('A HyperGrid gate needs a 2-D kernel applied to '
                       '[batch, length, features] inputs.')
    kernel = self.kernel(inputs)
    x = jnp.asarray(inputs, self.dtype)
    kernel = jnp.asarray(kernel, self.dtype)
    if self.segment_ids is not None:  # NEW: packed rows
      return packed_gated_matmul(x, kernel, self.grid, self.segment_ids,
                                 self.packed_form, self.kernel_axes)
    return gated_matmul(x, kernel, self.grid)  # NEW


@struct.dataclass
class FfnGates:
  """One layer's FFN gates, from its `StackGating`.

  Attributes:
    wi_grid: `[batch, (S,) d_r, d_c]`, every `wi*` kernel's grid, or None.
    wo_grid: `[batch, (S,) d_c, d_r]`, `wo`'s grid, or None.
    output_gate: `[batch, (S,) d_ff]`, Output Gating's, on the activations.
    segment_ids: packed rows: `[batch, length]`, the FFN's tokens' segments
      (1..S, 0: padding); None unpacked.
    packed_form: `HyperGridConfig.packed_form`.
  """
  wi_grid: Optional[Array] = None
  wo_grid: Optional[Array] = None
  output_gate: Optional[Array] = None
  segment_ids: Optional[Array] = None
  packed_form: str = struct.field(pytree_node=False, default='auto')


class GatedMlpBlock(layers.MlpBlock):
  """T5's FFN with HyperGrid's gated kernels or Output Gating's gate."""

  gates: FfnGates = FfnGates()

  def intermediate(self, inputs: Array) -> Array:
    x = super().intermediate(inputs)
    gate = self.gates.output_gate
    if gate is None:
      return x
    if self.gates.segment_ids is None:
      return x * gate.astype(x.dtype)[:, None, :]
    return x * per_token(gate.astype(x.dtype), self.gates.segment_ids)

  def dense(self, name: str, features: int,
            kernel_axes: tuple[str, str]) -> nn.Module:
    grid = self.gates.wo_grid if name == 'wo' else self.gates.wi_grid
    if grid is None:
      return super().dense(name, features, kernel_axes)
    return GatedDenseGeneral(features, dtype=self.dtype,
                             kernel_init=self.kernel_init,
                             kernel_axes=kernel_axes, grid=grid,
                             segment_ids=self.gates.segment_ids,
                             packed_form=self.gates.packed_form, name=name)


class TaskQueryAttention(layers.MultiHeadDotProductAttention):
  """t5x's attention plus Eq. 6's task query over `[itself; inputs_kv]`.

  The same kernels; the sequence's own attention does not see the task query,
  whose row has no position bias and no dropout. Packed rows ask one query
  per segment, over itself and its segment's tokens. No decode cache: the
  decoder's gates are cached instead.
  """

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array,
               mask: Optional[Array] = None, bias: Optional[Array] = None, *,
               task_query: Array, task_key_valid: Array,
               deterministic: bool = False, **prefix) -> tuple[Array, Array]:
    """As `layers.MultiHeadDotProductAttention`, plus the task query.

    Args:
      inputs_q, inputs_kv, mask, bias, deterministic: the base attention's.
      task_query: `[batch, embed]`, the normed task vector; packed rows:
        `[batch, S, embed]`.
      task_key_valid: `[batch, kv_length]` bool, the columns it sees; packed
        rows: `[batch, S, kv_length]`.
      **prefix: the base attention's key/value prefix arguments.

    Returns:
      `(out, task_out)`: `[batch, q_length, embed]` and T' = MHSA([T; X])_0,
      `[batch, (S,) embed]`.
    """
    proj = self.projections(inputs_q.shape[-1])
    out, token_key, token_value = self.attend(
        proj, inputs_q, inputs_kv, mask, bias, deterministic=deterministic,
        **prefix)
    # Eq. 6: the task queries over [themselves; the tokens].
    per_segment = task_query.ndim == 3
    tq = task_query if per_segment else task_query[:, None, :]
    token_visible = (task_key_valid if per_segment
                     else task_key_valid[:, None, :])
    queries = tq.shape[1]
    keys = jnp.concatenate([proj.key(tq), token_key], axis=1)
    values = jnp.concatenate([proj.value(tq), token_value], axis=1)
    # Each task query sees its own key (not the other segments') and its
    # tokens: [batch, Q, Q + kv_length].
    own = jnp.broadcast_to(jnp.eye(queries, dtype=bool),
                           (tq.shape[0], queries, queries))
    visible = jnp.concatenate([own, token_visible.astype(bool)], axis=-1)
    task_out = layers.dot_product_attention(
        proj.query(tq), keys, values,
        bias=layers.mask_to_bias(visible[:, None, :, :], self.dtype),
        dtype=self.dtype, float32_logits=self.float32_logits)
    task_out = proj.out(task_out)
    return out, task_out if per_segment else task_out[:, 0]


@dataclasses.dataclass(frozen=True)
class StackGating:
  """HyperGrid's (or Output Gating's) conditioning of one stack.

  Built once per stack by `conditioning.py`. Each layer builds its gating
  attention (the encoder's self-attention, the decoder's cross-attention) of
  class `attention_class`; `attend` runs it and makes the layer's `FfnGates`.

  Attributes:
    config: the `HyperGridConfig`.
    emb_dim: d_model.
    mlp_dim: d_ff.
    task_vectors: `[batch, embed]` (packed: `[batch, S, embed]`) task
      embeddings; None for 'first_token' or at cached decode steps.
    token_valid: `[batch, kv_length]`, the columns a task query sees.
    decode: gates come from the cache, computed when it is created.
    segment_ids: packed rows: `[batch, length]`, the stack's tokens'
      segments; None unpacked.
    kv_segment_ids: packed rows: `[batch, kv_length]`, the segments of the
      columns the task queries see (the encoder's tokens in both stacks).
  """

  config: HyperGridConfig
  emb_dim: int
  mlp_dim: int
  task_vectors: Optional[Array]
  token_valid: Optional[Array]
  decode: bool = False
  segment_ids: Optional[Array] = None
  kv_segment_ids: Optional[Array] = None

  @property
  def attention_class(self) -> type[layers.MultiHeadDotProductAttention]:
    """The gating attention's class: with task vectors, `TaskQueryAttention`."""
    if self.task_vectors is None:
      return layers.MultiHeadDotProductAttention
    return TaskQueryAttention

  def attend(self, attention: nn.Module, norm: nn.Module, inputs_q: Array,
             inputs_kv: Array, mask, bias, *,
             first_token: Callable[[], Array], deterministic: bool,
             **prefix) -> tuple[Array, FfnGates]:
    """Runs the layer's gating attention and makes its FFN gates.

    Args:
      attention: the layer's attention, of class `attention_class`.
      norm: the layer norm before it (Eq. 6 norms the task vector too).
      inputs_q, inputs_kv, mask, bias, deterministic, prefix: the attention's.
      first_token: `() -> [batch, kv_length, embed]`, whose first token (per
        segment, packed) is c for 'first_token'; called after the attention,
        as the gradient's summation order follows the order of use.

    Returns:
      `(attention output, FfnGates)`.
    """
    if self.task_vectors is None:
      out = attention(inputs_q, inputs_kv, mask, bias,
                      deterministic=deterministic, **prefix)
      sequence = first_token()
      if self.segment_ids is None:
        c = sequence[:, 0]
      else:
        c = segment_first_tokens(sequence, self.kv_segment_ids,
                                 self.config.max_segments)
    else:
      visible = self.token_valid
      if self.segment_ids is not None:  # [batch, S, kv_length]
        visible = (segment_one_hot(self.kv_segment_ids,
                                   self.config.max_segments, bool)
                   .swapaxes(1, 2) & visible[:, None, :].astype(bool))
      out, c = attention(inputs_q, inputs_kv, mask, bias,
                         deterministic=deterministic,
                         task_query=norm(self.task_vectors),
                         task_key_valid=visible, **prefix)
    return out, self.gates(c)

  def gates(self, c: Optional[Array]) -> FfnGates:
    """A layer's `FfnGates` from `c [batch, (S,) embed]`, inside the layer."""
    cfg = self.config
    packed = dict(segment_ids=self.segment_ids, packed_form=cfg.packed_form)
    if cfg.variant == 'output_gating':
      return FfnGates(output_gate=OutputGate(
          cfg, self.emb_dim, self.mlp_dim, name='output_gating')(
              c, self.decode), **packed)
    grid = GridGate(cfg, self.emb_dim, name='hypergrid')(c, self.decode)
    return FfnGates(
        wi_grid=(orient_grid(grid, kernel_rows_are_model=True)
                 if cfg.target in ('wi', 'both') else None),
        wo_grid=(orient_grid(grid, kernel_rows_are_model=False)
                 if cfg.target in ('wo', 'both') else None), **packed)


# A pytree (its arrays the leaves): layers under `nn.remat` take it inside
# their `conditioning.LayerConditioning`.
jax.tree_util.register_dataclass(
    StackGating,
    data_fields=['task_vectors', 'token_valid', 'segment_ids',
                 'kv_segment_ids'],
    meta_fields=['config', 'emb_dim', 'mlp_dim', 'decode'])
