"""TPU kernels (Pallas) for packed rows' matmuls whose weights vary by example.

In a packed row every example needs its own weights: HyperGrid's
`x_t ((1 + psi(grid[s])) ⊙ W)` for the tokens of segment s, an adapter's
`x_t W[task_t]`. XLA does that exactly only through a per-token intermediate
(HyperGrid's 'blockwise'), per-example weights ('grouped') or a permutation
of the tokens (`task_blocks.py`), each paid in HBM bytes (docs/performance.md,
"On a TPU slice, from this host"). These kernels make an example's weights
for each tile of W in VMEM and multiply only that example's rows, where they
lie, so HBM sees x, W, y and small tables, as a plain matmul does.

A group of tokens (a segment; a task's tokens in a row) is one range, as
packers lay examples out contiguously: the kernels multiply it in windows of
`_BIG` rows, then `_SMALL` rows, rounded out to whole `_SMALL` chunks with
other groups' rows masked to zero, at most `S * _SMALL` extra rows a row.
Any layout stays exact, only slower.

HyperGrid (`segment_gated_matmul`): `_gated_matmul`, `y = x (S_g ⊙ W)` per
segment g (also the input gradient, reading W where it lies), and
`_gated_weight_grad`, `dW = sum_g (x_g^T dy_g) ⊙ S_g` and the gates'
gradients, the block sums of `(x_g^T dy_g) ⊙ W`; `S_g = 1 + grid[g]` comes
as `[rows, S + 1, k_in, k_out]`, the last group the padding's ones. The
adapters (`per_task_matmul`): `_task_matmul` and `_task_weight_grad`
(`dW[t] = sum x_t^T dy_t`).

TPU v3's Mosaic multiplies no bfloat16, so there the tiles meet on the MXU
in float32. XLA cannot count inside a kernel: each gives its own cost
estimate. Off TPU the kernels run in Pallas's interpreter (slow);
`INTERPRET` picks its TPU interpreter.

Precision: the kernels' matmuls take the XLA forms' precision (DEFAULT;
HIGHEST for HyperFormer++'s variance) and follow
`jax.default_matmul_precision`: bfloat16 tiles are exact products summed in
float32; float32 tiles one bfloat16 MXU pass, as XLA's DEFAULT (Pallas's TPU
docs, "Precision control"; not yet seen on a chip); sums are rounded to the
output's dtype once. The 0/1 matrices that place gates and sum gradient
blocks are exact (HIGHEST). Only HyperGrid rounds elsewhere: the kernel
rounds the gated weight `(1 + grid) ⊙ W` once, where 'grouped' rounds
`1 + grid` and the product and 'blockwise' the gated inputs, so a kernel's
output and an XLA form's differ by at most (3 * 2^-8 + 2 n 2^-24) sum_i
|x_i w~_i| in bfloat16 (n: the contracted values; w~: the exact gated
weight). The adapters' kernels differ by the summation order alone
(`benchmarks/kernel_acceptance.py` checks both on a TPU).
"""

import functools
import math
from typing import Optional

from flax.linen import partitioning as nn_partitioning
import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from hyperprompt_jax.t5 import traced_mesh

Array = jax.Array

# Rows: the granularity of a segment's range (the sublane tile; bfloat16
# packs 16 rows in one, and Mosaic takes half of one), and the window inside
# a segment (the MXU's side).
_SMALL = 8
_BIG = 128
# The most contracted values and output columns a kernel tile takes: a
# row's tokens are read once an output tile, so once where d_model fits.
# TPU v3's VMEM also holds the tiles' float32 copies: there the forward
# tiles take at most 768 columns and the weight gradients' 512.
_TILE_IN = 512
_TILE_OUT = 1024
_HIGHEST = jax.lax.Precision.HIGHEST


def _tile_out_most(weight_grad: bool = False) -> int:
  if traced_mesh.target_device_kind() != 'TPU v3':
    return _TILE_OUT
  return 512 if weight_grad else 768


def segment_groups(segment_ids: Array, num_segments: int) -> Array:
  """Segment ids (1..S, 0: padding) -> group ids: s - 1, padding S."""
  return jnp.where(segment_ids > 0, segment_ids - 1, num_segments)


def group_ranges(groups: Array, num_groups: int) -> tuple[Array, Array]:
  """Each group's `[start, end)` token range in its row, flat `[batch * G]`.

  int32, for the kernels' scalar memory; `start >= end` for an absent group.
  """
  length = groups.shape[1]
  position = jnp.arange(length, dtype=jnp.int32)[None, :, None]
  member = groups[..., None] == jnp.arange(num_groups)
  start = jnp.min(jnp.where(member, position, length), axis=1)
  end = jnp.max(jnp.where(member, position + 1, 0), axis=1)
  return (start.reshape(-1).astype(jnp.int32),
          end.reshape(-1).astype(jnp.int32))


def _tile(size: int, block: int, most: int) -> int:
  """The kernel tile along `size` values gated in blocks of `block`.

  The largest multiple of 128 and of `block` dividing `size`, at most `most`;
  else the whole axis (Mosaic takes a block equal to the array's dimension).
  """
  for tile in range(most, 0, -128):
    if size % tile == 0 and tile % block == 0:
      return tile
  return size


def _chunk(length: int) -> int:
  return _SMALL if length % _SMALL == 0 else length


def _for_row_windows(start, end, length: int, body) -> None:
  """`body(offset, rows)` over `[start, end)` in whole chunks, big first."""
  chunk = _chunk(length)
  big = _BIG if length % _BIG == 0 and chunk == _SMALL else chunk
  lo = (start // chunk) * chunk
  hi = ((end + chunk - 1) // chunk) * chunk
  num_big = jnp.maximum(hi - lo, 0) // big

  def big_window(j, carry):
    body(pl.multiple_of(lo + j * big, chunk), big)
    return carry

  def small_window(j, carry):
    body(pl.multiple_of(base + j * chunk, chunk), chunk)
    return carry

  jax.lax.fori_loop(0, num_big, big_window, 0)
  base = lo + num_big * big
  jax.lax.fori_loop(0, jnp.maximum(hi - base, 0) // chunk, small_window, 0)


def _repeat_rows(scale: Array, block: int) -> Array:
  """`[k, cols]` -> `[k * block, cols]`, each row repeated `block` times."""
  k, cols = scale.shape
  return jnp.broadcast_to(scale[:, None, :], (k, block, cols)).reshape(
      k * block, cols)


def _gate_tile(gates: Array, block_in: int, block_out: int, tile_out: int,
               column_tile) -> Array:
  """A group's gates `[k_in tile, k_out]` -> its `[tile_in, tile_out]` tile.

  The columns are picked and repeated by a 0/1 matrix on the MXU (exact at
  HIGHEST): Mosaic cannot repeat lanes in blocks of, e.g., 24.
  """
  k_out = gates.shape[1]
  shape = (k_out, tile_out)
  column = (jax.lax.broadcasted_iota(jnp.int32, shape, 1)
            + column_tile * tile_out)
  expand = (column // block_out
            == jax.lax.broadcasted_iota(jnp.int32, shape, 0))
  tile = jnp.dot(gates, expand.astype(jnp.float32), precision=_HIGHEST,
                 preferred_element_type=jnp.float32)
  return _repeat_rows(tile, block_in)


def _for_each_group(row, num_groups: int, starts_ref, ends_ref, x_ref,
                    groups_ref, on_group) -> None:
  """`on_group(g, at, windows)` for each group g that row `row` holds.

  `at` indexes the flat scalars; `windows(body)` calls `body(offset, size, x)`
  over the group's range, other groups' rows of `x` zero.
  """
  length = x_ref.shape[1]

  def group(g, carry):
    at = row * num_groups + g
    start, end = starts_ref[at], ends_ref[at]

    def windows(body):
      def rows(offset, size):
        mine = groups_ref[0, pl.ds(offset, size), :] == g
        body(offset, size,
             jnp.where(mine, x_ref[0, pl.ds(offset, size), :], 0))
      _for_row_windows(start, end, length, rows)

    pl.when(end > start)(lambda: on_group(g, at, windows))
    return carry

  jax.lax.fori_loop(0, num_groups, group, 0)


def _matmul_by_group(num_groups: int, starts_ref, ends_ref, x_ref,
                     groups_ref, out_ref, acc_ref, weights_of, mxu_dtype,
                     transposed: bool = False, precision=None) -> None:
  """The forward kernels' body on `_forward_grid`'s grid.

  Each group's rows times `weights_of(g, at)` (`[contracted, output]`, or
  `[output, contracted]` if `transposed`), summed over the contracted tiles in
  float32 and written at the last.
  """
  k_step, i = pl.program_id(2), pl.program_id(3)
  row = pl.program_id(0) * acc_ref.shape[0] + i

  @pl.when(k_step == 0)
  def _():
    acc_ref[i] = jnp.zeros(acc_ref.shape[1:], acc_ref.dtype)

  def on_group(g, at, windows):
    w = weights_of(g, at).astype(mxu_dtype)

    def multiply(offset, size, x):
      acc_ref[i, pl.ds(offset, size), :] += jax.lax.dot_general(
          x.astype(mxu_dtype), w, (((1,), (1 if transposed else 0,)),
                                   ((), ())),
          precision=precision, preferred_element_type=jnp.float32)

    windows(multiply)

  _for_each_group(row, num_groups, starts_ref, ends_ref, x_ref, groups_ref,
                  on_group)

  @pl.when(k_step == pl.num_programs(2) - 1)
  def _():
    out_ref[0] = acc_ref[i].astype(out_ref.dtype)


# The forward kernels keep float32 sums for a block of rows, so that a
# weight tile is read once a block rather than once a row; the block is the
# most rows whose sums fit beside the tiles in this much VMEM, as
# `_vmem_bytes` counts it. One budget for every generation, set by the
# least VMEM (v3, v4); the kernels' own temporaries and spills take the
# rest (docs/performance.md, "Kernels on a TPU").
_VMEM_BYTES = 12.5 * 2**20


def _vmem_bytes(block: int, length: int, tile_in: int, tile_out: int,
                itemsize: int, weight_tiles: int = 1) -> int:
  """A forward kernel's VMEM as `_VMEM_BYTES` counts it."""
  return (block * length * tile_out * 4
          + 2 * itemsize * (length * tile_in + weight_tiles * tile_in
                            * tile_out + length * tile_out)
          + 2 * 4 * tile_in * tile_out)


def _forward_grid(rows: int, length: int, d_in: int, d_out: int,
                  tile_in: int, tile_out: int, itemsize: int,
                  weight_tiles: int = 1):
  """The forward kernels' grid: row blocks, output, contracted tiles, rows.

  Returns `(grid, block, row(b, i), output index map)`.
  """
  tiles_in = d_in // tile_in
  block = max([r for r in range(1, rows + 1) if rows % r == 0 and _vmem_bytes(
      r, length, tile_in, tile_out, itemsize, weight_tiles) <= _VMEM_BYTES]
              or [1])
  grid = (rows // block, d_out // tile_out, tiles_in, block)

  def row(b, i):
    return b * block + i

  def output(b, n, k, i, *_):
    # Until the last contracted tile the row block's first output block
    # stays put: a block is written to HBM when its index changes, so only
    # finished rows are written, each once.
    return (jnp.where(k == tiles_in - 1, row(b, i), row(b, 0)), 0, n)

  return grid, block, row, output


def _weight_block(tile_in: int, tile_out: int, transposed: bool,
                  tasks: tuple[int, ...] = ()) -> pl.BlockSpec:
  """A forward kernel's weight tile on its grid, `tasks` leading whole."""
  lead = (0,) * len(tasks)
  if transposed:
    return pl.BlockSpec(tasks + (tile_out, tile_in),
                        lambda b, n, k, *_: lead + (n, k))
  return pl.BlockSpec(tasks + (tile_in, tile_out),
                      lambda b, n, k, *_: lead + (k, n))


def _products_by_group(dy_ref, mxu_dtype, precision=None):
  """A window's `x_g^T dy_g`, float32 `[d_in, d_out]`."""
  def product(offset, size, x):
    dy = dy_ref[0, pl.ds(offset, size), :].astype(mxu_dtype)
    return jax.lax.dot_general(x.astype(mxu_dtype), dy,
                               (((0,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)
  return product


def _gated_matmul_kernel(starts_ref, ends_ref, groups_ref, x_ref, w_ref,
                         gates_ref, out_ref, acc_ref, *, num_groups: int,
                         block_rows: int, block_columns: int, mxu_dtype,
                         transposed: bool):
  # The W tile's column tile: the output's, or the contracted one's when
  # the tile is multiplied transposed.
  column_tile = pl.program_id(2 if transposed else 1)
  tile_columns = w_ref.shape[1]

  def gated(g, at):
    del at
    return w_ref[...].astype(jnp.float32) * _gate_tile(
        gates_ref[0, g, 0], block_rows, block_columns, tile_columns,
        column_tile)

  _matmul_by_group(num_groups, starts_ref, ends_ref, x_ref, groups_ref,
                   out_ref, acc_ref, gated, mxu_dtype, transposed)


def _gated_weight_grad_kernel(starts_ref, ends_ref, groups_ref, x_ref, dy_ref,
                              w_ref, gates_ref, dw_ref, dgates_ref, part_ref,
                              acc_ref, *, num_groups: int, block_in: int,
                              block_out: int, mxu_dtype):
  column_tile, row = pl.program_id(1), pl.program_id(2)
  tile_in, tile_out = w_ref.shape

  # `w`'s gradient is summed over the rows in float32 in VMEM and written
  # once, in `w`'s dtype: the same bits as a float32 output cast after the
  # kernel, without its float32 write and read in HBM.
  @pl.when(row == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  dgates_ref[...] = jnp.zeros_like(dgates_ref)
  w = w_ref[...].astype(jnp.float32)
  # Sums each `block_out` columns: a 0/1 matrix on the MXU (exact at
  # HIGHEST), as Mosaic reshapes no lane axis into blocks of 24.
  shape = (tile_out, tile_out // block_out)
  column_blocks = (jax.lax.broadcasted_iota(jnp.int32, shape, 0) // block_out
                   == jax.lax.broadcasted_iota(jnp.int32, shape, 1))
  product = _products_by_group(dy_ref, mxu_dtype)

  def on_group(g, at, windows):
    del at
    part_ref[...] = jnp.zeros_like(part_ref)

    def accumulate(offset, size, x):
      part_ref[...] += product(offset, size, x)

    windows(accumulate)
    part = part_ref[...]
    acc_ref[...] += part * _gate_tile(gates_ref[0, g, 0], block_in,
                                      block_out, tile_out, column_tile)
    row_sums = jnp.sum(
        (part * w).reshape(tile_in // block_in, block_in, tile_out), axis=1)
    dgates_ref[0, 0, 0, g] = jnp.dot(
        row_sums, column_blocks.astype(jnp.float32), precision=_HIGHEST,
        preferred_element_type=jnp.float32)

  _for_each_group(row, num_groups, starts_ref, ends_ref, x_ref, groups_ref,
                  on_group)

  @pl.when(row == pl.num_programs(2) - 1)
  def _():
    dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)


def _mxu_dtype(dtype) -> jnp.dtype:
  """The tiles' dtype on the MXU: theirs, but float32 on TPU v3."""
  return jnp.float32 if traced_mesh.target_device_kind() == 'TPU v3' else dtype


# How the kernels run. None: Mosaic on TPU, else Pallas's plain interpreter
# (the grid in order on one core, every output block written back at every
# step: a revisit, a race or an order is never wrong there). A
# `pltpu.InterpretParams` runs them in Pallas's TPU interpreter anywhere
# (tests; slow): blocks written back as a TensorCore does (a block revisited
# after another raises), 'parallel' axes in a random order over
# `num_cores_or_threads` cores, with `detect_races`.
INTERPRET: Optional[pltpu.InterpretParams] = None


def _interpret():
  if INTERPRET is not None:
    return INTERPRET
  return traced_mesh.target_platform() != 'tpu'


def _call(kernel, out_shape, grid: tuple[int, ...], prefetch: int, *,
          in_specs, out_specs, cost: pl.CostEstimate, scratch=()):
  """A kernel on `grid`, its first two axes parallel, `prefetch` scalars."""
  return pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=prefetch, grid=grid, in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=list(scratch)),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel')
          + ('arbitrary',) * (len(grid) - 2)),
      cost_estimate=cost,
      interpret=_interpret(),
  )


def _gated_tiles(w_shape: tuple[int, int], gate_blocks: tuple[int, int],
                 transposed: bool) -> tuple[int, int, int]:
  """`_gated_matmul`'s output width and tiles `(d_y, tile_in, tile_out)`."""
  d_w_rows, d_w_columns = w_shape
  block_rows = d_w_rows // gate_blocks[0]
  if transposed:
    return (d_w_rows, _tile(d_w_columns, 1, _TILE_IN),
            _tile(d_w_rows, block_rows, _tile_out_most()))
  return (d_w_columns, _tile(d_w_rows, block_rows, _TILE_IN),
          _tile(d_w_columns, 1, _tile_out_most()))


def _gated_matmul(x: Array, w: Array, gates: Array, groups: Array,
                  starts: Array, ends: Array,
                  transposed: bool = False) -> Array:
  """Each token times `w` gated by its group's gates (float32 `1 + grid`).

  `x [rows, length, d_in]` -> `[rows, length, d_out]`. `transposed`: times the
  gated `w` transposed (the input gradient), read as it lies: a transposed
  copy of the kernel is a layout change XLA makes in HBM every step.
  """
  rows, length, d_x = x.shape
  d_w_rows, d_w_columns = w.shape
  num_groups, k_rows, k_columns = gates.shape[1:]
  block_rows, block_columns = d_w_rows // k_rows, d_w_columns // k_columns
  d_y, tile_in, tile_out = _gated_tiles(w.shape, (k_rows, k_columns),
                                        transposed)
  grid, block, row, output = _forward_grid(rows, length, d_x, d_y,
                                           tile_in, tile_out, x.dtype.itemsize)
  gate_tiles = grid[1] if transposed else grid[2]  # W's row tiles
  itemsize = x.dtype.itemsize
  # Rows multiplied: each row's tokens plus at most a chunk a segment
  # boundary (module docstring); W gated once a group and tile.
  visited = rows * (length + (num_groups - 1) * _chunk(length))
  cost = pl.CostEstimate(
      flops=2 * visited * d_x * d_y + 2 * rows * num_groups * d_x * d_y,
      transcendentals=0,
      bytes_accessed=(grid[1] * x.size + grid[0] * w.size) * itemsize
      + grid[1] * grid[2] // gate_tiles * gates.size * 4
      + rows * length * (d_y * itemsize + 4 * grid[1]))
  kernel = functools.partial(
      _gated_matmul_kernel, num_groups=num_groups, block_rows=block_rows,
      block_columns=block_columns, mxu_dtype=_mxu_dtype(x.dtype),
      transposed=transposed)
  # The gates' tile follows W's rows: the output tile, transposed.
  tile_rows = tile_out if transposed else tile_in
  gates_spec = pl.BlockSpec(
      (1, num_groups, 1, tile_rows // block_rows, k_columns),
      lambda b, n, k, i, *_: (row(b, i), 0, n if transposed else k, 0, 0))
  return _call(
      kernel,
      jax.ShapeDtypeStruct((rows, length, d_y), x.dtype), grid, 2,
      in_specs=[
          pl.BlockSpec((1, length, 1),
                       lambda b, n, k, i, *_: (row(b, i), 0, 0)),
          pl.BlockSpec((1, length, tile_in),
                       lambda b, n, k, i, *_: (row(b, i), 0, k)),
          _weight_block(tile_in, tile_out, transposed),
          gates_spec,
      ],
      out_specs=pl.BlockSpec((1, length, tile_out), output),
      scratch=[pltpu.VMEM((block, length, tile_out), jnp.float32)],
      cost=cost)(starts, ends, groups[..., None], x, w,
                 _tiled(gates, gate_tiles))


def _gated_weight_grad(x: Array, dy: Array, w: Array, gates: Array,
                       groups: Array, starts: Array,
                       ends: Array) -> tuple[Array, Array]:
  """`_gated_matmul`'s gradients: `w`'s in its dtype, the gates' float32."""
  rows, length, d_in = x.shape
  d_out = w.shape[1]
  num_groups, k_in, k_out = gates.shape[1:]
  block_in, block_out = d_in // k_in, d_out // k_out
  tile_in = _tile(d_in, block_in, _TILE_IN)
  tile_out = _tile(d_out, block_out, _tile_out_most(weight_grad=True))
  grid = (d_in // tile_in, d_out // tile_out, rows)
  itemsize = x.dtype.itemsize
  visited = rows * (length + (num_groups - 1) * _chunk(length))
  cost = pl.CostEstimate(
      flops=2 * visited * d_in * d_out
      + 4 * rows * num_groups * d_in * d_out,
      transcendentals=0,
      bytes_accessed=(grid[1] * x.size + grid[0] * dy.size + w.size) * itemsize
      # A row's gates of an input tile read once an output tile; their
      # gradients written once.
      + (grid[1] + 1) * gates.size * 4 + w.size * w.dtype.itemsize
      + rows * length * 4 * grid[0] * grid[1])
  kernel = functools.partial(
      _gated_weight_grad_kernel, num_groups=num_groups, block_in=block_in,
      block_out=block_out, mxu_dtype=_mxu_dtype(x.dtype))
  dw, dgates = _call(
      kernel,
      (jax.ShapeDtypeStruct((d_in, d_out), w.dtype),
                 jax.ShapeDtypeStruct(
                     grid + (num_groups, tile_in // block_in,
                             tile_out // block_out), jnp.float32)), grid, 2,
      in_specs=[
          pl.BlockSpec((1, length, 1), lambda k, n, r, *_: (r, 0, 0)),
          pl.BlockSpec((1, length, tile_in), lambda k, n, r, *_: (r, 0, k)),
          pl.BlockSpec((1, length, tile_out),
                       lambda k, n, r, *_: (r, 0, n)),
          pl.BlockSpec((tile_in, tile_out), lambda k, n, r, *_: (k, n)),
          pl.BlockSpec((1, num_groups, 1, tile_in // block_in, k_out),
                       lambda k, n, r, *_: (r, 0, k, 0, 0)),
      ],
      out_specs=[
          pl.BlockSpec((tile_in, tile_out), lambda k, n, r, *_: (k, n)),
          pl.BlockSpec((1, 1, 1, num_groups, tile_in // block_in,
                        tile_out // block_out),
                       lambda k, n, r, *_: (k, n, r, 0, 0, 0)),
      ],
      scratch=[pltpu.VMEM((tile_in, tile_out), jnp.float32),
               pltpu.VMEM((tile_in, tile_out), jnp.float32)],
      cost=cost)(starts, ends, groups[..., None], x, dy, w,
                 _tiled(gates, grid[0]))
  # [tiles in, tiles out, rows, G, in blocks a tile, out blocks a tile]
  dgates = jnp.transpose(dgates, (2, 3, 0, 4, 1, 5))
  return dw, dgates.reshape(rows, num_groups, k_in, k_out)


def _tiled(gates: Array, tiles: int) -> Array:
  """`[rows, G, k_in, k_out]` -> `[rows, G, tiles, k_in / tiles, k_out]`.

  Mosaic takes a block's last two axes whole or in multiples of (8, 128).
  """
  rows, groups, k_in, k_out = gates.shape
  return gates.reshape(rows, groups, tiles, k_in // tiles, k_out)


def _gates(grid: Array) -> Array:
  """Each group's float32 `1 + grid`, plus the padding group's ones."""
  rows, _, k_in, k_out = grid.shape
  return jnp.concatenate(
      [1 + grid.astype(jnp.float32), jnp.ones((rows, 1, k_in, k_out))], axis=1)


@jax.custom_vjp
def _segment_gated_matmul(x: Array, kernel: Array, grid: Array,
                          segment_ids: Array) -> Array:
  return _forward(x, kernel, grid, segment_ids)[0]


def _forward(x, kernel, grid, segment_ids):
  num_segments = grid.shape[1]
  groups = segment_groups(segment_ids, num_segments)
  starts, ends = group_ranges(groups, num_segments + 1)
  kernel = kernel.astype(x.dtype)
  y = _gated_matmul(x, kernel, _gates(grid), groups, starts, ends)
  return y, (x, kernel, grid, groups, starts, ends)


def _backward(residuals, dy):
  x, kernel, grid, groups, starts, ends = residuals
  dy = dy.astype(x.dtype)
  gates = _gates(grid)
  dx = _gated_matmul(dy, kernel, gates, groups, starts, ends,
                     transposed=True)
  dw, dgates = _gated_weight_grad(x, dy, kernel, gates, groups, starts, ends)
  return dx, dw.astype(kernel.dtype), dgates[:, :-1].astype(grid.dtype), None


_segment_gated_matmul.defvjp(_forward, _backward)


def segment_gated_matmul(x: Array, kernel: Array, grid: Array,
                         segment_ids: Array,
                         kernel_axes: Optional[tuple[str, str]] = None
                         ) -> Array:
  """`x ((1 + psi(grid[s])) ⊙ kernel)` for each token of segment s + 1, on chip.

  Inside a mesh the kernels run on each device's part (`shard_map`: Mosaic
  kernels are not partitioned automatically), split as GSPMD splits the plain
  matmul; a split contraction's partial sums are added after the kernels.

  Args:
    x: `[batch, length, d_in]`, packed rows.
    kernel: `[d_in, d_out]`.
    grid: `[batch, S, k_in, k_out]`, each segment's gates oriented to the
      kernel; `d_in % k_in == d_out % k_out == 0`.
    segment_ids: `[batch, length]`, 1..S, 0 on padding.
    kernel_axes: the kernel's logical axes (e.g. `('mlp', 'embed')`), which
      say how a mesh splits it.

  Returns:
    `[batch, length, d_out]` in x's dtype (padding: the ungated `x kernel`).
  """
  mesh = traced_mesh.current_mesh()
  if mesh is None:
    return _segment_gated_matmul(x, kernel, grid, segment_ids)
  spec = jax.sharding.PartitionSpec
  batch = traced_mesh.batch_axes(x.shape[0])
  split_in, split_out = _kernel_split(mesh, kernel_axes, kernel.shape,
                                      grid.shape[2:])
  rows = spec(batch)
  in_specs = (spec(batch, None, split_in), spec(split_in, split_out),
              spec(batch, None, split_in, split_out), rows)
  if split_in is None:
    return jax.shard_map(_segment_gated_matmul, mesh=mesh, in_specs=in_specs,
                         out_specs=spec(batch, None, split_out),
                         check_vma=False)(x, kernel, grid, segment_ids)

  def blockwise(*args):
    return _segment_gated_matmul(*args)[None]

  partial = jax.shard_map(blockwise, mesh=mesh, in_specs=in_specs,
                          out_specs=spec(split_in, batch, None, split_out),
                          check_vma=False)(x, kernel, grid, segment_ids)
  return partial.sum(axis=0, dtype=x.dtype)


def _kernel_split(mesh, kernel_axes, kernel_shape, grid_shape):
  """The mesh axes splitting the kernel's rows and columns (None: whole)."""
  if kernel_axes is None:
    return None, None
  splits = []
  for axes, size, blocks in zip(
      nn_partitioning.logical_to_mesh_axes(kernel_axes), kernel_shape,
      grid_shape):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    shards = math.prod(mesh.shape[a] for a in names)
    splits.append(axes if shards > 1 and size % shards == 0
                  and blocks % shards == 0 else None)
  return tuple(splits)


# -- Per-task weights: the adapters' matmuls on packed rows -------------------
#
# Each task's tokens of a packed row are one range, first to last (other
# tasks' rows in it masked), multiplied by the task's weights from VMEM (all
# T tasks' tiles fit at adapter sizes): no permutation of the tokens. The
# row's last run of one task (its last example and the padding, task id 0)
# is a group of its own, so task 0's range does not reach the padding. A
# task that returns later in a row costs the rows between: per-run ranges
# have no static bound, and their scalars overflow TPU v3's scalar memory.


def task_groups(task_ids: Array, num_tasks: int) -> tuple[Array, Array]:
  """Task ids `[rows, length]` -> each token's group and each group's task.

  A token's group is its task, or T for the row's last run of one task; the
  groups' tasks are flat `[rows * (T + 1)]`, for scalar memory.
  """
  rows, length = task_ids.shape
  change = jnp.concatenate(
      [jnp.ones((rows, 1), bool), task_ids[:, 1:] != task_ids[:, :-1]], 1)
  last_run = jnp.cumsum(change, axis=1) == jnp.sum(change, axis=1,
                                                   keepdims=True)
  groups = jnp.where(last_run, num_tasks, task_ids).astype(jnp.int32)
  group_tasks = jnp.concatenate(
      [jnp.broadcast_to(jnp.arange(num_tasks), (rows, num_tasks)),
       task_ids[:, -1:]], axis=1)
  return groups, group_tasks.reshape(-1).astype(jnp.int32)


def _task_matmul_kernel(starts_ref, ends_ref, group_tasks_ref, groups_ref,
                        x_ref, w_ref, out_ref, acc_ref, *, num_groups: int,
                        mxu_dtype, transposed: bool, precision):
  _matmul_by_group(num_groups, starts_ref, ends_ref, x_ref, groups_ref,
                   out_ref, acc_ref,
                   lambda g, at: w_ref[group_tasks_ref[at]], mxu_dtype,
                   transposed, precision)


def _task_weight_grad_kernel(starts_ref, ends_ref, group_tasks_ref,
                             groups_ref, x_ref, dy_ref, dw_ref, acc_ref, *,
                             num_groups: int, mxu_dtype, precision):
  row = pl.program_id(2)

  @pl.when(row == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  product = _products_by_group(dy_ref, mxu_dtype, precision)

  def on_group(g, at, windows):
    del g
    task = group_tasks_ref[at]

    def accumulate(offset, size, x):
      acc_ref[task] += product(offset, size, x)

    windows(accumulate)

  _for_each_group(row, num_groups, starts_ref, ends_ref, x_ref, groups_ref,
                  on_group)

  @pl.when(row == pl.num_programs(2) - 1)
  def _():
    dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)


def _task_matmul(x: Array, w: Array, groups: Array,
                 ranges: tuple[Array, Array, Array],
                 transposed: bool = False, precision=None) -> Array:
  """Each token of `x [rows, length, d_in]` times its task's weights.

  `w`: `[T, d_in, d_out]` (`transposed`: `[T, d_out, d_in]`, read as it
  lies); `groups`: `task_groups`; `ranges`: each group's start, end, task.
  """
  rows, length, d_in = x.shape
  num_tasks = w.shape[0]
  d_out = w.shape[1 if transposed else 2]
  tile_in = _tile(d_in, 1, _TILE_IN)
  tile_out = _tile(d_out, 1, _tile_out_most())
  grid, block, row, output = _forward_grid(rows, length, d_in, d_out,
                                           tile_in, tile_out, x.dtype.itemsize,
                                           weight_tiles=num_tasks)
  itemsize = x.dtype.itemsize
  cost = pl.CostEstimate(
      flops=2 * _task_rows_bound(rows, length, num_tasks) * d_in * d_out,
      transcendentals=0,
      bytes_accessed=(grid[1] * x.size + grid[0] * w.size) * itemsize
      + rows * length * (d_out * itemsize + 4 * grid[1]))
  return _call(
      functools.partial(_task_matmul_kernel, num_groups=num_tasks + 1,
                        mxu_dtype=_mxu_dtype(x.dtype), transposed=transposed,
                        precision=precision),
      jax.ShapeDtypeStruct((rows, length, d_out), x.dtype), grid, 3,
      in_specs=[
          pl.BlockSpec((1, length, 1),
                       lambda b, n, k, i, *_: (row(b, i), 0, 0)),
          pl.BlockSpec((1, length, tile_in),
                       lambda b, n, k, i, *_: (row(b, i), 0, k)),
          _weight_block(tile_in, tile_out, transposed, (num_tasks,)),
      ],
      out_specs=pl.BlockSpec((1, length, tile_out), output),
      scratch=[pltpu.VMEM((block, length, tile_out), jnp.float32)],
      cost=cost)(*ranges, groups[..., None], x, w.astype(x.dtype))


def _task_weight_grad(x: Array, dy: Array, num_tasks: int, groups: Array,
                      ranges: tuple[Array, Array, Array], dtype,
                      precision=None) -> Array:
  """`_task_matmul`'s gradient for its weights, `[T, d_in, d_out]` in `dtype`.

  Summed in float32 in VMEM and written once in the weights' dtype.
  """
  rows, length, d_in = x.shape
  d_out = dy.shape[-1]
  tile_in = _tile(d_in, 1, _TILE_IN)
  tile_out = _tile(d_out, 1, _tile_out_most(weight_grad=True))
  grid = (d_in // tile_in, d_out // tile_out, rows)
  itemsize = x.dtype.itemsize
  cost = pl.CostEstimate(
      flops=2 * _task_rows_bound(rows, length, num_tasks) * d_in * d_out,
      transcendentals=0,
      bytes_accessed=(grid[1] * x.size + grid[0] * dy.size) * itemsize
      + num_tasks * d_in * d_out * jnp.dtype(dtype).itemsize
      + rows * length * 4 * grid[0] * grid[1])
  return _call(
      functools.partial(_task_weight_grad_kernel, num_groups=num_tasks + 1,
                        mxu_dtype=_mxu_dtype(x.dtype), precision=precision),
      jax.ShapeDtypeStruct((num_tasks, d_in, d_out), dtype), grid, 3,
      in_specs=[
          pl.BlockSpec((1, length, 1), lambda k, n, r, *_: (r, 0, 0)),
          pl.BlockSpec((1, length, tile_in), lambda k, n, r, *_: (r, 0, k)),
          pl.BlockSpec((1, length, tile_out),
                       lambda k, n, r, *_: (r, 0, n)),
      ],
      out_specs=pl.BlockSpec((num_tasks, tile_in, tile_out),
                             lambda k, n, r, *_: (0, k, n)),
      scratch=[pltpu.VMEM((num_tasks, tile_in, tile_out), jnp.float32)],
      cost=cost)(*ranges, groups[..., None], x, dy)


def _task_rows_bound(rows: int, length: int, num_tasks: int) -> int:
  """Rows the per-task kernels multiply, as their cost estimate counts them.

  Each token once, a chunk per task boundary, and a quarter of the row for
  tasks returning later in it: an estimate for GLUE-length rows, not a bound.
  """
  return rows * (length + (num_tasks - 1) * _chunk(length) + length // 4)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _per_task_matmul(x: Array, weights: Array, task_ids: Array,
                     transposed: bool, precision) -> Array:
  return _per_task_forward(x, weights, task_ids, transposed, precision)[0]


def _per_task_forward(x, weights, task_ids, transposed, precision):
  num_tasks = weights.shape[0]
  groups, group_tasks = task_groups(task_ids, num_tasks)
  ranges = (*group_ranges(groups, num_tasks + 1), group_tasks)
  y = _task_matmul(x, weights, groups, ranges, transposed, precision)
  return y, (x, weights, groups, ranges)


def _per_task_backward(transposed, precision, residuals, dy):
  x, weights, groups, ranges = residuals
  dy = dy.astype(x.dtype)
  num_tasks = weights.shape[0]
  # Both the input gradient and the weights' read / make the weights as
  # they lie (`x^T dy` or, transposed, `dy^T x`).
  dx = _task_matmul(dy, weights, groups, ranges, not transposed, precision)
  if transposed:
    dw = _task_weight_grad(dy, x, num_tasks, groups, ranges, weights.dtype,
                           precision)
  else:
    dw = _task_weight_grad(x, dy, num_tasks, groups, ranges, weights.dtype,
                           precision)
  return dx, dw, None


_per_task_matmul.defvjp(_per_task_forward, _per_task_backward)


def per_task_matmul(x: Array, weights: Array, task_ids: Array,
                    transposed: bool = False,
                    precision: Optional[jax.lax.Precision] = None) -> Array:
  """`x_t W[task_t]` for every token t of packed rows, on chip.

  Inside a mesh the kernels run on each data shard's rows (`shard_map`), the
  weights whole on every device (an adapter's are small).

  Args:
    x: `[batch, length, d_in]`.
    weights: `[T, d_in, d_out]`, one matrix a task; with `transposed`,
      `[T, d_out, d_in]` and `x_t W[task_t]^T`. A TPU lays an array's last
      axis on its 128 lanes, so weights of few columns (an adapter's down
      projection) are best given wide side last, and stay so with their
      gradients.
    task_ids: `[batch, length]` int32, each token's task.
    transposed: see `weights`.
    precision: the matmuls' (forward and gradients), as `jnp.einsum`'s: None
      (DEFAULT) or `jax.lax.Precision.HIGHEST` (HyperFormer++'s variance).

  Returns:
    `[batch, length, d_out]` in x's dtype.
  """
  mesh = traced_mesh.current_mesh()
  matmul = functools.partial(_per_task_matmul, transposed=transposed,
                             precision=precision)
  if mesh is None:
    return matmul(x, weights, task_ids)
  spec = jax.sharding.PartitionSpec
  batch = traced_mesh.batch_axes(x.shape[0])
  return jax.shard_map(matmul, mesh=mesh,
                       in_specs=(spec(batch), spec(), spec(batch)),
                       out_specs=spec(batch), check_vma=False)(
                           x, weights, task_ids)
