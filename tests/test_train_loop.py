"""The built-in runner's loop as t5x users expect it: learning-rate
schedules (against optax's own and t5x's formula), evaluation during
training (against `eval`'s scores of the same checkpoints), KEEP_BEST_BY,
a stop during an evaluation, and the TensorBoard curves."""

import json
import math
import os
import re
import shutil
import signal
import time

import gin
import numpy as np
import optax
import pytest
import seqio
import tensorflow as tf
from flax import traverse_util

from hyperprompt_jax import tasks
from hyperprompt_jax.checkpointing import checkpoint_manager
from hyperprompt_jax.checkpointing import run_record
from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.evaluation import checkpoint_job
from hyperprompt_jax.evaluation import during_training
from hyperprompt_jax.evaluation import eval_summary
from hyperprompt_jax.evaluation import evaluator
from hyperprompt_jax.model import network
from hyperprompt_jax.runner import training_loop
from hyperprompt_jax.t5 import losses
from hyperprompt_jax.tasks import task_ids
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import run_settings
from hyperprompt_jax.training import schedules
from hyperprompt_jax.training import trainer as trainer_lib

import conftest

LENGTHS = {'inputs': 64, 'targets': 16}
MIXTURE = 'test_train_loop_rte_stsb'
if MIXTURE not in seqio.MixtureRegistry.names():
  tasks.add_mixture(MIXTURE, [('fixture_glue_rte', 1.0),
                              ('fixture_glue_stsb', 1.0)])


# ------------------------------------------------------------- schedules --

def _assert_rates_close(got, want):
  """float32 rates: a few operations (a product, a power or a cosine) each
  side, rounded relative to the schedule's peak."""
  conftest.assert_close_to_scale(got, want, conftest.float32_bound(4))


def test_schedules_match_optax_and_t5x():
  """t5x's factors, each against an independent reference: optax's
  schedules, and t5x's rsqrt formula written out in numpy."""
  steps = np.arange(0, 60)
  make = schedules.create_learning_rate_scheduler

  def check(schedule, reference, upto=len(steps)):
    _assert_rates_close([float(schedule(s)) for s in steps[:upto]],
                        [max(float(reference(s)), 1e-8)
                         for s in steps[:upto]])

  check(make('constant', 0.02), optax.constant_schedule(0.02))
  check(make('constant * linear_warmup', 0.1, warmup_steps=10),
        optax.linear_schedule(0.0, 0.1, 10))
  # One cycle (t5x's cosine restarts after steps_per_cycle; optax's stays
  # at its end value).
  check(make('constant * linear_warmup * cosine_decay', 0.1, warmup_steps=10,
             steps_per_cycle=40),
        optax.warmup_cosine_decay_schedule(0.0, 0.1, 10, 50, 0.0), upto=50)
  check(make('linear_decay', 0.1, warmup_steps=10, decay_factor=1 / 30),
        optax.join_schedules([optax.linear_schedule(0.0, 0.1, 10),
                              optax.linear_schedule(0.1, 0.0, 30)], [10]))
  check(make('constant * decay_every', 0.1, decay_factor=0.5,
             steps_per_decay=7),
        optax.exponential_decay(0.1, 7, 0.5, staircase=True))
  # t5x's default ('constant * linear_warmup * rsqrt_decay'), re-derived.
  check(make('constant * linear_warmup * rsqrt_decay', 1.0, warmup_steps=10),
        lambda s: min(1.0, s / 10) / math.sqrt(max(s, 10)))
  check(make('constant * rsqrt_normalized_decay', 1.0, warmup_steps=10,
             step_offset=5),
        lambda s: math.sqrt(10) / math.sqrt(max(max(s - 5, 0), 10)))
  with pytest.raises(ValueError, match=r"Unknown learning-rate factor.*"
                     r"'cosine'.*joined by"):
    make('constant * cosine')
  with pytest.raises(ValueError, match='warmup_steps=0'):
    make('constant * linear_warmup', warmup_steps=0)


def test_run_record_refuses_a_changed_schedule_and_reads_old_records():
  config = conftest.T5X_TINY_CONFIG
  warmup = schedules.create_learning_rate_scheduler(
      'constant * linear_warmup', 0.01, warmup_steps=100).record()
  constant = schedules.create_learning_rate_scheduler('constant',
                                                      0.01).record()
  data = {'BATCH_SIZE': 8}
  record = run_record.make(config, {**data, run_record.SCHEDULE: warmup}, 0)
  run_record.check_resume(record, config, {**data, run_record.SCHEDULE:
                                           warmup}, 'checkpoint_4', [])
  longer = dict(warmup, warmup_steps=200)
  with pytest.raises(checkpoint_manager.ResumeMismatchError,
                     match='LEARNING_RATE_SCHEDULE.*warmup_steps'):
    run_record.check_resume(record, config, {**data, run_record.SCHEDULE:
                                             longer}, 'checkpoint_4', [])
  # A record written before schedules were recorded: the constant rate.
  old = run_record.make(config, data, 0)
  run_record.check_resume(old, config, {**data, run_record.SCHEDULE:
                                        constant}, 'checkpoint_4', [])
  with pytest.raises(checkpoint_manager.ResumeMismatchError,
                     match="'constant'} -> .*linear_warmup"):
    run_record.check_resume(old, config, {**data, run_record.SCHEDULE:
                                          warmup}, 'checkpoint_4', [])


def test_bad_eval_settings_are_clear_errors(tmp_path):
  with pytest.raises(ValueError, match=r'EVAL_PERIOD must be None \(off\) '
                     'or an integer >= 1, got 0'):
    during_training.check_settings(0, None, None, 64)
  with pytest.raises(ValueError, match='EVAL_EXAMPLES_PER_TASK .* >= 2, '
                     'got 1'):
    during_training.check_settings(10, 1, None, 64)
  with pytest.raises(ValueError, match='KEEP_BEST_BY.*needs scores: set '
                     'EVAL_PERIOD'):
    during_training.check_settings(None, None, 'glue_average', 64)
  with pytest.raises(ValueError, match=r"KEEP_BEST_BY='glue' is neither a "
                     r"task .*'glue_rte'.* nor an average .*'average'"):
    _train(tmp_path / 'bad', eval_period=2, keep_best_by='glue')


def test_per_task_sums_and_examples_match_numpy():
  """The per-task curves' sums (each target token's loss, hits and weight
  by its task) and the examples a batch holds, packed and unpacked,
  against numpy loops."""
  rng = np.random.default_rng(0)
  token_loss, hits = rng.random((3, 5)), rng.integers(0, 2, (3, 5))
  weights = rng.integers(0, 2, (3, 5))
  ids = rng.integers(0, 4, (3, 5))
  got = losses.per_task(token_loss * weights, hits * weights, weights, ids, 4)
  for task in range(4):
    mask = (ids == task) * weights
    # A float32 sum of 15 positive terms, each rounded to float32.
    want = (token_loss * mask).sum()
    conftest.assert_close_to_scale(got['task_loss'][task], want,
                                   conftest.float32_bound(15, 1), want)
    assert got['task_hits'][task] == (hits * mask).sum()
    assert got['task_tokens'][task] == mask.sum()
  packed = {'decoder_segment_ids': np.array([[1, 1, 2, 3, 0], [1, 2, 0, 0,
                                                                0]]),
            'encoder_segment_ids': np.zeros((2, 5)),
            'decoder_loss_weights': np.ones((2, 5))}
  assert int(trainer_lib.examples(packed)) == 5
  unpacked = {'decoder_loss_weights': np.array([[1, 1, 0], [0, 0, 0]]),
              'task_ids': np.zeros(2)}
  assert int(trainer_lib.examples(unpacked)) == 1


@pytest.mark.parametrize('run, period, cap', [
    ('quickstart', 650, 100), ('quickstart_hypergrid', 650, 100),
    ('hyperprompt_glue', None, None), ('hypergrid_glue_super_glue', None,
                                       None)])
def test_run_files_evaluate_during_training_in_the_quickstarts_only(
    run, period, cap):
  gin.clear_config()
  try:
    gin_utils.parse_gin([f'runs/{run}.gin'], ["MODEL_DIR='/tmp/x'"], [])
    assert gin.query_parameter('%EVAL_PERIOD') == period
    if period:
      assert period == gin.query_parameter('%SAVE_PERIOD')
    assert gin.query_parameter('%EVAL_EXAMPLES_PER_TASK') == cap
    assert gin.query_parameter('%KEEP_BEST_BY') is None
    schedule = gin.get_configurable(
        schedules.create_learning_rate_scheduler)()
    assert schedule.names == ['constant']
    assert schedule.base_learning_rate == gin.query_parameter(
        '%LEARNING_RATE')
  finally:
    gin.clear_config()


# ------------------------------------------- a run with evaluations --------

def _model():
  """MTL T5 at t5x's tiny test dimensions (the loop is the same for every
  method; the quickstart test below runs HyperPrompt)."""
  return network.Transformer(network.T5Config(
      **{**vars(conftest.T5X_TINY_CONFIG), 'num_tasks': 8}))


SCHEDULE = schedules.create_learning_rate_scheduler(
    'constant * linear_warmup * cosine_decay', 2e-2, warmup_steps=3,
    steps_per_cycle=4)


def _train(model_dir, **overrides):
  """`train` with the evaluation during training and these settings."""
  kwargs = dict(
      model_dir=str(model_dir), mixture_or_task_name=MIXTURE,
      task_feature_lengths=LENGTHS, train_steps=6, batch_size=8,
      save_period=2, keep_checkpoints=1, log_period=1,
      optimizer=optimizers.make_optimizer(learning_rate=SCHEDULE),
      learning_rate_schedule=SCHEDULE, eval_period=2, keep_best_by='glue_rte')
  kwargs.update(overrides)
  return training_loop.train(_model(), during_training.EVALUATION,
                         run_settings.RunSettings(**kwargs))


def _scalars(model_dir) -> dict[str, dict[int, float]]:
  """`{tag: {step: value}}` of every TensorBoard event file in model_dir
  (a later file's value for a step replaces an earlier one's)."""
  out = {}
  for name in sorted(os.listdir(model_dir)):
    if not name.startswith('events.out.tfevents'):
      continue
    for event in tf.compat.v1.train.summary_iterator(
        os.path.join(model_dir, name)):
      for value in event.summary.value:
        out.setdefault(value.tag, {})[event.step] = float(
            tf.make_ndarray(value.tensor))
  return out


def _params(result):
  return traverse_util.flatten_dict(result['params'], sep='/')


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """A 6-step run evaluated every 2 steps, and the same run stopped by
  SIGTERM during its first evaluation and resumed."""
  root = tmp_path_factory.mktemp('loop')
  straight = _train(root / 'straight')

  evaluate = during_training.TrainingEvaluator.evaluate

  def terminated_during(self, step, params):
    os.kill(os.getpid(), signal.SIGTERM)  # the handler records it
    return evaluate(self, step, params)

  patch = pytest.MonkeyPatch()
  patch.setattr(during_training.TrainingEvaluator, 'evaluate',
                terminated_during)
  try:
    stopped = _train(root / 'resumed')
  finally:
    patch.undo()
  resumed = _train(root / 'resumed')
  return root, straight, stopped, resumed


def test_a_stop_during_evaluation_resumes_to_the_uninterrupted_run(runs):
  """SIGTERM during the step-2 evaluation: the run stops at step 2 with its
  checkpoint; resumed, it has the uninterrupted run's learning rate at
  every step (optax's warmup-cosine schedule) and its parameters."""
  root, straight, stopped, resumed = runs
  assert stopped['stopped_by'] == 'SIGTERM' and stopped['step'] == 2
  assert resumed['step'] == 6
  want, got = _params(straight), _params(resumed)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  reference = optax.warmup_cosine_decay_schedule(0.0, 2e-2, 3, 7, 0.0)
  for run in ('straight', 'resumed'):
    rates = _scalars(root / run)['learning_rate']
    assert sorted(rates) == list(range(1, 7))
    _assert_rates_close(
        [rates[s] for s in range(1, 7)],
        [max(float(reference(s - 1)), 1e-8) for s in range(1, 7)])
  lines = [json.loads(line) for line in
           (root / 'resumed' / during_training.SCORES_FILE).open()]
  assert [line['step'] for line in lines] == [2, 4, 6]


def test_scores_during_training_equal_eval_of_the_same_checkpoints(
    runs, tmp_path):
  root, *_ = runs
  model_dir = root / 'straight'
  lines = {line['step']: line for line in map(
      json.loads, (model_dir / during_training.SCORES_FILE).open())}
  assert sorted(lines) == [2, 4, 6]
  summary = evaluator.evaluate(
      _model(), job=checkpoint_job.CheckpointJob(
          checkpoint_path=str(model_dir), output_dir=str(tmp_path / 'eval'),
          mixture_or_task_name=MIXTURE, task_feature_lengths=LENGTHS),
      selection='last')
  assert summary['steps']  # the checkpoints KEEP_CHECKPOINTS left
  for step, evaluated in summary['steps'].items():
    line = lines[int(step)]
    assert line['metrics'] == evaluated['metrics']
    assert line['task_scores'] == evaluated['task_scores']
  # eval's selection reads the same scores from MODEL_DIR/inference_eval.
  from_training = eval_summary.read_metrics_dir(str(model_dir))
  assert sorted(from_training) == [2, 4, 6]
  for step, results in from_training.items():
    assert eval_summary.step_summary(results)['task_scores'] == (
        lines[step]['task_scores'])


def test_keep_best_by_keeps_the_best_checkpoint_beside_the_last(runs):
  root, *_ = runs
  model_dir = root / 'straight'
  lines = [json.loads(line)
           for line in (model_dir / during_training.SCORES_FILE).open()]
  rte = {line['step']: line['task_scores']['glue_rte'] for line in lines}
  best_before_6 = max((2, 4), key=lambda s: (rte[s], -s))
  kept = sorted(int(p.name.split('_')[1])
                for p in model_dir.glob('checkpoint_*'))
  # KEEP_CHECKPOINTS = 1: the last, and the best when it was saved.
  assert kept == sorted({best_before_6, 6})
  record = run_record.read(str(model_dir / 'checkpoint_6'))
  assert record['best_checkpoint'] == {'by': 'glue_rte', 'step': best_before_6,
                                       'score': rte[best_before_6]}
  assert lines[-1]['best']['by'] == 'glue_rte'
  assert record['data'][run_record.SCHEDULE] == SCHEDULE.record()


def test_tensorboard_has_per_task_curves_and_scores(runs):
  root, *_ = runs
  scalars = _scalars(root / 'straight')
  for tag in ('loss', 'accuracy', 'grad_norm', 'learning_rate',
              'tokens_per_sec', 'examples_per_row', 'packing_efficiency',
              'loss/glue_rte', 'accuracy/glue_rte', 'loss/glue_stsb',
              'accuracy/glue_stsb', 'eval/glue_rte', 'eval/glue_stsb',
              'eval/average',
              'eval/fixture_glue_rte/accuracy'):
    assert tag in scalars, sorted(scalars)
  assert sorted(scalars['eval/glue_rte']) == [2, 4, 6]
  assert sorted(scalars['loss/glue_rte']) == list(range(1, 7))
  assert all(0 < v <= 1 for v in scalars['examples_per_row'].values())


# ------------------------------ resumes older than the run's evaluations --

def _score_lines(model_dir) -> dict[int, dict]:
  with open(model_dir / during_training.SCORES_FILE) as f:
    return {line['step']: line for line in map(json.loads, f)}


def _metric_steps(model_dir) -> dict[str, list[int]]:
  """`{task: [step of each line]}` of seqio's metric files in MODEL_DIR."""
  directory = model_dir / evaluator.METRICS_SUBDIR
  return {name: [json.loads(line)['step'] for line in open(directory / name)]
          for name in sorted(os.listdir(directory))}


def _cut_short(checkpoint):
  """A copy cut short: every file of the saved state emptied."""
  for path in (checkpoint / 'state').rglob('*'):
    if path.is_file():
      path.write_bytes(b'')


@pytest.fixture(scope='module')
def evaluated_late(tmp_path_factory):
  """A 6-step run saving at 2, 4, 6 and evaluating at 4 and 6: its
  directory, final parameters and score lines."""
  model_dir = tmp_path_factory.mktemp('late') / 'run'
  result = _train(model_dir, eval_period=4, keep_checkpoints=3,
                  keep_best_by=None)
  return model_dir, _params(result), _score_lines(model_dir)


@pytest.mark.parametrize('removed, damaged, resumed_from', [
    ((4, 6), (), 2),   # plain removals: older than every evaluation
    ((4,), (6,), 2),   # the newest cut short, falling back past 4 and 6
    ((6,), (), 4),     # between the two evaluations
])
def test_a_resume_before_evaluations_drops_them_and_ends_as_the_run(
    evaluated_late, tmp_path, caplog, removed, damaged, resumed_from):
  """A resume to a checkpoint older than some or all of the run's
  evaluations starts (no score line left is a valid state), trains to the
  uninterrupted run's parameters bit for bit, and leaves the evaluations at
  or before its checkpoint plus those it made, each once."""
  source, want, lines = evaluated_late
  model_dir = tmp_path / 'run'
  shutil.copytree(source, model_dir)
  for step in removed:
    shutil.rmtree(model_dir / f'checkpoint_{step}')
  for step in damaged:
    _cut_short(model_dir / f'checkpoint_{step}')
  with caplog.at_level('INFO'):
    result = _train(model_dir, eval_period=4, keep_checkpoints=3,
                    keep_best_by=None)
  log = '\n'.join(r.getMessage() for r in caplog.records)
  assert f'Resuming from {model_dir}/checkpoint_{resumed_from}' in log, log
  for step in damaged:
    assert f'checkpoint_{step} cannot be restored' in log, log
    assert (model_dir / 'unreadable' / f'checkpoint_{step}').is_dir()
  assert result['step'] == 6
  got = _params(result)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  after = _score_lines(model_dir)
  assert sorted(after) == [4, 6]
  for step in (4, 6):
    assert after[step]['task_scores'] == lines[step]['task_scores']
    assert after[step]['metrics'] == lines[step]['metrics']
  if resumed_from == 4:  # kept as written, not evaluated again
    assert after[4] == lines[4]
  metric_steps = _metric_steps(model_dir)
  assert len(metric_steps) == 2, metric_steps  # RTE and STS-B
  assert all(steps == [4, 6] for steps in metric_steps.values()), metric_steps
  assert not list(model_dir.rglob('*.tmp'))


def test_quickstart_run_writes_per_task_curves(tmp_path):
  """The quickstart's own gin (two steps, no evaluation: the run above
  has the evaluation curves): each task trained on has its loss and
  accuracy curves, named as the run's task list (all 16 tasks) names it.
  Trained on GLUE's 8 tasks with BATCH_SIZE=4, as test_train.py's runs of
  the quickstart: the input pipeline in half the time of the 16 tasks'
  (whether the session's compilation cache also serves their step to this
  process is not checked)."""
  gin.clear_config()
  try:
    gin_utils.parse_gin(['runs/quickstart.gin'], [
        f"MODEL_DIR='{tmp_path}'", 'TRAIN_STEPS=2', 'BATCH_SIZE=4',
        'LOG_PERIOD=1', 'EVAL_PERIOD=None',
        "MIXTURE_OR_TASK_NAME='fixture_glue_proportional'"])
    training_loop.train()
    names = task_ids.run_task_list()
  finally:
    gin.clear_config()
  scalars = _scalars(tmp_path)
  assert len(names) == 16
  trained = [t for t in names if f'loss/{t}' in scalars]
  assert len(trained) >= 4, sorted(scalars)
  assert all(f'accuracy/{t}' in scalars for t in trained)
  assert not [t for t in scalars if t.startswith('loss/')
              and t[len('loss/'):] not in names]
  assert {'learning_rate', 'grad_norm', 'tokens_per_sec',
          'examples_per_row'} <= set(scalars)
  # 2e-2 rounded to float32.
  conftest.assert_close_to_scale(
      [scalars['learning_rate'][s] for s in (1, 2)], [2e-2, 2e-2],
      conftest.float32_bound(1))


def test_a_slow_end_says_what_it_waits_on(caplog):
  """A finished run's last waits (the checkpoint's commit, the input
  pipeline's threads) are logged once they take `after_s`, with their time;
  quick ones are not."""
  with caplog.at_level('INFO'):
    with training_loop._said_if_slow('Quick', after_s=5.0):  # pylint: disable=protected-access
      pass
    with training_loop._said_if_slow('Stopping the input pipeline', after_s=0.05):  # pylint: disable=protected-access
      time.sleep(0.3)
  messages = [r.getMessage() for r in caplog.records]
  assert len(messages) == 2, messages
  assert messages[0] == 'Stopping the input pipeline ...'
  assert re.fullmatch(r'Stopping the input pipeline: done in \d+\.\ds\.',
                      messages[1]), messages
