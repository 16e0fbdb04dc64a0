"""Several hosts: real JAX processes on localhost (2 processes x 2 CPU
devices, gloo collectives), started as a cluster starts them, against one
process fed the same data; plus the data layout and the resume rule on their
own.

The runs that several tests read are made once per session, whichever
xdist worker needs them first (`multiprocess.made_once`), by three
processes that each run several commands in sequence (`cluster_runs`: train,
then eval and infer of the run, as a user runs them); a resume, a refusal
and a restart start fresh processes. Every process is bounded by a
timeout.
"""

import json
import os
import re
import shutil
import signal
import time
import types

import gin
import numpy as np
import pytest

from hyperprompt_jax.checkpointing import checkpoint_manager
from hyperprompt_jax.checkpointing import checkpoints
from hyperprompt_jax.checkpointing import run_record
from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.common import multihost
from hyperprompt_jax.model import network
from hyperprompt_jax.runner import run_lock

import conftest
import multiprocess

TRAIN = 'hyperprompt_jax.train'
# One small task for training, evaluation and inference: what the hosts
# share does not depend on the mixture, and each process builds its input
# pipeline in ~1 s instead of ~10 s for the quickstart's 16 tasks.
ONE_TASK = ["--gin.MIXTURE_OR_TASK_NAME='fixture_glue_rte'"]
# The quickstart's model with one encoder and one decoder layer: what the
# hosts share (data shards, the model axis, checkpoints, the equalities
# between 1 and 2 processes) does not depend on the depth, and each process
# traces and compiles half the layers.
ONE_LAYER = ['--gin.network.T5Config.num_encoder_layers=1',
             '--gin.network.T5Config.num_decoder_layers=1']
# The quickstart, tiny: 4 steps of 8 rows, checkpoints at 2 and 4, no
# evaluation.
QUICK = ['--gin_file=runs/quickstart.gin', '--gin.TRAIN_STEPS=4',
         '--gin.BATCH_SIZE=8', '--gin.SAVE_PERIOD=2', '--gin.LOG_PERIOD=2',
         '--gin.KEEP_CHECKPOINTS=None', '--gin.EVAL_PERIOD=None', *ONE_TASK,
         *ONE_LAYER]
# Evaluation during training at the last step: 16 examples, two batches.
EVAL_DURING = ['--gin.EVAL_PERIOD=4', '--gin.EVAL_EXAMPLES_PER_TASK=16',
               '--gin.EVAL_BATCH_SIZE=8']


def _model_dir(path) -> str:
  return f'--gin.MODEL_DIR="{path}"'


def _params(checkpoint) -> dict[str, np.ndarray]:
  return checkpoints.load_t5x_params(str(checkpoint))


def _assert_same_run(got, want, steps=4) -> None:
  """The parameters of two runs of `steps` QUICK steps whose sums differ in
  order only, per tensor and norm-wise: each step's Adafactor update within
  3 g of its size (g the gradient's `conftest.float32_bound`; the root of
  its second moments and the clipping's RMS: `test_microbatches`), an
  update's norm at most lr * max(1e-3, RMS(θ)) * sqrt(n) (its RMS clipped
  to 1; θ's norm grows by at most lr of itself a step), and each step's
  sum rounded once."""
  files = [a.split('=', 1)[1] for a in QUICK if a.startswith('--gin_file=')]
  bindings = [a[len('--gin.'):] for a in QUICK if a.startswith('--gin.')]
  try:
    gin_utils.parse_gin(files, bindings)
    cfg = gin.get_configurable(network.Transformer)().config
    macro = lambda name: gin.query_parameter(f'{name}/macro.value')
    lengths, batch = macro('TASK_FEATURE_LENGTHS'), macro('BATCH_SIZE')
    lr = macro('LEARNING_RATE')
  finally:
    gin.clear_config()
  prompts = cfg.hyperprompt
  g = conftest.float32_bound(*conftest.t5_reduction_lengths(
      cfg, batch, lengths['inputs'], lengths['targets'],
      prompts.encoder_prompt_length, prompts.decoder_prompt_length))
  assert sorted(got) == sorted(want)
  for k, w in want.items():
    size = np.linalg.norm(w)
    update = lr * max(1e-3 * np.sqrt(w.size), size / (1 - steps * lr))
    limit = 3 * g * steps * update + conftest.float32_bound(steps) * size
    error = np.linalg.norm(got[k].astype(np.float64) - w)
    assert error <= limit, (k, error, limit)


EVAL = 'hyperprompt_jax.eval'
INFER = 'hyperprompt_jax.infer'


def _eval_args(run, out) -> list[str]:
  """eval of every checkpoint of `run` into `out`."""
  return ['--gin_file=runs/quickstart_eval.gin', *ONE_TASK, *ONE_LAYER,
          f'--gin.CHECKPOINT_PATH="{run}"', '--gin.EVAL_BATCH_SIZE=8',
          f'--gin.EVAL_OUTPUT_DIR="{out}"']


def _infer_args(run, out) -> list[str]:
  """infer of `run`'s checkpoint_4 into `out`."""
  return ['--gin_file=runs/quickstart_infer.gin', *ONE_TASK, *ONE_LAYER,
          f'--gin.CHECKPOINT_PATH="{run}/checkpoint_4"',
          '--gin.INFER_BATCH_SIZE=8', f'--gin.INFER_OUTPUT_DIR="{out}"']


@pytest.fixture(scope='session')
def cluster_runs(tmp_path_factory):
  """The runs the real-process tests read, made once per session by three
  processes that each run several commands in sequence
  (`multiprocess.start_chain`: a process start costs seconds), at the same
  time:

  - 2 processes x 2 devices, started as a cluster for the first command:
    0. `train`: 4 steps of the quickstart, MESH_MODEL=1 (each process reads
       its data shard), evaluating during training: `run`;
    1. `train`, MESH_MODEL=4 (the model axis spans both): `model_axis_two`;
    2. `eval` of `run`'s checkpoints: `eval2`;
    3. `infer` of `run`'s checkpoint_4: `infer2`;
  - 1 process x 4 devices:
    0. the parameters of the same model fed the global batches of `run`
       (shard 0's rows, then shard 1's): `reference.npz`;
    1. `train`, MESH_MODEL=4: `model_axis_one`;
    2. (once both processes have made `run`) nothing: wait;
    3. `eval` and 4. `infer` of `run`, as 2 and 3 above: `eval1`, `infer1`.

  Returns the folder; the logs: `logs/two-<process>.log`, `logs/one-0.log`.
  """
  def make(root):
    run, axis = root / 'run', QUICK + ['--gin.MESH_MODEL=4']
    two = multiprocess.start_chain([
        (TRAIN, QUICK + [_model_dir(run)] + EVAL_DURING, 0),
        (TRAIN, axis + [_model_dir(root / 'model_axis_two')], 0),
        (EVAL, _eval_args(run, root / 'eval2'), 0),
        (INFER, _infer_args(run, root / 'infer2'), 0),
    ], root / 'logs', name='two')
    one = multiprocess.start_chain([
        ('reference', [str(root / 'reference.npz'), '2', '4', *QUICK], 0),
        (TRAIN, axis + [_model_dir(root / 'model_axis_one')], 0),
        multiprocess.wait_for(two, 0),
        (EVAL, _eval_args(run, root / 'eval1'), 0),
        (INFER, _infer_args(run, root / 'infer1'), 0),
    ], root / 'logs', num_processes=1, devices=4, name='one')
    assert multiprocess.wait(two + one, 600) == [0, 0, 0], (
        multiprocess.outputs(two + one))

  return multiprocess.made_once(tmp_path_factory.getbasetemp(),
                                'cluster_runs', make)


def _log(root, name) -> str:
  return (root / 'logs' / f'{name}.log').read_text(errors='replace')


@pytest.fixture(scope='session')
def two_process_run(cluster_runs):
  """`run` of `cluster_runs` (4 steps of the quickstart as 2 processes x 2
  devices, MESH_MODEL=1) and the reference parameters of 1 process x 4
  devices fed the same global batches: `(run, reference)`."""
  return (cluster_runs / 'run',
          dict(np.load(cluster_runs / 'reference.npz')))


@pytest.fixture(scope='session')
def model_axis_runs(cluster_runs):
  """The quickstart with MESH_MODEL=4 as 2 processes x 2 devices (the model
  axis spans both) and as 1 process x 4 devices: `(two, one)` run
  directories."""
  for i in (0, 1):
    assert 'reads data shard 0 of 1 (8 rows of the global batch of 8)' in (
        multiprocess.command_output(_log(cluster_runs, f'two-{i}'), 1))
  return cluster_runs / 'model_axis_two', cluster_runs / 'model_axis_one'


# -- the data layout ----------------------------------------------------------


def _fake_mesh(processes, devices_per_process, model):
  """A ('data', 'model') mesh of devices that only know their process."""
  devices = np.array([
      types.SimpleNamespace(process_index=p)
      for p in range(processes) for _ in range(devices_per_process)
  ]).reshape(-1, model)
  return types.SimpleNamespace(axis_names=('data', 'model'), devices=devices,
                               shape={'data': devices.shape[0],
                                      'model': model})


@pytest.mark.parametrize('processes,per,model,shards,shard_of_process', [
    (1, 4, 1, 1, (0,)),
    (2, 2, 1, 2, (0, 1)),           # each host its own rows
    (2, 2, 2, 2, (0, 1)),           # model axis inside each host
    (2, 2, 4, 1, (0, 0)),           # model axis across both hosts
    (4, 2, 4, 2, (0, 0, 1, 1)),     # pairs of hosts share rows
    (4, 2, 8, 1, (0, 0, 0, 0)),
])
def test_data_layout_follows_the_mesh(processes, per, model, shards,
                                      shard_of_process):
  """Hosts holding the same rows of the batch read the same shard (t5x's
  get_data_layout), counted by hand."""
  layout = multihost.data_layout(_fake_mesh(processes, per, model))
  assert layout.num_shards == shards
  assert layout.shard_of_process == shard_of_process
  assert layout.record() == {'DATA_SHARDS': shards,
                             'PROCESS_COUNT': processes,
                             'SHARD_OF_PROCESS': list(shard_of_process)}


def test_a_mesh_cutting_hosts_unevenly_is_refused():
  # 3 devices per host, model 2: host 0 holds rows {0, 1}, host 1 {1, 2}.
  with pytest.raises(ValueError, match='overlapping or uneven.*MESH_MODEL'):
    multihost.data_layout(_fake_mesh(2, 3, 2))


def _layout(shards, shard_of_process, me):
  return multihost.DataLayout(shards, shard_of_process[me],
                              tuple(shard_of_process), me)


def test_a_saved_data_position_carries_over_when_the_shards_do():
  """Each process restores the file of a saving process that read its
  shard, whatever the process count."""
  record = {'processes': {'DATA_SHARDS': 2, 'PROCESS_COUNT': 4,
                          'SHARD_OF_PROCESS': [0, 0, 1, 1]}}
  sources = [run_record.data_source(record, _layout(2, (0, 1), me), False,
                                    'checkpoint_4') for me in (0, 1)]
  assert sources == [0, 2]
  # Older checkpoints (no layout recorded): each process its own file.
  assert run_record.data_source({}, _layout(2, (0, 1), 1), False, 'c') == 1


def test_another_number_of_shards_is_refused_or_restarts_the_data():
  record = {'processes': {'DATA_SHARDS': 2, 'PROCESS_COUNT': 2,
                          'SHARD_OF_PROCESS': [0, 1]}}
  with pytest.raises(checkpoint_manager.ResumeMismatchError,
                     match=r'checkpoint_4 was written with the data in 2 '
                     r'shard\(s\) over 2 process\(es\); this run cuts it into '
                     r'1 over 1.*RESTART_DATA_ON_LAYOUT_CHANGE=True'):
    run_record.data_source(record, _layout(1, (0,), 0), False,
                           'checkpoint_4')
  assert run_record.data_source(record, _layout(1, (0,), 0), True,
                                'checkpoint_4') is None


def test_the_flags_must_name_all_three_or_none(monkeypatch):
  for name in (multihost.ENV_COORDINATOR, multihost.ENV_NUM_PROCESSES,
               multihost.ENV_PROCESS_ID):
    monkeypatch.delenv(name, raising=False)
  assert multihost.initialize() is False  # one process: nothing to join
  with pytest.raises(ValueError, match='--process_id missing'):
    multihost.initialize('127.0.0.1:1234', num_processes=2)
  monkeypatch.setenv(multihost.ENV_NUM_PROCESSES, '2')
  monkeypatch.setenv(multihost.ENV_PROCESS_ID, '2')
  with pytest.raises(ValueError, match=r'--process_id=2 must be in \[0, 2\)'):
    multihost.initialize('127.0.0.1:1234')


# -- real processes -------------------------------------------------------------


def test_two_processes_take_the_steps_of_one_fed_the_same_batches(
    two_process_run):
  """MESH_MODEL=1: 2 processes x 2 devices, each reading its shard, end
  with the parameters of 1 process x 4 devices fed the same global batches
  (shard 0's rows, then shard 1's)."""
  run, reference = two_process_run
  _assert_same_run(_params(run / 'checkpoint_4'), reference)
  record = json.loads((run / 'checkpoint_4' / 'run' / 'metadata'
                       ).read_text())
  assert record['processes'] == {'DATA_SHARDS': 2, 'PROCESS_COUNT': 2,
                                 'SHARD_OF_PROCESS': [0, 1]}
  # Evaluation during training: both processes score the same predictions,
  # process 0 writes them once.
  (line,) = (run / 'eval_during_training.jsonl').read_text().splitlines()
  assert json.loads(line)['step'] == 4
  assert list(json.loads(line)['task_scores']) == ['glue_rte']
  said = [re.findall(r'eval at step 4: [^(]*', multiprocess.command_output(
      _log(run.parent, f'two-{i}'), 0)) for i in (0, 1)]
  assert said[0] and said[0] == said[1]


def test_a_model_axis_across_processes_equals_one_process(model_axis_runs):
  """MESH_MODEL=4 over 2 processes x 2 devices: both read the one shard,
  the global batch keeps BATCH_SIZE rows, and the run equals 1 process x 4
  devices with MESH_MODEL=4 on the same data stream."""
  two, one = model_axis_runs
  _assert_same_run(_params(two / 'checkpoint_4'),
                   _params(one / 'checkpoint_4'))


def test_eval_and_infer_as_two_processes_equal_one(cluster_runs):
  """Each process decodes its rows and gets every prediction back; process
  0 writes: the same summary.json and predictions, byte for byte."""
  summary = (cluster_runs / 'eval2' / 'summary.json').read_bytes()
  assert summary == (cluster_runs / 'eval1' / 'summary.json').read_bytes()
  assert set(json.loads(summary)['selection']['tasks']) == {'glue_rte'}
  (written,) = os.listdir(cluster_runs / 'infer2')
  assert written == 'fixture_glue_rte-4.jsonl'
  predictions = (cluster_runs / 'infer2' / written).read_bytes()
  assert predictions == (cluster_runs / 'infer1' / written).read_bytes()
  assert len(predictions.splitlines()) > 8  # more than one batch


def _copy_run(run, target, keep_step=None):
  shutil.copytree(run, target)
  if keep_step is not None:
    for name in os.listdir(target):
      if name.startswith('checkpoint_') and name != f'checkpoint_{keep_step}':
        shutil.rmtree(target / name)
  lock = target / 'train.lock'
  if lock.exists():
    lock.unlink()
  return target


def test_resume_with_another_data_layout_is_refused_on_every_process(
    two_process_run, model_axis_runs, tmp_path):
  """2 -> 1 process and 1 -> 2 processes (data in 2 shards, then 1; and
  back): every process refuses at once, with one message naming the
  change and the switch."""
  two_saved = _copy_run(two_process_run[0], tmp_path / 'two_saved')
  longer = [a for a in QUICK if 'TRAIN_STEPS' not in a] + [
      '--gin.TRAIN_STEPS=6']
  tick = time.time()
  one = multiprocess.run(TRAIN, longer + [_model_dir(two_saved)],
                         tmp_path / 'logs', num_processes=1, devices=4,
                         name='two_to_one', timeout=60, expect=2)
  assert time.time() - tick < 60
  assert ('checkpoint_4 was written with the data in 2 shard(s) over 2 '
          'process(es); this run cuts it into 1 over 1') in one[0].output()
  # A run of one process with the data in one shard, resumed by two
  # (MESH_MODEL=1: two shards).
  one_saved = _copy_run(model_axis_runs[1], tmp_path / 'one_saved')
  tick = time.time()
  two = multiprocess.run(TRAIN, longer + [_model_dir(one_saved)],
                         tmp_path / 'logs', name='one_to_two', timeout=60,
                         expect=2)
  assert time.time() - tick < 60
  for p in two:
    assert ('checkpoint_4 was written with the data in 1 shard(s) over 1 '
            'process(es); this run cuts it into 2 over 2') in p.output()
    assert 'RESTART_DATA_ON_LAYOUT_CHANGE=True' in p.output()


def test_a_held_lock_is_refused_by_every_process_with_one_message(tmp_path):
  """Process 0 finds MODEL_DIR held by a live trainer (this test); both
  processes stop at once with its message, before anything is compiled."""
  model_dir = tmp_path / 'held'
  model_dir.mkdir()
  with run_lock.RunLock(str(model_dir)):
    tick = time.time()
    procs = multiprocess.run(TRAIN, QUICK + [_model_dir(model_dir)],
                             tmp_path / 'logs', name='locked', timeout=60,
                             expect=2)
    assert time.time() - tick < 60
  messages = [[line for line in p.output().splitlines()
               if line.startswith('error:')] for p in procs]
  assert messages[0] == messages[1] and len(messages[0]) == 1, messages
  assert f'in use by another trainer: pid {os.getpid()}' in messages[0][0]


def test_a_killed_process_ends_the_other_and_a_restart_resumes_exactly(
    two_process_run, tmp_path):
  """SIGKILL of process 1 while the run resumes: process 0 exits non-zero
  once the lost process's heartbeats are missed (here after 10 s, not the
  default 30 s), naming it; run again, it resumes from checkpoint_2 and
  ends with the uninterrupted run's parameters, bit for bit."""
  two_process_run, _ = two_process_run
  run = _copy_run(two_process_run, tmp_path / 'run', keep_step=2)
  procs = multiprocess.start(
      TRAIN, QUICK + [_model_dir(run), '--heartbeat_timeout_seconds=10'],
      tmp_path / 'logs', name='killed')
  deadline = time.time() + 120
  while 'Resuming from' not in procs[1].output():
    assert procs[1].popen.poll() is None, multiprocess.outputs(procs)
    assert time.time() < deadline, multiprocess.outputs(procs)
    time.sleep(0.05)
  procs[1].popen.send_signal(signal.SIGKILL)
  tick = time.time()
  (status,) = multiprocess.wait(procs[:1], 60)
  assert time.time() - tick < 60
  assert status != 0
  assert not (run / 'checkpoint_4').exists()
  lost = procs[0].output()
  assert 'The following tasks are unhealthy' in lost or (
      'task 1' in lost.lower()), lost[-3000:]
  multiprocess.run(TRAIN, QUICK + [_model_dir(run)], tmp_path / 'logs',
                   name='restarted', timeout=300)
  restarted = _params(run / 'checkpoint_4')
  straight = _params(two_process_run / 'checkpoint_4')
  for k, v in straight.items():
    np.testing.assert_array_equal(restarted[k], v, err_msg=k)
