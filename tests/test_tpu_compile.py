"""Every method's training step and decode compile for a TPU slice.

The TPU compiler runs here without a TPU (libtpu, from the `[test]` and
`[tpu]` extras, and `jax.experimental.topologies`): `tpu_programs.py`
compiles, for `v5e:2x2`, the built-in runner's training step and the
evaluator's decode of the tiny model of every method, the batch split over
'data' (and the parameters over a 'model' axis of 2); and t5x's train, eval
and predict steps through t5x's partitioner (skipped without t5x). Each
test compiles in one subprocess (the methods' programs in three parts,
tests that pytest-xdist's workers run side by side). libtpu allows one
process at a time on a machine (`/tmp/libtpu_lockfile`) unless
`ALLOW_MULTIPLE_LIBTPU_LOAD=1`: these processes set it, since they only
compile (no TPU is opened), so pytest-xdist's workers, or another
checkout's suite, may compile at once."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from hyperprompt_jax.t5 import inputs

import conftest

needs_libtpu = conftest.needs_libtpu

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


# `tpu_programs.PARTS`, one test each.
PARTS = ('mtl_hyperprompt', 'hypergrid', 'gates_adapters_prompts')


def test_the_parts_hold_every_model_once():
  """`test_every_method_compiles_for_a_tpu_slice` compiles the models in
  parts (`tpu_programs.PARTS`): together, every model of `MODELS`, once."""
  import tpu_programs  # pylint: disable=g-import-not-at-top
  assert sorted(tpu_programs.PARTS) == sorted(PARTS)
  parts = [name for part in tpu_programs.PARTS.values() for name in part]
  assert sorted(parts) == sorted(tpu_programs.MODELS)
  assert 'mtl' in tpu_programs.PARTS[tpu_programs.CONTROLS_PART]


@needs_libtpu
@pytest.mark.parametrize('part', PARTS)
def test_every_method_compiles_for_a_tpu_slice(tmp_path, part):
  """Each part of the models (`tpu_programs.PARTS`, together every method:
  `test_the_parts_hold_every_model_once`) in a process of its own."""
  import tpu_programs  # pylint: disable=g-import-not-at-top
  report = _compile(tmp_path / 'tpu_programs.json', f'--part={part}')
  if part == tpu_programs.CONTROLS_PART:
    controls = report['controls']
    # The references: a program with a host callback shows one; the network
    # checking its own task ids in the step compiles on a split batch too
    # (on a TPU, a callback of the first device:
    # `conditioning._call_on_host`).
    assert controls['callback_found']
    assert controls['in_graph_check_error'] is None
    # Compiled for a TPU slice, 'auto' picks the TPU's forms, not the CPU's
    # (the host's backend).
    assert controls['auto_forms'] == {'platform': 'tpu',
                                      'gradient_form': 'autodiff',
                                      'packed_form': 'pallas',
                                      'adapter_form': 'pallas',
                                      'prompt_form': 'all_tasks'}
  else:
    assert 'controls' not in report

  programs = report['programs']
  assert sorted(programs) == sorted(
      f'{name}/{kind}/{mesh}' for name, kind, mesh in tpu_programs.programs(
          tpu_programs.PARTS[part]))
  problems = []
  for key, program in programs.items():
    problems += _problems(key, program, report['meshes'], report['batch'])
  assert not problems, '\n'.join(problems)
  if 'mtl' in tpu_programs.PARTS[part]:
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
  network's in-graph check stays in the step, which compiles with its host
  callback (a partitioned one, refused on a TPU, once failed a t5x run on a
  TPU pod at its first step)."""
  pytest.importorskip('t5x')
  programs = _compile(tmp_path / 't5x_programs.json', '--t5x')['t5x']
  unchecked = programs.pop('unchecked/train/data4')
  assert 'error' not in unchecked, unchecked['error'][:600]
  assert unchecked['host_callbacks']
  import tpu_programs  # pylint: disable=g-import-not-at-top
  assert sorted(programs) == sorted(
      [f'{name}/{kind}/data4' for name in tpu_programs.T5X_VARIANTS
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
  """`python -m hyperprompt_jax.compile` of a built-in run file: the
  mesh, microbatches and rows are its RunSettings', and both programs are
  there with their figures (one layer a stack: none of them depends on the
  depth)."""
  out = tmp_path / 'tpu.json'
  printed = _run(['-m', 'hyperprompt_jax.compile', '--topology=v5e:2x2',
                  '--gin_file=runs/quickstart.gin',
                  '--gin.MESH_MODEL=2', '--gin.NUM_MICROBATCHES=2',
                  '--gin.network.T5Config.num_encoder_layers=1',
                  '--gin.network.T5Config.num_decoder_layers=1',
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
  from hyperprompt_jax.tpu import program_figures  # pylint: disable=g-import-not-at-top
  summary = program_figures.hlo_summary(_HLO)
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
  from hyperprompt_jax.tpu import slices  # pylint: disable=g-import-not-at-top

  class Device:
    def __init__(self, kind, coords):
      self.device_kind, self.coords = kind, coords

  gib = 2**30
  # TPU v3 shows each chip's two cores as devices: 16 GiB each.
  v3 = [Device('TPU v3', (x, 0, 0)) for x in (0, 0, 1, 1)]
  assert slices.device_hbm_bytes(v3) == 16 * gib
  v5e = [Device('TPU v5 lite', (x, y, 0)) for x in (0, 1) for y in (0, 1)]
  assert slices.device_hbm_bytes(v5e) == 16 * gib
  assert slices.device_hbm_bytes([Device('TPU v5', (0, 0, 0))]) == (
      95 * gib)
  assert slices.device_hbm_bytes([Device('cpu', (0,))]) is None


_HOST_ROWS = '''
from hyperprompt_jax.common import multihost, partitioning
from hyperprompt_jax.tpu import slices
devices = slices.topology_devices('v5e:4x4')  # 4 hosts of 4 chips
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
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.tpu import slices
devices = slices.topology_devices('v5p:4x4x4')  # 4 x 4 x 4 chips
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


# gcloud accelerator types and the slices they are, by hand (Cloud TPU's
# pages: v2 / v3 / v4 / v5p count TensorCores, two a chip; v5e and v6e
# count chips): (topology name, chips).
SLICE_NAMES = {
    'v2-8': ('v2:2x2', 4), 'v2-32': ('v2:4x4', 16),
    'v3-8': ('v3:2x2', 4), 'v3-32': ('v3:4x4', 16), 'v3-64': ('v3:4x8', 32),
    'v3-128': ('v3:8x8', 64), 'v3-256': ('v3:8x16', 128),
    'v3-512': ('v3:16x16', 256), 'v3-2048': ('v3:32x32', 1024),
    'v4-8': ('v4:2x2x1', 4), 'v4-16': ('v4:2x2x2', 8),
    'v4-32': ('v4:2x2x4', 16), 'v4-64': ('v4:2x4x4', 32),
    'v4-128': ('v4:4x4x4', 64), 'v4-256': ('v4:4x4x8', 128),
    'v4-512': ('v4:4x8x8', 256), 'v4-1024': ('v4:8x8x8', 512),
    'v5p-8': ('v5p:2x2x1', 4), 'v5p-128': ('v5p:4x4x4', 64),
    'v5litepod-1': ('v5e:1x1', 1), 'v5litepod-4': ('v5e:2x2', 4),
    'v5e-8': ('v5e:2x4', 8), 'v5e-16': ('v5e:4x4', 16),
    'v5e-32': ('v5e:4x8', 32), 'v5e-64': ('v5e:8x8', 64),
    'v5e-128': ('v5e:8x16', 128), 'v5e-256': ('v5e:16x16', 256),
    'v6e-1': ('v6e:1x1', 1), 'v6e-4': ('v6e:2x2', 4),
    'v6e-256': ('v6e:16x16', 256),
    # Topology names are kept as given.
    'v3:4x4': ('v3:4x4', 16), 'v5p:4x4x8': ('v5p:4x4x8', 128),
}


@pytest.mark.parametrize('name', sorted(SLICE_NAMES))
def test_slice_names_as_users_write_them(name):
  from hyperprompt_jax.tpu import slices  # pylint: disable=g-import-not-at-top
  tpu_slice = slices.parse_slice(name)
  assert (tpu_slice.topology, tpu_slice.chips) == SLICE_NAMES[name]
  assert tpu_slice.given == name
  # A one-chip host: libtpu's default host bounds are 2x2; a v4 chip is
  # one megacore device, as a v4 pod runs.
  options = dict(tpu_slice.options)
  assert ('chips_per_host_bounds' in options) == (tpu_slice.chips == 1)
  assert (options.get('chip_config_name') == 'megacore') == (
      tpu_slice.topology.startswith('v4'))


@pytest.mark.parametrize('name', ['v3-16', 'v5e-2', 'v4-6', 'v7-8', 'v3',
                                  'v3:4', 'tpu-v3-32', ''])
def test_unknown_slice_names_name_the_accepted_forms(name):
  from hyperprompt_jax.tpu import slices  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r'--topology=.*(v3-32|:AxB)'):
    slices.parse_slice(name)


class _Device:
  def __init__(self, kind, coords, process_index=0):
    self.device_kind, self.coords = kind, coords
    self.process_index = process_index


def test_v3_reports_a_chip_as_twice_a_tensorcore():
  """A v3 chip shows its two TensorCores as devices: the header says so,
  and a program's memory per chip is twice a device's, against twice a
  device's HBM."""
  from hyperprompt_jax.benchmarks import tpu_compile  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.tpu import program_figures  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.tpu import slices  # pylint: disable=g-import-not-at-top
  gib = 2**30
  v3 = [_Device('TPU v3', (x, y, 0)) for x in (0, 1) for y in (0, 1)
        for _ in range(2)]  # v3-8: 4 chips, 8 devices
  assert slices.devices_per_chip(v3) == 2
  header = slices.slice_header('v3-8', v3)
  assert header == {
      'given': 'v3-8', 'topology': 'v3:2x2', 'chips': 4, 'devices': 8,
      'devices_per_chip': 2, 'device_kind': 'TPU v3',
      'hbm_bytes_per_device': 16 * gib, 'hbm_bytes_per_chip': 32 * gib}
  line = tpu_compile.format_slice(header)
  assert line.startswith('v3-8 = v3:2x2: 4 chips, 8 devices (2 TensorCores')
  assert '16.0 GiB HBM per device (TensorCore), 32.0 GiB per chip' in line
  memory = {'argument': 3 * gib, 'output': 2 * gib, 'temp': 5 * gib,
            'alias': 2 * gib, 'generated_code': 1}
  memory['total'] = 8 * gib
  program = {'memory': memory, 'hbm_bytes': 16 * gib, 'fits': True,
             'flops': 1e12, 'bytes_accessed': 1e9, 'scatters': 0,
             'gathers': 0, 'loops': 0, 'collectives': {},
             'host_callbacks': [], 'compile_s': 1.0}
  chip = program_figures.per_chip(program, 2)
  assert chip == {'devices': 2, 'argument': 6 * gib, 'output': 4 * gib,
                  'temp': 10 * gib, 'alias': 4 * gib, 'total': 16 * gib,
                  'hbm_bytes': 32 * gib}
  program['per_chip'] = chip
  printed = tpu_compile.format_program('setup', 'train', program)
  assert '8.00 GiB of 16 GiB (fits) per device (TensorCore)' in printed
  assert 'per chip (2 TensorCores) 16.00 GiB of 32 GiB' in printed
  # One device a chip (v5e): no per-chip figures, the header says so.
  v5e = [_Device('TPU v5 lite', (x, y, 0)) for x in (0, 1) for y in (0, 1)]
  header = slices.slice_header('v5litepod-4', v5e)
  assert (header['chips'], header['devices_per_chip']) == (4, 1)
  assert '(one a chip)' in tpu_compile.format_slice(header)


def test_t5x_run_files_are_told_from_built_in_ones():
  from hyperprompt_jax.benchmarks import tpu_compile  # pylint: disable=g-import-not-at-top
  assert tpu_compile.t5x_script(['t5x/quickstart_train.gin']) == 'train'
  assert tpu_compile.t5x_script(
      ['t5x/hypergrid_lg_glue_super_glue.gin']) == 'train'
  assert tpu_compile.t5x_script(['t5x/eval.gin']) == 'eval'
  assert tpu_compile.t5x_script(['runs/quickstart.gin']) is None
  assert tpu_compile.t5x_script(['models/t5_1_1_small.gin']) is None


def test_a_t5x_run_without_t5x_names_the_built_in_run(monkeypatch):
  """Where t5x is not installed, a t5x run file stops the compile command
  with the built-in runner's run file of the same setup."""
  import argparse  # pylint: disable=g-import-not-at-top
  import importlib.util as util  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.benchmarks import tpu_compile  # pylint: disable=g-import-not-at-top
  find_spec = util.find_spec
  monkeypatch.setattr(util, 'find_spec', lambda name, *a: (
      None if name == 't5x' else find_spec(name, *a)))
  for run, builtin in (('hypergrid_lg_glue_super_glue',
                        'hypergrid_lg_glue_super_glue'),
                       ('quickstart_train', 'quickstart')):
    args = argparse.Namespace(gin_file=[f't5x/{run}.gin'])
    with pytest.raises(ValueError, match=(
        rf't5x is not installed.*--gin_file=runs/{builtin}\.gin')):
      tpu_compile.check_t5x_run(args, [])


@needs_libtpu
def test_slice_names_give_libtpu_s_devices(tmp_path):
  """A few mappings against the devices libtpu gives (no compile)."""
  printed = _run(['-c', '''
from hyperprompt_jax.tpu import slices
for name in ('v3-32', 'v4-16', 'v5p-8', 'v5litepod-1', 'v6e-4', 'v3:2x2',
             'v4:2x2x1'):
  devices = slices.topology_devices(name)
  print('RESULT', name, len(devices), slices.devices_per_chip(devices))
'''], tmp_path)
  assert [l for l in printed.splitlines() if l.startswith('RESULT')] == [
      'RESULT v3-32 32 2', 'RESULT v4-16 8 1', 'RESULT v5p-8 4 1',
      'RESULT v5litepod-1 1 1', 'RESULT v6e-4 4 1', 'RESULT v3:2x2 8 2',
      'RESULT v4:2x2x1 4 1']


def _parameters_split(program: dict) -> int:
  """The train state's arguments a device holds a part of."""
  return sum(1 for a in program['arguments'] if not a['pruned']
             and a['path'].startswith('[0]') and a['shard'] != a['shape'])


@needs_libtpu
def test_a_t5x_run_compiles_with_its_model_axis(tmp_path):
  """t5x's quickstart run file (one layer a stack) through the compile
  command's t5x path: on `v5e-4` t5x has no default mesh for a
  `num_partitions`, and the error names the submesh binding; with the
  submesh (1, 1, 1, 1) / (1, 2, 1, 1) the model axis is 1 / 2, the
  parameters split over it and each device holds fewer argument bytes;
  on `v3-8` `num_partitions=2` takes t5x's own table (a chip's two cores),
  a chip holding twice a device. Train, eval and predict compile, with
  FLOPs, within HBM, with no host callback."""
  pytest.importorskip('t5x')
  import tpu_programs  # pylint: disable=g-import-not-at-top
  runs = _compile(tmp_path / 't5x_run.json', '--t5x_run')['t5x_run']
  assert sorted(runs) == sorted(tpu_programs.T5X_RUNS)
  error = runs.pop('v5e-4/num_partitions1')['error']
  assert "no mesh for TPU v5 lite" in error
  assert 'model_parallel_submesh=' in error and 'MESH_MODEL=None' in error
  meshes = {'v5e-4/submesh1': {'data': 4, 'model': 1},
            'v5e-4/submesh2': {'data': 2, 'model': 2},
            'v3-8/num_partitions2': {'data': 4, 'model': 2}}
  for key, report in runs.items():
    assert 'error' not in report, (key, report['error'])
    assert report['mesh'] == meshes[key], key
    assert report['runner'] == 't5x' and report['trainer'] == 'Trainer'
    assert (report['batch_size'], report['pack']) == (8, True)
    assert sorted(report['programs']) == ['eval', 'predict', 'train'], key
    for kind, program in report['programs'].items():
      assert 'error' not in program, (key, kind, program['error'][:600])
      assert program['flops'] > 0 and program['memory']['argument'] > 0
      assert program['fits'] and not program['host_callbacks'], (key, kind)
      memory = program['memory']
      assert memory['total'] == (memory['argument'] + memory['output']
                                 + memory['temp'] - memory['alias'])
      # The batch is split over 'data'.
      batch = [a for a in program['arguments']
               if a['path'].startswith('[1]') and not a['pruned']]
      assert batch and all(a['shard'][0] == a['shape'][0]
                           // meshes[key]['data'] for a in batch), (key, kind)
    train = report['programs']['train']
    assert train['memory']['alias'] > 0  # the state is donated
    assert 0.5 < train['flops_over_6nd'] < 10
  one = runs['v5e-4/submesh1']['programs']
  two = runs['v5e-4/submesh2']['programs']
  assert _parameters_split(one['train']) == 0
  assert _parameters_split(two['train']) > 0
  for kind in ('train', 'eval', 'predict'):
    assert two[kind]['memory']['argument'] < one[kind]['memory']['argument']
  v3 = runs['v3-8/num_partitions2']
  assert v3['slice']['devices_per_chip'] == 2
  assert _parameters_split(v3['programs']['train']) > 0
  for program in v3['programs'].values():
    assert program['per_chip']['total'] == 2 * program['memory']['total']
    assert program['per_chip']['hbm_bytes'] == 32 * 2**30


@needs_libtpu
def test_the_compile_command_takes_a_t5x_run_file(tmp_path):
  """`benchmark --tpu_compile --gin_file=t5x/...` on a gcloud slice name:
  the header names the slice both ways, and t5x's three programs are in
  the JSON; predict compiles where the vocabulary cannot be read (a
  SentencePiece file this host lacks, as T5's on GCS offline), with T5's
  end-of-sequence id, and says so."""
  pytest.importorskip('t5x')
  import tpu_programs  # pylint: disable=g-import-not-at-top
  out = tmp_path / 'tpu.json'
  printed = _run(['-m', 'hyperprompt_jax.benchmark', '--tpu_compile',
                  '--topology=v5litepod-4',
                  '--gin_file=t5x/quickstart_train.gin',
                  *[f'--gin.{b}' for b in tpu_programs.T5X_RUN_BINDINGS],
                  '--gin.MESH_MODEL=None',
                  '--gin.partitioning.PjitPartitioner.model_parallel_submesh'
                  '=(1, 2, 1, 1)', '--eval_batch_size=4',
                  '--gin.VOCABULARY=@features.GinSentencePieceVocabulary()',
                  "--gin.features.sentencepiece_model_file.path="
                  f"'{tmp_path / 'absent.model'}'",
                  f'--output_json={out}'], tmp_path)
  report = json.loads(out.read_text())
  assert report['slice']['given'] == 'v5litepod-4'
  assert (report['topology'], report['slice']['chips']) == ('v5e:2x2', 4)
  [setup] = report['setups']
  assert setup['mesh'] == {'data': 2, 'model': 2}
  assert setup['predict_batch_size'] == 4
  assert setup['predict_eos_id'].startswith('1, a stand-in')
  assert 'absent.model' in setup['predict_eos_id']
  assert 'the figures do not depend on it' in printed
  assert setup['label'] == 'model_parallel_submesh=(1, 2, 1, 1)'
  for kind in ('train', 'eval', 'predict'):
    assert setup['programs'][kind]['flops'] > 0, kind
    assert f'quickstart_train {kind}: ' in printed
  assert 'v5litepod-4 = v5e:2x2: 4 chips, 4 devices (one a chip)' in printed


_HYPERGRID_FORMS_FOR_A_SLICE = '''
import jax, jax.numpy as jnp
from flax.linen import partitioning as nn_partitioning
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.runner import partitioning
from hyperprompt_jax.tpu import slices
mesh = partitioning.create_mesh(devices=slices.topology_devices(TOPOLOGY))
split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

def step(form, segments):
  def loss(x, kernel, grid, segment_ids):
    return hypergrid.packed_gated_matmul(
        x, kernel, grid, segment_ids, form=form,
        kernel_axes=('mlp', 'embed')).astype(jnp.float32).sum()
  args = (jax.ShapeDtypeStruct((40, 8, 64), jnp.bfloat16, sharding=split),
          jax.ShapeDtypeStruct((64, 32), jnp.bfloat16, sharding=whole),
          jax.ShapeDtypeStruct((40, segments, 8, 4), jnp.float32,
                               sharding=split),
          jax.ShapeDtypeStruct((40, 8), jnp.int32, sharding=split))
  try:
    jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(*args).compile()
    return 'compiles'
  except Exception as e:  # pylint: disable=broad-except
    return str(e).splitlines()[0][:400]

with jax.set_mesh(mesh), nn_partitioning.axis_rules(
    partitioning.logical_axis_rules()):
  print('RESULT auto', hypergrid.resolve_packed_form('auto'))
  for form in ('grouped', 'pallas', 'blockwise'):
    print('RESULT', form, step(form, 31))
  print('RESULT grouped_128', step('grouped', 128))
'''


@needs_libtpu
@pytest.mark.parametrize('topology', ['v5e:2x2', 'v3:2x2'])
def test_every_hypergrid_packed_form_compiles_for_a_tpu_slice(tmp_path,
                                                               topology):
  """HyperGrid's gated matmul and its gradients in each packed form,
  compiled for a slice with the batch split over its chips (40 rows of 32
  segments: 320 groups a v5e chip, 160 a v3 TensorCore). One ragged matmul
  of a shard's 160 or 320 groups crashed the TPU compiler ("Bitcast cannot
  have different shape sizes"); 'grouped' takes its rows a few at a time,
  and refuses, by name, the rows of over 127 segments it cannot split."""
  printed = _run(['-c', f'TOPOLOGY = {topology!r}\n'
                  + _HYPERGRID_FORMS_FOR_A_SLICE], tmp_path)
  results = dict(l.split(' ', 2)[1:] for l in printed.splitlines()
                 if l.startswith('RESULT '))
  assert results.pop('auto') == 'pallas'
  refused = results.pop('grouped_128')
  assert results == dict.fromkeys(('grouped', 'pallas', 'blockwise'),
                                  'compiles')
  assert ("packed_form='grouped' takes at most 127 segments a row on a TPU"
          in refused and 'MAX_SEGMENTS=128' in refused
          and "'pallas' or 'blockwise'" in refused), refused
