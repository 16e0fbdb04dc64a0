r"""The TPU kernels (`t5/segment_kernels.py`) accepted on a TPU, and compiled
for every TPU generation from a CPU host.

    python -m hyperprompt_jax.benchmarks.kernel_acceptance \
        [--model=t5_1_1_base] [--batch_size=4] [--input_length=512] \
        [--target_length=32] [--variants=hypergrid_lg,adapter,hyperformer_pp] \
        [--steps=5] [--warmup_steps=3] [--peak_tflops=197] \
        [--tests=matches_numpy_token_by_token] [--output_json=kernels.json]
    python -m hyperprompt_jax.benchmarks.kernel_acceptance --compile \
        [--topologies=v3:2x2,v4:2x2x1,v5e:2x2,v5p:2x2x1,v6e:2x2] \
        [--cases=hypergrid_wo,hypergrid_wi,adapter,hyperformer_pp] \
        [--backbones=t5_1_1_base,t5_base] [--output_json=vmem.json]

On the machine the kernels are for (one TPU chip; the first form), four
checks, each variant of `KERNEL_VARIANTS` in its kernel form ('pallas') beside
its XLA form:
(a) tests: `tests/test_segment_kernels.py` (the `--tests` pytest selection:
    the kernels against numpy token by token, Mosaic on the chip) in a
    process of its own, started before this one opens the chip (libtpu lets
    one process hold it), at float32 matmul precision (the tests' float32
    bounds; the kernels' matmuls follow `jax.default_matmul_precision` as
    XLA's do). Needs a checkout with tests/ and the `[test]` extra.
(b) forms: loss and gradients of the kernel form against the XLA form,
    on the same parameters and packed batch (`mfu.synthetic_rows`, GLUE +
    SuperGLUE-like rows), dropout off (`CHECKS`): in float32 at float32
    matmul precision, where every parameter's gradient must agree to
    float32 rounding (`|g_kernel - g_xla| / |g_xla|`, L2 norms, the worst
    parameter's), and in the run's bfloat16, where the loss and all
    gradients as one vector must agree to bfloat16 rounding.
(c) timing: each form's training step (`mfu.measure`: Adafactor, the
    built-in runner's), compiled, warmed up, timed step by step (median);
(d) MFU: XLA's FLOPs of the XLA form's step (the same work for both forms;
    a kernel's own count is its cost estimate) over each form's time,
    against the chip's dense bf16 peak (`mfu.PEAK_TFLOPS`, `--peak_tflops`).
Exit status 1 where a test fails or a difference exceeds its bound.
On a CPU host the same command runs the kernels in Pallas's interpreter
(tests/test_kernel_acceptance.py runs it so at a tiny size).

`--compile` (a CPU host with libtpu, the `[tpu]` extra) compiles each
kernel (`CASES`: forward and backward, one `jax.value_and_grad`) at a
Base-sized device batch (4 rows of 512 tokens, bfloat16) for one device of
each TPU slice (`slices.topology_devices`), and reports each kernel's
VMEM as the TPU compiler allocates it (the optimized module's
`used_scoped_memory_configs`) against the generation's VMEM (`VMEM_MIB`),
beside the forward kernels' own count (`segment_kernels._vmem_bytes`, which
picks their row blocks). `--vmem_probe` measures each generation's VMEM
(the largest scratch a kernel compiles with).
"""

import argparse
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from hyperprompt_jax import files
from hyperprompt_jax.benchmarks import mfu
from hyperprompt_jax.benchmarks import timing
from hyperprompt_jax.methods import adapters
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.model import network
from hyperprompt_jax.t5 import segment_kernels
from hyperprompt_jax.training import trainer

MIB = 2**20
# The variants whose packed rows go through the kernels: the config field
# that holds their packed form, and the XLA form they are checked against
# (the exact one 'auto' picks off TPU).
KERNEL_VARIANTS = {
    'hypergrid_lg': ('hypergrid', 'blockwise'),
    'adapter': ('adapter', 'task_blocks'),
    'hyperformer_pp': ('hyperformer', 'task_blocks'),
}
KERNEL_FORM = 'pallas'
# The form checks (b): activation dtype -> the matmul precision, and the
# relative differences allowed between the forms: the loss's, and the
# gradients' (which: 'worst', the worst parameter's, or 'global', all
# parameters' as one vector).
CHECKS = {
    # Both forms are float32 sums in another order (2 u n, u = 2^-24,
    # n ~ 10^4 terms a sum, with room): every parameter's gradient agrees.
    'float32': ('float32', 1e-4, 'worst', 1e-3),
    # The run's: each form rounds its own intermediates to bfloat16 (u =
    # 2^-8; the kernel HyperGrid's gated weight once, 'blockwise' the
    # gated inputs), and a small gradient of cancelling terms (a bias
    # generator's) differs by several percent. At t5_1_1_tiny on CPU
    # (rows of 64 / 16): the kernels against the XLA forms, loss 3e-4 and
    # all gradients 1.3e-2 (HyperGrid), 1.2e-2 (HyperFormer++), 2e-4 (the
    # adapter); two XLA forms alike (HyperGrid 'blockwise' against
    # 'grouped': 6e-4, 1.3e-2). The float32 check is the strict one.
    'bfloat16': (None, 2**-7, 'global', 2**-4),
}
# The tests the chip runs (`--tests`, a pytest -k expression): the kernels
# against numpy, outside any interpreter.
DEFAULT_TESTS = 'matches_numpy_token_by_token'
TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), 'tests', 'test_segment_kernels.py')

# VMEM of a TensorCore in MiB by a lower-case piece of
# `jax.Device.device_kind` (the first that matches), as `--vmem_probe`
# measured it with libtpu 0.0.42 (jax's `tpu_info` has the same figures):
# a kernel compiles with a scratch up to 0.25-0.5 MiB below these.
VMEM_MIB = (
    ('tpu v3', 16),
    ('tpu v4', 16),
    ('tpu v5 lite', 128),  # v5e
    ('tpu v5', 64),        # v5p
    ('tpu v6 lite', 128),  # v6e
)
TOPOLOGIES = ('v3:2x2', 'v4:2x2x1', 'v5e:2x2', 'v5p:2x2x1', 'v6e:2x2')
BACKBONES = ('t5_1_1_base', 't5_base')


# -- (a) the tests on the chip ------------------------------------------------


def run_tests(select: str, log: Callable[[str], None] = print
              ) -> dict[str, Any]:
  """`tests/test_segment_kernels.py -k select` in a process of its own on
  JAX's default platform (the chip; `JAX_PLATFORMS` as this process has
  it), at float32 matmul precision."""
  if not os.path.exists(TESTS) or importlib.util.find_spec('pytest') is None:
    log(f'tests: skipped ({TESTS} or pytest missing: run from a checkout '
        "with the [test] extra)")
    return {'status': 'skipped'}
  # conftest puts JAX on the CPU unless JAX_PLATFORMS is set: '' is JAX's
  # own choice (the TPU).
  env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION='float32')
  env.setdefault('JAX_PLATFORMS', '')
  command = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
             TESTS, '-k', select]
  log(f'{time.strftime("%H:%M:%S")} tests: {" ".join(command[2:])}')
  start = time.perf_counter()
  run = subprocess.run(command, cwd=os.path.dirname(TESTS), env=env,
                       capture_output=True, text=True, check=False)
  lines = run.stdout.strip().splitlines()
  summary = lines[-1] if lines else run.stderr[-400:]
  log(f'tests: {summary} ({time.perf_counter() - start:.0f} s)')
  if run.returncode != 0:
    log(run.stdout[-4000:])
  return {'status': 'passed' if run.returncode == 0 else 'failed',
          'returncode': run.returncode, 'summary': summary,
          'seconds': time.perf_counter() - start}


# -- (b) the kernel form against the XLA form ---------------------------------


def form_config(backbone: str, variant: str, dtype: str, form: str,
                num_layers: Optional[int] = None) -> network.T5Config:
  """`mfu.model_config`'s `variant` with its packed rows in `form` ('pallas'
  or its XLA form, `KERNEL_VARIANTS`), `num_layers` a stack (None: the
  backbone's)."""
  cfg = mfu.model_config(backbone, variant, dtype, num_layers=num_layers)
  field = KERNEL_VARIANTS[variant][0]
  return cfg.replace(**{field: getattr(cfg, field).replace(packed_form=form)})


def _gradients(cfg: network.T5Config, params: Any, batch: dict[str, Any],
               precision: Optional[str]) -> tuple[float, Any]:
  """The loss (dropout off) and its gradient for every parameter."""
  model = network.Transformer(cfg.replace(dropout_rate=0.0))

  def loss(p):
    return trainer.loss_fn(model, p, batch, jax.random.PRNGKey(0),
                           timing.Z_LOSS)[0]

  with jax.default_matmul_precision(precision):
    value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return float(value), grads


def differences(loss: float, grads: Any, want_loss: float, want_grads: Any
                ) -> dict[str, Any]:
  """The relative differences of a loss and its gradients from the
  reference ones: the loss's, each parameter's (L2 norms; a zero gradient
  by its absolute difference), the worst parameter's and all parameters'
  as one vector's ('global')."""
  leaves = jax.tree_util.tree_leaves_with_path(want_grads)
  got = jax.tree_util.tree_leaves(grads)
  each, squares = {}, np.zeros(2)
  for (path, want), g in zip(leaves, got):
    want, g = want.astype(jnp.float32), g.astype(jnp.float32)
    norm = float(jnp.linalg.norm(want))
    diff = float(jnp.linalg.norm(g - want))
    squares += (diff**2, norm**2)
    each[jax.tree_util.keystr(path)] = diff / norm if norm else diff
  worst = max(each, key=each.get)
  return {'loss': abs(loss - want_loss) / abs(want_loss),
          'worst': each[worst], 'worst_parameter': worst,
          'global': float(np.sqrt(squares[0] / squares[1])),
          'parameters': each}


def compare_forms(backbone: str, variant: str, batch: dict[str, Any],
                  input_length: int, target_length: int,
                  checks: Sequence[str] = tuple(CHECKS),
                  log: Callable[[str], None] = print,
                  num_layers: Optional[int] = None) -> dict[str, Any]:
  """(b): the kernel form's loss and gradients against the XLA form's, in
  each activation dtype of `checks` (`CHECKS`), on the same parameters."""
  xla_form = KERNEL_VARIANTS[variant][1]
  params = timing.fresh_params(
      network.Transformer(form_config(backbone, variant, 'float32', xla_form,
                                      num_layers)),
      input_length, target_length)
  out = {}
  for dtype in checks:
    precision, loss_bound, which, bound = CHECKS[dtype]
    want_loss, want_grads = _gradients(
        form_config(backbone, variant, dtype, xla_form, num_layers), params,
        batch, precision)
    loss, grads = _gradients(
        form_config(backbone, variant, dtype, KERNEL_FORM, num_layers),
        params, batch, precision)
    diff = differences(loss, grads, want_loss, want_grads)
    diff.update(kernel_loss=loss, xla_loss=want_loss, gradient=diff[which],
                judged=which, bounds=(loss_bound, bound),
                passed=diff['loss'] <= loss_bound and diff[which] <= bound)
    out[dtype] = diff
    log(f'{time.strftime("%H:%M:%S")} {variant} {dtype}: loss {loss:.6f} '
        f'({KERNEL_FORM}) vs {want_loss:.6f} ({xla_form}), relative '
        f'{diff["loss"]:.1e} (bound {loss_bound:.0e}); gradients: {which} '
        f'{diff[which]:.1e} (bound {bound:.0e}), global {diff["global"]:.1e}'
        f', worst {diff["worst"]:.1e} at {diff["worst_parameter"]}: '
        f'{"ok" if diff["passed"] else "FAILED"}')
    del grads, want_grads
  return out


# -- (c), (d) time and MFU ----------------------------------------------------


def time_forms(backbone: str, variant: str, dtype: str, batch: dict[str, Any],
               warmup_steps: int, steps: int, peak: Optional[float],
               log: Callable[[str], None] = print,
               num_layers: Optional[int] = None) -> dict[str, Any]:
  """(c), (d): each form's training step timed (`mfu.measure`), and MFU of
  the XLA form's FLOPs over each form's time."""
  rows = {}
  for form in (KERNEL_VARIANTS[variant][1], KERNEL_FORM):
    log(f'{time.strftime("%H:%M:%S")} {variant} [{form}]: compiling the step')
    rows[form] = mfu.measure(
        form_config(backbone, variant, dtype, form, num_layers), batch,
        warmup_steps, steps)
  xla = rows[KERNEL_VARIANTS[variant][1]]
  flops = xla['xla_flops'] or xla['six_nd_flops']
  for form, row in rows.items():
    seconds = row['seconds_per_step']
    row['mfu'] = flops / seconds / (peak * 1e12) if peak else None
    row['ratio_to_xla'] = seconds / xla['seconds_per_step']
    log(f'{variant} [{form}]: {1000 * seconds:.1f} ms/step '
        f'({row["ratio_to_xla"]:.3f}x the XLA form), MFU '
        f'{_percent(row["mfu"])}')
  return rows


def _percent(x: Optional[float]) -> str:
  return 'n/a' if x is None else f'{100 * x:.1f}%'


def acceptance(args: argparse.Namespace,
               log: Callable[[str], None] = print) -> dict[str, Any]:
  """The four checks (module docstring) of `args`' variants."""
  report = {'model': args.model, 'batch_size': args.batch_size,
            'input_length': args.input_length,
            'target_length': args.target_length, 'variants': {}}
  if args.num_layers is not None:  # a smaller model than the backbone's
    report['num_layers'] = args.num_layers
  # Before this process opens the chip.
  report['tests'] = (run_tests(args.tests, log) if args.tests != 'none'
                     else {'status': 'skipped'})
  device = jax.devices()[0]
  peak = mfu.peak_tflops(device, args.peak_tflops)
  report.update(device=device.device_kind, platform=device.platform,
                jax=jax.__version__, peak_tflops=peak)
  log(f'device: {device.device_kind} ({device.platform}), jax '
      f'{jax.__version__}, peak {peak} TFLOP/s bf16; kernels '
      f'{"on the chip" if device.platform == "tpu" else "interpreted"}')
  for variant in args.variants.split(','):
    cfg = mfu.model_config(args.model, variant, args.dtype)
    batch, stats = mfu.synthetic_rows(
        args.batch_size, args.input_length, args.target_length,
        cfg.vocab_size, cfg.num_tasks, packed=True,
        max_segments=hypergrid.max_segments(cfg.hypergrid))
    entry = {'rows': stats}
    entry['forms'] = compare_forms(args.model, variant, batch,
                                   args.input_length, args.target_length,
                                   args.checks.split(','), log,
                                   args.num_layers)
    if args.steps:
      entry['timing'] = time_forms(args.model, variant, args.dtype, batch,
                                   args.warmup_steps, args.steps, peak, log,
                                   args.num_layers)
    report['variants'][variant] = entry
    if args.output_json:
      files.write_atomically(args.output_json, json.dumps(report, indent=1))
  report['passed'] = report['tests']['status'] != 'failed' and all(
      d['passed'] for e in report['variants'].values()
      for d in e['forms'].values())
  return report


def format_report(report: dict[str, Any]) -> str:
  """The checks as a table: one row per variant and form."""
  layers = (f' (--num_layers={report["num_layers"]})'
            if 'num_layers' in report else '')
  lines = [f'{report["model"]}{layers}, batch {report["batch_size"]} rows of '
           f'{report["input_length"]} / {report["target_length"]}; '
           f'{report["device"]}; tests: {report["tests"]["status"]}',
           f'{"variant":<28}{"f32 loss/grad":>16}{"bf16 loss/grad":>16}'
           f'{"ms/step":>9}{"x XLA":>7}{"MFU":>7}']
  for variant, entry in report['variants'].items():
    forms = entry['forms']
    for form in (KERNEL_VARIANTS[variant][1], KERNEL_FORM):
      kernel = form == KERNEL_FORM
      cells = [f'{forms[d]["loss"]:.0e}/{forms[d]["gradient"]:.0e}'
               if kernel and d in forms else '-' for d in CHECKS]
      timing_row = entry.get('timing', {}).get(form)
      lines.append(
          f'{f"{variant} [{form}]":<28}{cells[0]:>16}{cells[1]:>16}' + (
              f'{1000 * timing_row["seconds_per_step"]:>9.1f}'
              f'{timing_row["ratio_to_xla"]:>6.3f}x'
              f'{_percent(timing_row["mfu"]):>7}'
              if timing_row else ''))
  lines.append('PASSED' if report['passed'] else 'FAILED')
  return '\n'.join(lines)


# -- --compile: each kernel for each TPU generation ---------------------------

ROWS, LENGTH, SEGMENTS = 4, 512, 8  # a device's batch at Base


def _gated_case(backbone: str, target: str):
  """HyperGrid-LG's gated matmul on `target` ('wo': `[d_ff, d_model]`,
  'wi': `[d_model, d_ff]`): the function and its argument shapes."""
  size = mfu.BACKBONES[backbone]
  grid_cfg = hypergrid.HyperGridConfig()
  # The paper's grid splits d_model in grid_rows blocks and d_ff in
  # grid_cols, oriented to the kernel (`hypergrid.orient_grid`).
  shape = (size['emb_dim'], size['mlp_dim'])
  blocks = (grid_cfg.grid_rows, grid_cfg.grid_cols)
  if target == 'wo':
    shape, blocks = shape[::-1], blocks[::-1]

  def loss(x, kernel, grid, segment_ids):
    y = segment_kernels.segment_gated_matmul(x, kernel, grid, segment_ids)
    return y.astype(jnp.float32).sum()

  args = ((ROWS, LENGTH, shape[0], jnp.bfloat16), (*shape, jnp.bfloat16),
          (ROWS, SEGMENTS, *blocks, jnp.bfloat16), (ROWS, LENGTH, jnp.int32))
  return loss, args, 3


def _adapter_case(backbone: str, variant: str):
  """The adapters' per-task matmuls of `variant` ('adapter', 'hyperformer_pp':
  b = d / reduction, HyperFormer++'s norm), one layer of T tasks."""
  cfg = mfu.model_config(backbone, variant)
  method = cfg.adapter if variant == 'adapter' else cfg.hyperformer
  d, t = cfg.emb_dim, cfg.num_tasks
  b = d // method.reduction
  norm = variant == 'hyperformer_pp'

  def loss(h, down, down_bias, up, up_bias, *rest):
    *norm_params, task_ids = rest
    w = adapters.AdapterWeights(down, down_bias, up, up_bias, *norm_params)
    return adapters.adapt_on_chip(jax.nn.relu, h, w, task_ids).astype(
        jnp.float32).sum()

  args = [(ROWS, LENGTH, d, jnp.bfloat16), (t, d, b, jnp.float32),
          (t, b, jnp.float32), (t, b, d, jnp.float32), (t, d, jnp.float32)]
  if norm:
    args += [(t, d, jnp.float32), (t, d, jnp.float32)]
  args.append((ROWS, LENGTH, jnp.int32))
  return loss, tuple(args), len(args) - 1


# Kernel setups at Base, by name: `(backbone) -> (loss, argument shapes
# (shape..., dtype), arguments differentiated)`; the per-task ones do not
# depend on d_ff.
CASES = {
    'hypergrid_wo': functools.partial(_gated_case, target='wo'),
    'hypergrid_wi': functools.partial(_gated_case, target='wi'),
    'adapter': functools.partial(_adapter_case, variant='adapter'),
    'hyperformer_pp': functools.partial(_adapter_case,
                                        variant='hyperformer_pp'),
}
_PER_BACKBONE = ('hypergrid_wo', 'hypergrid_wi')
_USED_VMEM = re.compile(
    r'used_scoped_memory_configs":\[\{"memory_space":"1","offset":"\d+",'
    r'"size":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_RESULT = re.compile(r'=\s*(\(.*?\)|\S+)\s+custom-call\(')


def vmem_mib(device_kind: str) -> Optional[int]:
  kind = device_kind.lower()
  return next((mib for piece, mib in VMEM_MIB if piece in kind), None)


def kernel_vmem(hlo_text: str) -> list[dict[str, Any]]:
  """Each Mosaic kernel of an optimized module: forward or backward (under
  the gradient's transpose), its result's shape and the VMEM the compiler
  allocated it."""
  kernels = []
  for line in hlo_text.splitlines():
    if 'custom_call_target="tpu_custom_call"' not in line:
      continue
    used = _USED_VMEM.search(line)
    op = _OP_NAME.search(line)
    result = _RESULT.search(line)
    kernels.append({
        'pass': ('backward' if op and 'transpose' in op.group(1)
                 else 'forward'),
        'result': re.sub(r'\{[^}]*\}', '', result.group(1)) if result else '?',
        'vmem_bytes': int(used.group(1)) if used else None})
  return kernels


def compile_case(case: str, backbone: str, devices: Sequence[jax.Device]
                 ) -> dict[str, Any]:
  """One case compiled for one device of `devices`' slice: its kernels'
  VMEM, or the compiler's error."""
  loss, shapes, num_diff = CASES[case](backbone)
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ('data',))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  args = [jax.ShapeDtypeStruct(s[:-1], s[-1], sharding=replicated)
          for s in shapes]
  start = time.perf_counter()
  row = {'case': case, 'backbone': backbone}
  try:
    with jax.set_mesh(mesh):
      compiled = jax.jit(jax.value_and_grad(
          loss, argnums=tuple(range(num_diff)))).lower(*args).compile()
      row['counted'] = forward_blocks(case, backbone)
    row['kernels'] = kernel_vmem(compiled.as_text())
  except Exception as e:  # pylint: disable=broad-except
    row['error'] = str(e)[:2000]
  row['compile_seconds'] = time.perf_counter() - start
  return row


def forward_blocks(case: str, backbone: str) -> Optional[list[dict[str, Any]]]:
  """HyperGrid's forward kernels (the forward pass, the input gradient):
  their tiles, row blocks and VMEM as `segment_kernels._vmem_bytes` counts
  it (what picks the blocks), where the model is compiled for (the
  current mesh's devices)."""
  if not case.startswith('hypergrid'):
    return None
  # pylint: disable=protected-access
  _, shapes, _ = CASES[case](backbone)
  w_shape, blocks = shapes[1][:2], shapes[2][2:4]
  out = []
  for name, transposed in (('forward', False), ('input gradient', True)):
    d_x = w_shape[1 if transposed else 0]
    d_y, tile_in, tile_out = segment_kernels._gated_tiles(w_shape, blocks,
                                                          transposed)
    _, block, _, _ = segment_kernels._forward_grid(
        ROWS, LENGTH, d_x, d_y, tile_in, tile_out, 2)
    out.append({'kernel': name, 'tiles': (tile_in, tile_out),
                'block_rows': block, 'counted_bytes': segment_kernels
                ._vmem_bytes(block, LENGTH, tile_in, tile_out, 2)})
  return out


def compile_kernels(topologies: Sequence[str], cases: Sequence[str],
                    backbones: Sequence[str],
                    log: Callable[[str], None] = print,
                    output_json: Optional[str] = None) -> dict[str, Any]:
  """`--compile`: every case for one device of each slice (module
  docstring)."""
  from hyperprompt_jax.tpu import slices  # pylint: disable=g-import-not-at-top
  report = {'jax': jax.__version__, 'rows': ROWS, 'length': LENGTH,
            'generations': []}
  for topology in topologies:
    devices = slices.topology_devices(topology)
    kind = devices[0].device_kind
    generation = {'topology': topology, 'device_kind': kind,
                  'vmem_mib': vmem_mib(kind), 'cases': []}
    for case in cases:
      for backbone in (backbones if case in _PER_BACKBONE else backbones[:1]):
        row = compile_case(case, backbone, devices)
        generation['cases'].append(row)
        log(format_case(kind, generation['vmem_mib'], row))
    report['generations'].append(generation)
    if output_json:
      files.write_atomically(output_json, json.dumps(report, indent=1))
  report['passed'] = all('error' not in row for g in report['generations']
                         for row in g['cases'])
  return report


def format_case(kind: str, vmem: Optional[int], row: dict[str, Any]) -> str:
  head = f'{kind:<12} {row["case"]:<15} {row["backbone"]:<12}'
  if 'error' in row:
    return f'{head} DOES NOT COMPILE: {row["error"][:300]}'
  used = [k['vmem_bytes'] or 0 for k in row['kernels']]
  parts = ', '.join(f'{k["pass"][:3]} {k["result"]} {k["vmem_bytes"] / MIB:.1f}'
                    for k in row['kernels'] if k['vmem_bytes'] is not None)
  counted = ''
  if row.get('counted'):
    counted = '; counted ' + ', '.join(
        f'{c["kernel"]} {c["block_rows"]} rows {c["counted_bytes"] / MIB:.1f}'
        for c in row['counted'])
  return (f'{head} max {max(used) / MIB:.1f} of {vmem} MiB VMEM '
          f'({row["compile_seconds"]:.0f} s): {parts}{counted}')


def vmem_probe(topology: str) -> float:
  """The largest VMEM scratch (MiB, to 1/4) a kernel compiles with for one
  device of `topology`: the generation's VMEM less what the compiler
  keeps."""
  from hyperprompt_jax.tpu import slices  # pylint: disable=g-import-not-at-top
  devices = slices.topology_devices(topology)
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ('data',))
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32,
                           sharding=jax.sharding.NamedSharding(
                               mesh, jax.sharding.PartitionSpec()))

  def compiles(mib: float) -> bool:
    rows = int(mib * MIB) // (128 * 4) // 8 * 8

    def kernel(x_ref, o_ref, scratch_ref):
      scratch_ref[...] = jnp.zeros_like(scratch_ref) + x_ref[0, 0]
      o_ref[...] = scratch_ref[pl.ds(rows - 8, 8), :]

    call = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        scratch_shapes=[pltpu.VMEM((rows, 128), jnp.float32)])
    try:
      with jax.set_mesh(mesh):
        jax.jit(call).lower(x).compile()
      return True
    except Exception:  # pylint: disable=broad-except
      return False

  low, high = 1.0, 512.0
  while high - low > 0.25:
    middle = (low + high) / 2
    low, high = (middle, high) if compiles(middle) else (low, middle)
  return low


# -- the command --------------------------------------------------------------


PROG = 'python -m hyperprompt_jax.benchmarks.kernel_acceptance'


def add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('--model', default='t5_1_1_base',
                      help='the backbone, a gin/models file name')
  parser.add_argument('--num_layers', type=int, default=None,
                      help="layers a stack (default: --model's); fewer for "
                      'a quick run')
  parser.add_argument('--dtype', default='bfloat16',
                      help='activations of the timed steps')
  parser.add_argument('--batch_size', type=int, default=4,
                      help='rows (default: 4, a device of a Base run)')
  parser.add_argument('--input_length', type=int, default=512)
  parser.add_argument('--target_length', type=int, default=32)
  parser.add_argument('--variants', default=','.join(KERNEL_VARIANTS),
                      help=f'variants among {list(KERNEL_VARIANTS)}')
  parser.add_argument('--checks', default=','.join(CHECKS),
                      help='activation dtypes the forms are compared in')
  parser.add_argument('--steps', type=int, default=5,
                      help='timed steps a form (0: no timing)')
  parser.add_argument('--warmup_steps', type=int, default=3)
  parser.add_argument('--peak_tflops', type=float, default=None,
                      help="the chip's dense bf16 TFLOP/s (default: "
                      'mfu.PEAK_TFLOPS by device kind)')
  parser.add_argument('--tests', default=DEFAULT_TESTS,
                      help='pytest -k selection of tests/test_segment_kernels'
                      '.py run on the chip; none: no tests')
  parser.add_argument('--output_json', default=None)
  parser.add_argument('--compile', action='store_true',
                      help='compile each kernel for each TPU generation '
                      '(libtpu, no TPU)')
  parser.add_argument('--topologies', default=','.join(TOPOLOGIES),
                      help='--compile: TPU slices, one device of each')
  parser.add_argument('--cases', default=','.join(CASES),
                      help=f'--compile: kernel setups among {list(CASES)}')
  parser.add_argument('--backbones', default=','.join(BACKBONES),
                      help='--compile: backbones of the HyperGrid cases')
  parser.add_argument('--vmem_probe', action='store_true',
                      help="--compile: measure each generation's VMEM first")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """The flags, as the project's commands parse them (`gin_utils`; its gin
  flags do nothing here), or without gin on a bare accelerator image."""
  try:
    from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
  except ImportError:
    gin_utils = None
  if gin_utils is None:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser)
    args = parser.parse_args(argv)
  else:
    args = gin_utils.command_flags(PROG, __doc__, argv, add_flags=add_flags)
  for flag, given, known in (('--variants', args.variants, KERNEL_VARIANTS),
                             ('--checks', args.checks, CHECKS),
                             ('--cases', args.cases, CASES)):
    bad = sorted(set(given.split(',')) - set(known))
    if bad:
      raise ValueError(f'{flag}: unknown {bad}; choose from {list(known)}.')
  return args


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  log = lambda line: print(line, flush=True)
  if args.compile:
    topologies = args.topologies.split(',')
    probed = {}
    for topology in (topologies if args.vmem_probe else ()):
      probed[topology] = vmem_probe(topology)
      log(f'{topology}: a kernel compiles with up to {probed[topology]} MiB '
          'of VMEM scratch')
    report = compile_kernels(topologies, args.cases.split(','),
                             args.backbones.split(','), log,
                             args.output_json)
    report['vmem_probe_mib'] = probed
  else:
    report = acceptance(args, log)
    log(format_report(report))
  if args.output_json:
    files.write_atomically(args.output_json, json.dumps(report, indent=1))
    log(f'JSON: {args.output_json}')
  return 0 if report['passed'] else 1


if __name__ == '__main__':
  try:
    sys.exit(main())
  except ValueError as e:  # a usage mistake: one line
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
