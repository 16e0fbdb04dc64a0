"""Faults and mistakes of the built-in runner: unreadable checkpoints, resume
with other settings, a second trainer, settings that cannot work, and the
run's record (SIGTERM and SIGKILL: test_train.py)."""

import dataclasses
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf
from flax import traverse_util

from hyperprompt_jax import tasks
from hyperprompt_jax.checkpointing import checkpoint_manager
from hyperprompt_jax.checkpointing import run_record
from hyperprompt_jax.evaluation import checkpoint_job
from hyperprompt_jax.evaluation import evaluator
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.model import network
from hyperprompt_jax.runner import run_lock
from hyperprompt_jax.runner import training_loop
from hyperprompt_jax.tasks import task_ids
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import run_settings
from hyperprompt_jax.training import trainer as trainer_lib

import conftest

LENGTHS = {'inputs': 64, 'targets': 8}
STEPS = 6
# Two tasks: a resume still restores a mixture's position, and the input
# pipeline is built in a fraction of the time of fixture_glue_proportional.
MIXTURE = 'test_faults_rte_cola'
if MIXTURE not in seqio.MixtureRegistry.names():
  tasks.add_mixture(MIXTURE, [('fixture_glue_rte', 1.0),
                              ('fixture_glue_cola', 1.0)])


def _model(encoder_prompt_length=4):
  cfg = dict(vars(conftest.T5X_TINY_CONFIG))
  cfg.update(num_tasks=8, hyperprompt=dataclasses.replace(
      conftest.TINY_GLOBAL_PROMPTS,
      encoder_prompt_length=encoder_prompt_length))
  return network.Transformer(network.T5Config(**cfg))


def _settings(model_dir, **overrides):
  kwargs = dict(
      model_dir=str(model_dir), train_steps=STEPS, batch_size=2,
      mixture_or_task_name=MIXTURE,
      task_feature_lengths=LENGTHS, save_period=2, log_period=2,
      optimizer=optimizers.make_optimizer())
  kwargs.update(overrides)
  return run_settings.RunSettings(**kwargs)


def _flat(params):
  return {k: np.asarray(v) for k, v in
          traverse_util.flatten_dict(params, sep='/').items()}


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A finished run (checkpoints 2, 4, 6) and its final parameters."""
  model_dir = tmp_path_factory.mktemp('faults') / 'run'
  gin.clear_config()
  # A binding only this run has, to tell its config record from others'.
  gin.bind_parameter(
      'hyperprompt_jax.training.run_settings.RunSettings.use_cached_tasks',
      False)
  try:
    result = training_loop.train(_model(), settings=_settings(model_dir))
  finally:
    gin.clear_config()
  return model_dir, _flat(result['params'])


def _copy(trained, tmp_path):
  model_dir = tmp_path / 'run'
  shutil.copytree(trained[0], model_dir)
  return model_dir


def _files(directory):
  return sorted(str(p.relative_to(directory))
                for p in pathlib.Path(directory).rglob('*'))


# ------------------------------------------------- unreadable checkpoints --

def _truncate(checkpoint):
  """A save cut short: every array file of the state half written."""
  data = [p for p in (checkpoint / 'state').rglob('*')
          if p.is_file() and p.parent.name == 'd']
  assert data
  for p in data:
    with open(p, 'r+b') as f:
      f.truncate(p.stat().st_size // 2)


def _empty(checkpoint):
  shutil.rmtree(checkpoint)
  checkpoint.mkdir()


@pytest.mark.parametrize('damage', [_truncate, _empty])
def test_resume_skips_an_unreadable_newest_checkpoint(trained, tmp_path,
                                                      damage, caplog):
  model_dir = _copy(trained, tmp_path)
  damage(model_dir / f'checkpoint_{STEPS}')
  with caplog.at_level('INFO'):
    result = training_loop.train(_model(), settings=_settings(model_dir))
  log = '\n'.join(r.getMessage() for r in caplog.records)
  assert f'checkpoint_{STEPS} cannot be restored' in log, log
  assert 'resumed from checkpoint_4' in log, log
  # Kept aside, not deleted; the run redid steps 5 and 6 exactly.
  assert (model_dir / 'unreadable' / f'checkpoint_{STEPS}').is_dir()
  got, want = _flat(result['params']), trained[1]
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert (model_dir / f'checkpoint_{STEPS}' / 'state').is_dir()


def test_all_checkpoints_unreadable_is_an_error_that_moves_nothing(
    trained, tmp_path):
  model_dir = _copy(trained, tmp_path)
  for step in (2, 4, STEPS):
    _empty(model_dir / f'checkpoint_{step}')
  before = _files(model_dir)
  with pytest.raises(checkpoint_manager.UnreadableCheckpointsError,
                     match='None of the checkpoints .* can be restored'):
    training_loop.train(_model(), settings=_settings(model_dir))
  assert _files(model_dir) == before


# ------------------------------------------------- resume and the record --

def test_resume_with_other_settings_is_refused_naming_them(trained,
                                                           tmp_path):
  model_dir = _copy(trained, tmp_path)
  record = (model_dir / 'config.gin').read_text()
  assert 'use_cached_tasks' in record
  before = _files(model_dir)
  with pytest.raises(checkpoint_manager.ResumeMismatchError,
                     match=f"MIXTURE_OR_TASK_NAME: '{MIXTURE}'"
                     r" -> 'fixture_glue_rte'"):
    training_loop.train(_model(), settings=_settings(
        model_dir, train_steps=8,
        mixture_or_task_name='fixture_glue_rte'))
  with pytest.raises(checkpoint_manager.ResumeMismatchError,
                     match=r'T5Config.hyperprompt.encoder_prompt_length: '
                     r'4 -> 6'):
    training_loop.train(_model(encoder_prompt_length=6),
                    settings=_settings(model_dir, train_steps=8))
  # The task ids (user tasks take ids in import order): the same tasks in
  # another order would read every task-indexed row as another task's.
  glue = task_ids.run_task_list()
  gin.bind_parameter('run_task_list.tasks', glue[::-1])
  try:
    with pytest.raises(checkpoint_manager.ResumeMismatchError,
                       match=f"task '{glue[0]}' has id 0 in the checkpoint "
                       f'but id {len(glue) - 1} in this run'):
      training_loop.train(_model(), settings=_settings(model_dir, train_steps=8))
  finally:
    gin.clear_config()
  # A failed start leaves the record of the run that wrote the checkpoints.
  assert (model_dir / 'config.gin').read_text() == record
  assert _files(model_dir) == before
  # Checkpoints without a record (older ones): the shapes name the change.
  for run in model_dir.glob('checkpoint_*/run'):
    shutil.rmtree(run)
  with pytest.raises(checkpoint_manager.ResumeMismatchError,
                     match=r'shapes differ: params/encoder/.*prompt.* -> '):
    training_loop.train(_model(encoder_prompt_length=6),
                    settings=_settings(model_dir, train_steps=8))


def test_train_steps_at_or_below_the_resumed_step(trained, tmp_path, caplog):
  model_dir = _copy(trained, tmp_path)
  with pytest.raises(ValueError, match=f'at step {STEPS}, past TRAIN_STEPS=4'):
    training_loop.train(_model(), settings=_settings(model_dir, train_steps=4))
  with caplog.at_level('INFO'):
    result = training_loop.train(_model(), settings=_settings(model_dir))
  assert result['step'] == STEPS
  assert 'nothing to train' in caplog.text


def test_checkpoints_record_their_run(trained):
  model_dir = trained[0]
  manager = checkpoint_manager.make_manager(str(model_dir), 2, None)
  record = checkpoint_manager.read_record(manager, STEPS)
  assert record['data']['MIXTURE_OR_TASK_NAME'] == MIXTURE
  assert record['model']['T5Config.num_tasks'] == '8'
  assert 'use_cached_tasks' in record['config_gin']
  assert record['operative_config_gin'] == (
      model_dir / 'operative_config.gin').read_text()


# ---------------------------------------------------- settings and locks --

@pytest.mark.parametrize('overrides,message', [
    ({'keep_checkpoints': 0}, 'KEEP_CHECKPOINTS must be None'),
    ({'save_period': 0}, 'SAVE_PERIOD must be an integer >= 1'),
    ({'train_steps': 'sixty'}, r"TRAIN_STEPS must be .* got 'sixty' \(str\)"),
    ({'train_steps': 0}, 'TRAIN_STEPS must be an integer >= 1'),
    ({'batch_size': 32.5}, r'BATCH_SIZE must be .* got 32.5 \(float\)'),
    ({'task_feature_lengths': {'inputs': 64}}, 'TASK_FEATURE_LENGTHS'),
])
def test_settings_that_cannot_work_fail_before_anything(tmp_path, overrides,
                                                        message):
  # An earlier run's checkpoint: KEEP_CHECKPOINTS = 0 deleted it.
  old = tmp_path / 'run' / 'checkpoint_2'
  old.mkdir(parents=True)
  (old / 'keep.txt').write_text('x')
  with pytest.raises(ValueError, match=message):
    training_loop.train(_model(),
                    settings=_settings(tmp_path / 'run', **overrides))
  assert _files(tmp_path / 'run') == ['checkpoint_2', 'checkpoint_2/keep.txt']


def test_a_quoted_learning_rate_fails_at_once():
  with pytest.raises(ValueError, match=r"learning_rate must be a positive "
                     r"number, got '1e-3' \(str\) \(--gin.LEARNING_RATE"):
    optimizers.make_optimizer(learning_rate='1e-3')


def _dead_pid() -> int:
  proc = subprocess.Popen(['true'])
  proc.wait()
  return proc.pid


def _write_lock(model_dir, host, pid, age_s=0.0):
  path = model_dir / run_lock.LOCK_FILE
  path.write_text(f'{{"host": "{host}", "pid": {pid}, "user": "someone", '
                  '"started": "2026-11-23T10:00:00", "command": "train", '
                  '"token": "other"}')
  stamp = time.time() - age_s
  os.utime(path, (stamp, stamp))
  return path


def test_a_second_trainer_is_refused_naming_the_first(tmp_path):
  with run_lock.RunLock(str(tmp_path)):
    with pytest.raises(run_lock.DirectoryInUseError,
                       match=f'in use by another trainer: pid {os.getpid()} '
                       f'on {socket.gethostname()}'):
      training_loop.train(_model(), settings=_settings(tmp_path))
    assert _files(tmp_path) == [run_lock.LOCK_FILE]
  assert _files(tmp_path) == []  # released


@pytest.mark.parametrize('host,pid,age_s,taken', [
    ('this', 'dead', 0, True),          # killed on this host
    ('elsewhere', 1, 0, False),         # live on another host
    ('elsewhere', 1, 600, True),        # another host, no heartbeat
    ('this', 'self', 0, False),         # alive here
    ('this', 'self', 600, False),       # alive here, silent (suspended)
])
def test_stale_locks_are_taken_over_and_live_ones_refused(tmp_path, host, pid,
                                                          age_s, taken):
  host = socket.gethostname() if host == 'this' else host
  pid = {'dead': _dead_pid(), 'self': os.getpid()}.get(pid, pid)
  path = _write_lock(tmp_path, host, pid, age_s)
  lock = run_lock.RunLock(str(tmp_path))
  if taken:
    with lock:
      assert f'"pid": {os.getpid()}' in path.read_text()
    assert not path.exists()
  else:
    with pytest.raises(run_lock.DirectoryInUseError, match=f'pid {pid} on '
                       f'{host}'):
      lock.acquire()
    assert '"token": "other"' in path.read_text()


def test_the_lock_has_a_heartbeat(tmp_path):
  path = tmp_path / run_lock.LOCK_FILE
  with run_lock.RunLock(str(tmp_path), heartbeat_s=0.05):
    os.utime(path, (0, 0))
    deadline = time.time() + 10
    while path.stat().st_mtime == 0:
      assert time.time() < deadline, 'no heartbeat'
      time.sleep(0.05)


def test_a_suspended_holder_keeps_its_lock(tmp_path):
  """A trainer stopped with SIGSTOP sends no heartbeat, but its process
  lives: its lock is never stale on its host (it would resume and overwrite
  the new run's checkpoints)."""
  holder = subprocess.Popen(
      [sys.executable, '-c',
       'import sys, time; from hyperprompt_jax.runner import run_lock\n'
       'lock = run_lock.RunLock(sys.argv[1], stale_after_s=0.5, '
       'heartbeat_s=0.1)\n'
       'lock.acquire(); print("held", flush=True); time.sleep(60)',
       str(tmp_path)], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == 'held\n'
    holder.send_signal(signal.SIGSTOP)
    time.sleep(1.5)  # three stale limits without a heartbeat
    with pytest.raises(run_lock.DirectoryInUseError,
                       match=f'pid {holder.pid} on {socket.gethostname()}'):
      run_lock.RunLock(str(tmp_path), stale_after_s=0.5).acquire()
  finally:
    holder.kill()
    holder.wait()


def test_a_run_whose_lock_was_taken_stops_before_saving(tmp_path,
                                                        monkeypatch):
  """After step 3 another run takes the lock over (as one would after a long
  suspension): the run stops at its next save without saving. (Taken on the
  host between steps: the step program stays the one `trained` compiled.)"""
  model_dir = tmp_path / 'run'
  step = trainer_lib.Trainer.step

  def step_then_steal(self, state, batch):
    state, terms = step(self, state, batch)
    if int(state['step']) == 3:
      _write_lock(model_dir, 'elsewhere', 4242)
    return state, terms

  monkeypatch.setattr(trainer_lib.Trainer, 'step', step_then_steal)
  with pytest.raises(run_lock.LockLostError,
                     match='pid 4242 on elsewhere .* took it over.*stops '
                     'without saving'):
    training_loop.train(_model(), settings=_settings(
        model_dir, mixture_or_task_name='fixture_glue_rte'))
  assert sorted(p.name for p in model_dir.glob('checkpoint_*')) == [
      'checkpoint_2']
  assert '"pid": 4242' in (model_dir / run_lock.LOCK_FILE).read_text()


@pytest.fixture
def empty_train_task():
  """A task whose train split holds no example, alone and mixed with
  fixture_glue_rte (rate 1 each), and a mixture of evaluation-only rates."""
  def examples(split, shuffle_files=False):
    del shuffle_files
    n = 0 if split == 'train' else 2
    return tf.data.Dataset.from_tensor_slices(
        {'inputs': ['x'] * n, 'targets': ['y'] * n})

  vocabulary = seqio.ByteVocabulary()
  seqio.TaskRegistry.add(
      'empty_train', seqio.FunctionDataSource(examples,
                                              ['train', 'validation']),
      preprocessors=[], output_features={
          k: seqio.Feature(vocabulary) for k in ('inputs', 'targets')})
  seqio.MixtureRegistry.add('empty_mixed',
                            [('empty_train', 1.0), ('fixture_glue_rte', 1.0)])
  seqio.MixtureRegistry.add('eval_only', [
      ('fixture_glue_rte', tasks.EVAL_ONLY),
      ('fixture_glue_cola', tasks.EVAL_ONLY)])
  yield
  for name in ('empty_mixed', 'eval_only'):
    seqio.MixtureRegistry.remove(name)
  seqio.TaskRegistry.remove('empty_train')


@pytest.mark.parametrize('mixture,message', [
    ('eval_only', r"nothing to train on: every task has rate 0 .*"
     r"\['fixture_glue_cola', 'fixture_glue_rte'\]"),
    ('empty_train', r"samples tasks with no 'train' examples: "
     r"\['empty_train'\]"),
    ('empty_mixed', r"samples tasks with no 'train' examples: "
     r"\['empty_train'\]"),
])
def test_a_mixture_with_nothing_to_sample_fails_before_anything(
    empty_train_task, tmp_path, mixture, message):
  del empty_train_task
  with pytest.raises(ValueError, match=message):
    training_loop.train(_model(), settings=_settings(tmp_path / 'run',
                                        mixture_or_task_name=mixture))
  assert not (tmp_path / 'run').exists()


def test_eval_refuses_a_checkpoint_read_as_another_model_or_task_list(
    trained, tmp_path):
  """The run record says whose parameters the checkpoint holds: evaluating
  (inferring, probing, exporting) with the task list reversed, or another
  activation of the same shapes, is refused by name; the override reads it
  anyway."""
  checkpoint = str(trained[0] / f'checkpoint_{STEPS}')
  glue = task_ids.run_task_list()
  model = _model()
  relu = network.Transformer(dataclasses.replace(
      model.config, mlp_activations=('relu', 'linear')))
  kwargs = dict(job=checkpoint_job.CheckpointJob(
      checkpoint_path=checkpoint, output_dir=str(tmp_path / 'eval'),
      mixture_or_task_name='fixture_glue_rte', task_feature_lengths=LENGTHS,
      batch_size=4))
  with pytest.raises(run_record.RecordMismatchError,
                     match=r"T5Config.mlp_activations: \('gelu', 'linear'\) "
                     r"-> \('relu', 'linear'\).*allow_mismatch=True"):
    evaluator.evaluate(relu, **kwargs)
  gin.bind_parameter('run_task_list.tasks', glue[::-1])
  try:
    with pytest.raises(run_record.RecordMismatchError,
                       match=f"task '{glue[0]}' has id 0 in the checkpoint"):
      evaluator.evaluate(model, **kwargs)
    gin.bind_parameter('run_record.check_checkpoint.allow_mismatch', True)
    run_record.check_checkpoint(checkpoint, model.config,
                                task_ids.run_task_list())  # warns only
  finally:
    gin.clear_config()
  # Appended tasks keep every saved id: read as before.
  run_record.check_checkpoint(checkpoint, model.config, glue + ('new',))
  # A t5x checkpoint records nothing: nothing to compare.
  run_record.check_checkpoint(
      str(conftest.T5X_TINY / 'orbax' / 'checkpoint_100'), relu.config, ())


def test_a_run_packed_by_seqio_does_not_resume_with_best_fit_rows():
  """Records from before the best-fit packer hold no PACKER; packed, their
  iterator position is seqio's packer's, which best fit cannot restore."""
  config = _model().config
  data = run_record.data_settings('fixture_glue_proportional',
                                  {'inputs': 64, 'targets': 8}, 8, True, 0)
  old = {'model': network.model_settings(config),
         'data': {k: v for k, v in data.items() if k != 'PACKER'}}
  now = r"'best_fit\(buffer_size=16, choice=scarce_pairs\)'"
  with pytest.raises(checkpoint_manager.ResumeMismatchError,
                     match=r"PACKER: 'seqio' -> " + now):
    run_record.check_resume(old, config, data, 'checkpoint_4', [])
  # Nor does a run of the best-fit packer's first rule (largest first): its
  # iterator state lacks the arrivals and the stream's demand.
  old['data'] = {**data, 'PACKER': 'best_fit(buffer_size=16)'}
  with pytest.raises(checkpoint_manager.ResumeMismatchError,
                     match=r"PACKER: 'best_fit\(buffer_size=16\)' -> " + now):
    run_record.check_resume(old, config, data, 'checkpoint_4', [])
  # Unpacked, the packer does not matter.
  unpacked = run_record.data_settings('fixture_glue_proportional',
                                      {'inputs': 64, 'targets': 8}, 8, False,
                                      0)
  old['data'] = {k: v for k, v in unpacked.items() if k != 'PACKER'}
  run_record.check_resume(old, config, unpacked, 'checkpoint_4', [])


def test_forms_and_the_segment_bound_are_not_model_settings():
  """A HyperGrid checkpoint's record from before `gradient_form`,
  `packed_form` and `max_segments` existed (or written with other values)
  still reads and resumes: they change how a step computes, or which
  examples share a packed row (the data record's PACKER names the bound),
  not the parameters or what they compute. A packed run's PACKER does
  refuse another bound."""
  config = network.T5Config(**{
      **vars(conftest.T5X_TINY_CONFIG),
      'hypergrid': hypergrid.HyperGridConfig(grid_rows=4, grid_cols=8)})
  saved = network.model_settings(config)
  assert not {'T5Config.gradient_form', 'T5Config.hypergrid.packed_form',
              'T5Config.hypergrid.max_segments'} & set(saved)
  old = {'model': {**saved, 'T5Config.hypergrid.max_segments': '4',
                   'T5Config.hypergrid.packed_form': "'grouped'"}}
  assert run_record.record_changes(old, config, []) == []
  lengths = {'inputs': 64, 'targets': 8}
  data = run_record.data_settings('fixture_glue_proportional', lengths, 8,
                                  True, 0, 8)
  old['data'] = run_record.data_settings('fixture_glue_proportional',
                                         lengths, 8, True, 0, 4)
  run_record.check_resume({**old, 'data': data}, config, data, 'c', [])
  with pytest.raises(checkpoint_manager.ResumeMismatchError,
                     match='max_examples=4.* -> .*max_examples=8'):
    run_record.check_resume(old, config, data, 'checkpoint_4', [])
