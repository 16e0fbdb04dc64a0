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

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec('libtpu') is None,
    reason="libtpu is not installed (pip install -e '.[tpu]')")

HERE = pathlib.Path(__file__).parent
# The logical axes t5x's standard rules split over 'model'
# (t5x.partitioning.standard_logical_axis_rules); every other axis of a
# parameter is replicated.
MODEL_AXES = {'vocab', 'mlp', 'heads', 'joined_kv'}


def _compile(out: pathlib.Path, *args: str) -> dict:
  """Runs `tpu_programs.py out args` and returns its report."""
  env = dict(os.environ, TPU_SKIP_MDS_QUERY='1',
             ALLOW_MULTIPLE_LIBTPU_LOAD='1')
  # TPU programs stay out of the session's cache of CPU programs.
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  run = subprocess.run(
      [sys.executable, str(HERE / 'tpu_programs.py'), str(out), *args],
      cwd=HERE, env=env, capture_output=True, text=True, timeout=1200,
      check=False)
  assert run.returncode == 0, run.stderr[-4000:]
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
                      ('argument bytes', memory['argument_size_in_bytes']),
                      ('output bytes', memory['output_size_in_bytes']),
                      ('code bytes', memory['generated_code_size_in_bytes'])):
    if not value or value <= 0:
      problems.append(f'{key}: no {name} ({value})')
  if memory['temp_size_in_bytes'] < 0:
    problems.append(f'{key}: temporaries {memory["temp_size_in_bytes"]}')
  if program['host_callbacks']:
    problems.append(f'{key}: host callbacks {program["host_callbacks"][:4]}')
  used = [a for a in program['arguments'] if not a['pruned']]
  # A chip holds each argument's shard, its minor dimensions padded to the
  # layout's tile.
  tiled = sum(int(np.prod(a['tiled'])) * a['itemsize'] for a in used)
  if tiled != memory['argument_size_in_bytes']:
    problems.append(f'{key}: argument bytes {memory["argument_size_in_bytes"]}'
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


def test_every_method_compiles_for_a_tpu_slice(tmp_path):
  report = _compile(tmp_path / 'tpu_programs.json')
  controls = report['controls']
  # The references: a program with a host callback shows one; the network
  # checking its own task ids in the step (a partitioned callback) does not
  # compile on a split batch, so the steps must get checked batches.
  assert controls['callback_found']
  assert 'Partitioned callback not implemented on tpu' in (
      controls['in_graph_check_error'] or '')

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
    assert program['flops'] > 0 and program['argument_bytes'] > 0, key
    assert not program['host_callbacks'], (key, program['host_callbacks'])
