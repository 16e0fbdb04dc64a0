"""Every method's training step and decode compile for a TPU slice.

The TPU compiler runs here without a TPU (libtpu, from the `[test]` and
`[tpu]` extras, and `jax.experimental.topologies`): `tpu_programs.py`
compiles, for `v5e:2x2`, the built-in runner's training step and the
evaluator's decode of the tiny model of every method, the batch split over
'data' (and the parameters over a 'model' axis of 2); and t5x's train, eval
and predict steps through t5x's partitioner (skipped without t5x). Each
test compiles in one subprocess. libtpu allows one process at a time on a
machine (`/tmp/libtpu_lockfile`) unless `ALLOW_MULTIPLE_LIBTPU_LOAD=1`:
these processes set it, since they only compile (no TPU is opened), so
pytest-xdist's workers, or another checkout's suite, may compile at once."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from hyperprompt_jax.t5 import inputs

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec('libtpu') is None,
    reason="libtpu is not installed (pip install -e '.[tpu]')")

HERE = pathlib.Path(__file__).parent
# The logical axes t5x's standard rules split over 'model'
# (t5x.partitioning.standard_logical_axis_rules); every other axis of a
# parameter is replicated.
MODEL_AXES = {'vocab', 'mlp', 'heads', 'joined_kv'}


def _run(command: list[str], cwd: pathlib.Path) -> str:
  """Runs a compiling command in a process of its own; its stdout."""
  env = dict(os.environ, TPU_SKIP_MDS_QUERY='1',
             ALLOW_MULTIPLE_LIBTPU_LOAD='1')
  # TPU programs stay out of the session's cache of CPU programs.
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  run = subprocess.run([sys.executable, *command], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=1200,
                       check=False)
  assert run.returncode == 0, run.stderr[-4000:]
  return run.stdout


def _compile(out: pathlib.Path, *args: str) -> dict:
  """Runs `tpu_programs.py out args` and returns its report."""
  _run([str(HERE / 'tpu_programs.py'), str(out), *args], HERE)
  return json.loads(out.read_text())


def _problems(key: str, program: dict, meshes: dict, batch: int
              ) -> list[str]:
  """What is wrong with one compiled program's figures."""
  if 'error' in program:
    return [f'{key}: does not compile: {program["error"][:600]}']
  data, model = meshes[key.split('/')[2]]
  problems = []
  memory = program['memory']
  for name, value in (('flops', program['flops']),
                      ('bytes accessed', program['bytes_accessed']),
                      ('argument bytes', memory['argument']),
                      ('output bytes', memory['output']),
                      ('code bytes', memory['generated_code'])):
    if not value or value <= 0:
      problems.append(f'{key}: no {name} ({value})')
  if memory['temp'] < 0:
    problems.append(f'{key}: temporaries {memory["temp"]}')
  if program['host_callbacks']:
    problems.append(f'{key}: host callbacks {program["host_callbacks"][:4]}')
  used = [a for a in program['arguments'] if not a['pruned']]
  # A chip holds each argument's shard, its minor dimensions padded to the
  # layout's tile.
  tiled = sum(int(np.prod(a['tiled'])) * a['itemsize'] for a in used)
  if tiled != memory['argument']:
    problems.append(f'{key}: argument bytes {memory["argument"]}'
                    f' a chip, the shards hold {tiled}')
  split = 0
  for a in used:
    if a['axes'] is not None:  # a parameter: split by its logical axes
      want = [n // model if axis in MODEL_AXES else n
              for n, axis in zip(a['shape'], a['axes'])]
      split += want != a['shape']
    elif a['path'].startswith(('[1]', '[2]')):  # the batch
      want = [batch // data] + a['shape'][1:]
    else:
      continue
    if a['shard'] != want:
      problems.append(f'{key}: {a["path"]} {a["shape"]} axes {a["axes"]}: '
                      f'a chip holds {a["shard"]}, not {want}')
  if model > 1 and not split:
    problems.append(f'{key}: no parameter split over the model axis')
  return problems


@needs_libtpu
def test_every_method_compiles_for_a_tpu_slice(tmp_path):
  report = _compile(tmp_path / 'tpu_programs.json')
  controls = report['controls']
  # The references: a program with a host callback shows one; the network
  # checking its own task ids in the step (a partitioned callback) does not
  # compile on a split batch, so the steps must get checked batches.
  assert controls['callback_found']
  assert 'Partitioned callback not implemented on tpu' in (
      controls['in_graph_check_error'] or '')
  # Compiled for a TPU slice, 'auto' picks the TPU's forms, not the CPU's
  # (the host's backend).
  assert controls['auto_forms'] == {'platform': 'tpu',
                                    'gradient_form': 'autodiff',
                                    'packed_form': 'pallas',
                                    'adapter_form': 'pallas',
                                    'prompt_form': 'all_tasks'}

  import tpu_programs  # pylint: disable=g-import-not-at-top
  programs = report['programs']
  assert sorted(programs) == sorted(
      f'{name}/{kind}/{mesh}' for name, kind, mesh in tpu_programs.programs())
  problems = []
  for key, program in programs.items():
    problems += _problems(key, program, report['meshes'], report['batch'])
  assert not problems, '\n'.join(problems)
  # Every feature of a packed training batch is an argument of the step.
  step = programs['mtl/train/data4']['arguments']
  assert {a['path'] for a in step if a['path'].startswith('[1]')} == {
      f"[1]['{name}']" for name in inputs.PACKED_MODEL_FEATURES}


@needs_libtpu
def test_t5x_steps_compile_through_t5x_partitioner(tmp_path):
  """t5x's train, eval and predict steps of the adapter, partitioned by
  t5x's own `PjitPartitioner` over the slice with the batch split four
  ways, compile and hold no host callback: the default feature converter
  checks the task ids on the host. With a converter that does not, the
  network's in-graph check stays in the step, and the TPU compiler refuses
  it (the failure a t5x run on a TPU pod met at its first step)."""
  pytest.importorskip('t5x')
  programs = _compile(tmp_path / 't5x_programs.json', '--t5x')['t5x']
  assert 'Partitioned callback not implemented on tpu' in (
      programs.pop('unchecked/train/data4').get('error', ''))
  import tpu_programs  # pylint: disable=g-import-not-at-top
  assert sorted(programs) == sorted(
      [f'{name}/{kind}/data4' for name in tpu_programs.T5X_MODELS
       for kind in ('train', 'eval')] +
      [f'{name}/predict/data4' for name in tpu_programs.T5X_PREDICTED])
  for key, program in programs.items():
    assert 'error' not in program, (key, program.get('error', '')[:600])
    assert program['flops'] > 0 and program['memory']['argument'] > 0, key
    assert not program['host_callbacks'], (key, program['host_callbacks'])


@needs_libtpu
def test_mtl_costs_what_t5x_network_costs_on_a_tpu(tmp_path):
  """MTL's training step against t5x's own `examples/t5` network (the same
  loss and update, T5.1.1-small, batch 32 split over `v5e:2x2`): FLOPs,
  bytes accessed and temporaries a chip each within 2%."""
  pytest.importorskip('t5x')
  report = _compile(tmp_path / 'vs_t5x.json', '--vs_t5x')['vs_t5x']
  mtl, t5x = report['mtl'], report['t5x']
  for figure in (('flops',), ('bytes_accessed',), ('memory', 'temp'),
                 ('memory', 'argument')):
    ours, theirs = mtl, t5x
    for key in figure:
      ours, theirs = ours[key], theirs[key]
    assert ours <= 1.02 * theirs, (figure, ours / theirs)
  assert not mtl['host_callbacks'] and not mtl['scatters']


@needs_libtpu
def test_the_compile_command_compiles_a_run_as_it_would_train(tmp_path):
  """`benchmark --tpu_compile` of a gin run: the mesh, microbatches and
  rows are the run's, and both programs are there with their figures."""
  out = tmp_path / 'tpu.json'
  printed = _run(['-m', 'hyperprompt_jax.benchmark', '--tpu_compile',
                  '--topology=v5e:2x2', '--gin_file=runs/quickstart.gin',
                  '--gin.MESH_MODEL=2', '--gin.NUM_MICROBATCHES=2',
                  f'--output_json={out}'], tmp_path)
  report = json.loads(out.read_text())
  assert (report['devices'], report['hbm_bytes']) == (4, 16 * 2**30)
  [setup] = report['setups']
  assert setup['mesh'] == {'data': 2, 'model': 2}
  assert setup['num_microbatches'] == 2 and setup['batch_size'] == 32
  assert setup['label'] == 'MESH_MODEL=2, NUM_MICROBATCHES=2, unpacked'
  train, decode = setup['programs']['train'], setup['programs']['decode']
  for program in (train, decode):
    memory = program['memory']
    assert memory['total'] == (memory['argument'] + memory['output']
                               + memory['temp'] - memory['alias'])
    assert program['fits'] and not program['host_callbacks']
  # The donated state comes back in place; the decode donates nothing.
  assert train['memory']['alias'] > 0 and decode['memory']['alias'] == 0
  # Split parameters and batch: the gradients are summed across chips.
  assert train['collectives']['all-reduce']['count'] > 0
  assert 0.5 < train['flops_over_6nd'] < 10
  # The unpacked run's batch: its task ids, one per row.
  batch = {a['path'] for a in train['arguments'] if a['path'][:3] == '[1]'}
  assert "[1]['task_ids']" in batch and len(batch) == 5
  assert 'quickstart [MESH_MODEL=2, NUM_MICROBATCHES=2, unpacked]' in printed


# An optimized module's lines as XLA prints them (shortened), with what
# `hlo_summary` must find in them, counted by hand.
_HLO = """\
%fused_computation.1 (param_0: f32[768]) -> f32[768] {
  %param_0 = f32[768]{0} parameter(0)
  ROOT %negate.9 = f32[768]{0} negate(%param_0)
}

ENTRY %main {
  %x = f32[768]{0} parameter(0)
  %fusion.1 = f32[768]{0} fusion(%x), kind=kLoop, calls=%fused_computation.1
  %all-reduce.1 = f32[768]{0} all-reduce(f32[768]{0} %x), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %ag-start = (bf16[4,1024]{1,0}, bf16[8,1024]{1,0}) all-gather-start(bf16[4,1024]{1,0} %y), dimensions={0}
  %ag-done = bf16[8,1024]{1,0} all-gather-done(%ag-start)
  %scatter.3 = f32[32128,768]{1,0:T(8,128)} scatter(%a, %i, %u), metadata={op_name="jit(step)/scatter-add" source_file="/x/layers.py" source_line=12}
  %gather.2 = bf16[8,16]{1,0} gather(%t, %i), offset_dims={1}
  %while.1 = (s32[], /*index=1*/f32[2]{0}) while(%tuple), condition=%c, body=%b
  ROOT %cc = f32[] custom-call(%z), custom_call_target="xla_python_cpu_callback"
}
"""


def test_hlo_summary_counts_by_hand():
  from hyperprompt_jax.benchmarks import tpu_compile  # pylint: disable=g-import-not-at-top
  summary = tpu_compile.hlo_summary(_HLO)
  assert summary['collectives'] == {
      'all-reduce': {'count': 1, 'bytes': 768 * 4},
      'all-gather': {'count': 1, 'bytes': (4 + 8) * 1024 * 2}}
  assert (summary['scatters'], summary['gathers'], summary['loops']) == (
      1, 1, 1)
  assert summary['large_scatters'] == [{
      'shape': 'f32[32128,768]', 'bytes': 32128 * 768 * 4,
      'from': 'jit(step)/scatter-add (layers.py:12)'}]
  assert summary['large_gathers'] == []  # 256 bytes
  assert summary['host_callbacks'] == ['xla_python_cpu_callback']
  # What the chip schedules, by the bytes of its result and operands; the
  # instructions inside the fusion are the fusion's.
  largest = {r['op']: r['bytes'] for r in summary['largest']}
  assert summary['largest'][0]['op'] == 'scatter'
  assert largest['fusion'] == largest['all-reduce'] == 768 * 4 * 2
  assert 'negate' not in largest and 'parameter' not in largest


def test_hbm_is_the_chips_over_its_devices():
  from hyperprompt_jax.benchmarks import tpu_compile  # pylint: disable=g-import-not-at-top

  class Device:
    def __init__(self, kind, coords):
      self.device_kind, self.coords = kind, coords

  gib = 2**30
  # TPU v3 shows each chip's two cores as devices: 16 GiB each.
  v3 = [Device('TPU v3', (x, 0, 0)) for x in (0, 0, 1, 1)]
  assert tpu_compile.device_hbm_bytes(v3) == 16 * gib
  v5e = [Device('TPU v5 lite', (x, y, 0)) for x in (0, 1) for y in (0, 1)]
  assert tpu_compile.device_hbm_bytes(v5e) == 16 * gib
  assert tpu_compile.device_hbm_bytes([Device('TPU v5', (0, 0, 0))]) == (
      95 * gib)
  assert tpu_compile.device_hbm_bytes([Device('cpu', (0,))]) is None


_HOST_ROWS = '''
from hyperprompt_jax.benchmarks import tpu_compile
from hyperprompt_jax.runner import multihost, partitioning
devices = tpu_compile.topology_devices('v5e:4x4')  # 4 hosts of 4 chips
for model in (1, 2):
  mesh = partitioning.create_mesh(-1, model, devices=devices)
  layout = multihost.data_layout(mesh)
  print('RESULT', model, layout.num_shards, sorted(layout.shard_of_process))
'''


@needs_libtpu
def test_a_multihost_slice_gives_each_host_its_own_rows(tmp_path):
  """On `v5e:4x4` (4 hosts) JAX's torus order interleaves the hosts along
  'data'; the runner's mesh keeps each host's devices in one run of rows, so
  every process reads a data shard of its own (`multihost.data_layout`
  raised for MESH_MODEL=1 before)."""
  printed = _run(['-c', _HOST_ROWS], tmp_path)
  assert [l for l in printed.splitlines() if l.startswith('RESULT')] == [
      'RESULT 1 4 [0, 1, 2, 3]', 'RESULT 2 4 [0, 1, 2, 3]']


_SPLIT_AXIS = '''
import numpy as np
from hyperprompt_jax.benchmarks import tpu_compile
from hyperprompt_jax.runner import partitioning
devices = tpu_compile.topology_devices('v5p:4x4x4')  # 4 x 4 x 4 chips
mesh = partitioning.create_mesh(-1, 8, devices=devices)
coords = np.array([d.coords for d in mesh.devices.flat]).reshape(8, 8, 3)
print('RESULT', dict(mesh.shape), len({d.id for d in mesh.devices.flat}),
      max(len({tuple(c) for c in group}) for group in coords),
      max(int(np.ptp(group, axis=0).sum()) for group in coords))
'''


@needs_libtpu
def test_a_model_axis_that_splits_a_physical_axis(tmp_path):
  """MESH_MODEL=8 on `v5p:4x4x4`: no product of whole physical axes is 8,
  where `jax.make_mesh` refuses; the mesh splits one (64 distinct chips,
  each model group 8 chips within a 2 x 4 plane: coordinate spans sum to
  at most 1 + 3)."""
  printed = _run(['-c', _SPLIT_AXIS], tmp_path)
  assert [l for l in printed.splitlines() if l.startswith('RESULT')] == [
      "RESULT {'data': 8, 'model': 8} 64 8 4"]
