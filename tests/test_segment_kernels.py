"""The TPU kernels of `t5/segment_kernels.py` against numpy, token by token:
in Pallas's plain interpreter, and in its TPU interpreter, which runs the
grid as a TPU does (output blocks written back as a TensorCore writes them,
the 'parallel' axes shuffled, over two cores with a race detector)."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np
import pytest

import conftest
import multiprocess
import numpy_hypergrid
from hyperprompt_jax.t5 import segment_kernels


def _segment_layouts(rows, length, segments, contiguous, rng):
  """`[rows, length]` segment ids: each row's examples in order with the
  padding last (what packers make), a row without the last examples, and,
  not `contiguous`, examples split in two with padding between."""
  layout = np.zeros((rows, length), np.int32)
  for r in range(rows):
    held = segments if r % 2 == 0 else segments - 1
    sizes = rng.multinomial(length, [1 / (held + 1)] * (held + 1))
    layout[r] = np.repeat([*range(1, held + 1), 0], sizes)
    if not contiguous:
      layout[r] = np.roll(layout[r], length // 3)
  return layout


def _small_tiles(monkeypatch, length=48, weight_tiles=1):
  """Tiles of 128 and blocks of 2 rows of `length` (`weight_tiles`: the
  tasks' weights a tile holds): the kernels' grids then contract over
  several tiles, write several output tiles and keep sums for blocks of
  rows, as at a model's sizes."""
  monkeypatch.setattr(segment_kernels, '_TILE_IN', 128)
  monkeypatch.setattr(segment_kernels, '_TILE_OUT', 128)
  monkeypatch.setattr(
      segment_kernels, '_VMEM_BYTES',
      segment_kernels._vmem_bytes(2, length, 128, 128, 4, weight_tiles))


@pytest.mark.parametrize('length, contiguous, tiled', [
    (256, True, False),   # windows of 128 rows and of 16
    (48, False, False),   # any layout is exact, only slower
    (20, True, False),    # a length of no whole chunk: one window a segment
    (48, True, True),     # several tiles each way, blocks of 2 rows
])
def test_gated_matmul_matches_numpy_token_by_token(length, contiguous, tiled,
                                                   monkeypatch):
  """HyperGrid's kernel: `sum(w * out)` and its gradients for x, the kernel
  and every segment's grid are numpy's token-by-token `x ((1 +
  psi(grid[s])) ⊙ W)` (HyperGrid Eq. 7; padding ungated)."""
  _check_gated_matmul(length, contiguous, tiled, monkeypatch)


def _check_gated_matmul(length, contiguous, tiled, monkeypatch):
  rng = np.random.default_rng(length)
  rows, d_in, d_out, segments, k_in, k_out = 3, 32, 48, 3, 4, 6
  if tiled:
    _small_tiles(monkeypatch, length)
    rows, d_in, d_out = 4, 256, 384
  x = rng.normal(size=(rows, length, d_in)).astype(np.float32)
  kernel = rng.normal(size=(d_in, d_out)).astype(np.float32)
  grid = rng.uniform(size=(rows, segments, k_in, k_out)).astype(np.float32)
  w = rng.normal(size=(rows, length, d_out)).astype(np.float32)
  layout = _segment_layouts(rows, length, segments, contiguous, rng)

  def loss(x, kernel, grid):
    return (segment_kernels.segment_gated_matmul(x, kernel, grid, layout)
            * w).sum()

  value, (dx, dkernel, dgrid) = jax.value_and_grad(loss, argnums=(0, 1, 2))(
      x, kernel, grid)
  want = dict(value=0.0, dx=np.zeros(x.shape), dkernel=np.zeros(kernel.shape),
              dgrid=np.zeros(grid.shape))
  size = {k: np.zeros_like(v) for k, v in want.items()}
  for row in range(rows):
    for t in range(length):
      s = layout[row, t]
      gate = 1 if s == 0 else 1 + numpy_hypergrid.block_repeat(
          grid[row, s - 1], d_in, d_out)
      outer = np.outer(x[row, t], w[row, t])
      want['value'] += x[row, t] @ (kernel * gate) @ w[row, t]
      size['value'] += np.abs(x[row, t]) @ np.abs(kernel * gate) @ np.abs(
          w[row, t])
      want['dx'][row, t] = (kernel * gate) @ w[row, t]
      size['dx'][row, t] = np.abs(kernel * gate) @ np.abs(w[row, t])
      want['dkernel'] += outer * gate
      size['dkernel'] += np.abs(outer) * gate
      if s:
        blocks = (k_in, d_in // k_in, k_out, d_out // k_out)
        want['dgrid'][row, s - 1] += (outer * kernel).reshape(blocks).sum(
            (1, 3))
        size['dgrid'][row, s - 1] += np.abs(outer * kernel).reshape(
            blocks).sum((1, 3))
  tokens = rows * length
  got = dict(value=value, dx=dx, dkernel=dkernel, dgrid=dgrid)
  bounds = dict(value=conftest.float32_bound(d_in, d_out, tokens),
                dx=conftest.float32_bound(d_out, 2),
                dkernel=conftest.float32_bound(tokens, 2),
                dgrid=conftest.float32_bound(tokens, d_in, d_out))
  for name in want:
    conftest.assert_close_to_scale(np.asarray(got[name]), want[name],
                                   bounds[name], size[name])


def _task_layout(rng, rows, length, num_tasks):
  """`[rows, length]` task ids: a few examples a row, a task that returns
  later in row 0, the padding (task 0) last."""
  tasks = np.zeros((rows, length), np.int32)
  for r in range(rows):
    cuts = np.sort(rng.choice(np.arange(1, length - 2), 4, replace=False))
    for at in cuts:
      tasks[r, at:] = rng.integers(0, num_tasks)
    tasks[r, length - 3:] = 0  # padding
  tasks[0, :length // 4] = tasks[0, length // 2]
  return tasks


def _per_task_reference(x, weights, tasks, w):
  """numpy's `sum(w * (x_t W[task_t]))`, its gradients, and the magnitudes
  their rounding scales with."""
  gathered = weights[tasks].astype(np.float64)  # [rows, length, in, out]
  value = np.einsum('rli,rlio,rlo->', x, gathered, w)
  size = np.einsum('rli,rlio,rlo->', np.abs(x), np.abs(gathered), np.abs(w))
  dx = np.einsum('rlio,rlo->rli', gathered, w)
  dx_size = np.einsum('rlio,rlo->rli', np.abs(gathered), np.abs(w))
  dweights = np.zeros(weights.shape)
  dweights_size = np.zeros(weights.shape)
  np.add.at(dweights, tasks, np.einsum('rli,rlo->rlio', x, w))
  np.add.at(dweights_size, tasks, np.einsum('rli,rlo->rlio', np.abs(x),
                                            np.abs(w)))
  return (value, dx, dweights), (size, dx_size, dweights_size)


@pytest.mark.parametrize('length, d_in, d_out, tiled, transposed', [
    (256, 32, 24, False, False), (48, 32, 24, False, False),
    (20, 32, 24, False, False), (48, 24, 32, False, False),
    (48, 32, 24, False, True),  # W_down as the adapters give it, [T, b, d]
    # several tiles and row blocks
    (48, 256, 384, True, False), (48, 384, 24, True, False),
    (48, 256, 384, True, True), (48, 384, 24, True, True),
])
def test_per_task_matmul_matches_numpy_token_by_token(length, d_in, d_out,
                                                      tiled, transposed,
                                                      monkeypatch):
  """The adapters' kernel: `sum(w * out)` and its gradients for x and every
  task's weights are numpy's `x_t W[task_t]` token by token, with the
  weights given as `[T, d_in, d_out]` or, `transposed`, `[T, d_out, d_in]`
  (their gradient in the same layout)."""
  _check_per_task_matmul(length, d_in, d_out, tiled, transposed, monkeypatch)


def _check_per_task_matmul(length, d_in, d_out, tiled, transposed,
                           monkeypatch):
  rng = np.random.default_rng(length)
  rows, num_tasks = 3, 4
  if tiled:
    _small_tiles(monkeypatch, length, num_tasks)
    rows = 4
  x = rng.normal(size=(rows, length, d_in)).astype(np.float32)
  weights = rng.normal(size=(num_tasks, d_in, d_out)).astype(np.float32)
  w = rng.normal(size=(rows, length, d_out)).astype(np.float32)
  tasks = _task_layout(rng, rows, length, num_tasks)

  def loss(x, weights):
    given = jnp.swapaxes(weights, 1, 2) if transposed else weights
    return (segment_kernels.per_task_matmul(x, given, tasks,
                                            transposed=transposed) * w).sum()

  value, grads = jax.value_and_grad(loss, argnums=(0, 1))(x, weights)
  want, size = _per_task_reference(x, weights, tasks, w)
  tokens = rows * length
  bounds = (conftest.float32_bound(d_in, d_out, tokens),
            conftest.float32_bound(d_out, 2), conftest.float32_bound(tokens, 2))
  for got, expected, bound, scale in zip((value, *grads), want, bounds, size):
    conftest.assert_close_to_scale(np.asarray(got), expected, bound, scale)


def test_per_task_matmul_multiplies_at_the_precision_asked():
  """Every matmul of the forward and both gradients takes the precision
  given (HyperFormer++'s variance asks for HIGHEST, as its XLA form does);
  by default none names one (DEFAULT, as the XLA forms' matmuls)."""
  x, weights = jnp.ones((2, 16, 8)), jnp.ones((3, 8, 8))
  tasks = jnp.zeros((2, 16), jnp.int32)

  def kernels(precision):
    grad = jax.grad(lambda x, w: segment_kernels.per_task_matmul(
        x, w, tasks, precision=precision).sum(), argnums=(0, 1))
    text = str(jax.make_jaxpr(grad)(x, weights))
    return text.count('pallas_call['), text.count('Precision.HIGHEST')

  assert kernels(None) == (3, 0)
  calls, highest = kernels(jax.lax.Precision.HIGHEST)
  assert calls == 3 and highest >= 3


# Pallas's TPU interpreter (`segment_kernels.INTERPRET`). Both interpreters
# fill scratch and outputs with NaN until written (a missing accumulator
# reset fails either); only the TPU one writes an output block back when its
# index changes, as a TensorCore does (a block revisited after another
# raises; the plain one reads and writes every block at every step), and
# runs the 'parallel' axes in a shuffled order. `MEGACORE` splits them over
# two cores, as a TPU v4 / v5p chip does, with the race detector (4x slower,
# so on the tiled shapes only).
TPU_INTERPRET = pltpu.InterpretParams(uninitialized_memory='nan',
                                      random_seed=7)
MEGACORE = dataclasses.replace(TPU_INTERPRET, num_cores_or_threads=2,
                               detect_races=True)
_INTERPRETERS = {'core': TPU_INTERPRET, 'megacore': MEGACORE}


def _in_tpu_interpreter(params, check, capsys, monkeypatch):
  """`check()` with the kernels in the TPU interpreter; fails on a race the
  detector reports (it prints them)."""
  monkeypatch.setattr(segment_kernels, 'INTERPRET', _INTERPRETERS[params])
  try:
    check()
  finally:
    # An error inside the interpreter leaves its simulated TPU behind.
    pltpu.reset_tpu_interpret_mode_state()
  printed = capsys.readouterr().out
  assert 'RACE DETECTED' not in printed, printed[-3000:]


@pytest.mark.parametrize('length, contiguous, tiled, params', [
    (20, True, False, 'core'),  # no whole chunk, one tile
    (48, False, False, 'core'),  # split segments
    (32, True, True, 'megacore'),  # 2 x 3 tiles, 2 blocks of 2 rows
])
def test_gated_matmul_in_tpu_interpreter(length, contiguous, tiled, params,
                                         capsys, monkeypatch):
  """HyperGrid's kernels as a TPU runs them: numpy's values."""
  _in_tpu_interpreter(params, lambda: _check_gated_matmul(
      length, contiguous, tiled, monkeypatch), capsys, monkeypatch)


@pytest.mark.parametrize('length, d_in, d_out, tiled, transposed, params', [
    (48, 32, 24, False, True, 'core'),  # [T, b, d]: 24 lanes
    (20, 32, 24, False, False, 'core'),
    (32, 384, 24, True, False, 'core'),
    (32, 256, 256, True, True, 'megacore'),  # 2 x 2 tiles, 2 row blocks
])
def test_per_task_matmul_in_tpu_interpreter(length, d_in, d_out, tiled,
                                            transposed, params, capsys,
                                            monkeypatch):
  """The adapters' kernels as a TPU runs them: numpy's values."""
  _in_tpu_interpreter(params, lambda: _check_per_task_matmul(
      length, d_in, d_out, tiled, transposed, monkeypatch), capsys,
                      monkeypatch)


# The per-task kernel on a mesh of 4 x 2 CPU devices, in a process of its own
# (the device count is fixed when JAX starts).
_PER_TASK_ON_A_MESH = """
import json
import jax, numpy as np
from flax.linen import partitioning as nn_partitioning
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.t5 import segment_kernels
import test_segment_kernels
rng = np.random.default_rng(0)
x = rng.normal(size=(8, 32, 16)).astype(np.float32)
weights = rng.normal(size=(4, 16, 8)).astype(np.float32)
w = rng.normal(size=(8, 32, 8)).astype(np.float32)
tasks = test_segment_kernels._task_layout(rng, 8, 32, 4)
loss = lambda x, weights: (segment_kernels.per_task_matmul(x, weights, tasks)
                           * w).sum()
mesh = partitioning.create_mesh(data=4, model=2)
with jax.set_mesh(mesh), nn_partitioning.axis_rules(
    partitioning.logical_axis_rules()):
  value, (dx, dweights) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
      x, weights)
print('RESULT', json.dumps({
    'value': float(value), 'dx': np.asarray(dx).tolist(),
    'dweights': np.asarray(dweights).tolist(), 'x': x.tolist(),
    'weights': weights.tolist(), 'w': w.tolist(), 'tasks': tasks.tolist()}))
"""


def test_per_task_matmul_on_a_mesh():
  """The batch split over 'data' (the kernels run per shard, `shard_map`):
  the same value and gradients, the weights' summed over the shards."""
  run = subprocess.run([sys.executable, '-c', _PER_TASK_ON_A_MESH],
                       env=multiprocess.env(8), capture_output=True,
                       text=True, timeout=600,
                       cwd=pathlib.Path(__file__).parent)
  lines = [l for l in run.stdout.splitlines() if l.startswith('RESULT ')]
  assert lines, run.stderr[-3000:]
  r = {k: np.asarray(v) for k, v in json.loads(lines[0][7:]).items()}
  want, size = _per_task_reference(r['x'], r['weights'], r['tasks'], r['w'])
  rows, length, d_in = r['x'].shape
  d_out = r['w'].shape[-1]
  bounds = (conftest.float32_bound(d_in, d_out, rows * length),
            conftest.float32_bound(d_out, 2),
            conftest.float32_bound(rows * length, 2))
  for got, expected, bound, scale in zip(
      (r['value'], r['dx'], r['dweights']), want, bounds, size):
    conftest.assert_close_to_scale(got, expected, bound, scale)
