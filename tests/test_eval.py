"""Evaluation over checkpoint directories, summaries, t5x's metrics files,
inference, and bad input."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import scipy.stats
import seqio
import sklearn.metrics

from hyperprompt_jax import eval as eval_command
from hyperprompt_jax import tasks
from hyperprompt_jax.evaluation import checkpoint_job
from hyperprompt_jax.evaluation import eval_summary
from hyperprompt_jax.evaluation import evaluator
from hyperprompt_jax.evaluation import inference
from hyperprompt_jax.model import network
from hyperprompt_jax.runner import training_loop
from hyperprompt_jax.tasks import postprocessors
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import run_settings

import conftest

LENGTHS = {'inputs': 128, 'targets': 16}
MIXTURE = 'test_eval_fixture_mix'
EVAL_TASKS = ('fixture_glue_rte', 'fixture_glue_stsb',
              'fixture_glue_mnli_matched', 'fixture_glue_mnli_mismatched')
TRAIN_MIXTURE = 'test_eval_fixture_train'
if MIXTURE not in seqio.MixtureRegistry.names():
  tasks.add_mixture(MIXTURE, [(t, 1.0) for t in EVAL_TASKS])
  tasks.add_mixture(TRAIN_MIXTURE, [('fixture_glue_rte', 1.0),
                                    ('fixture_glue_mnli', 1.0),
                                    ('fixture_glue_stsb', 1.0)])


def _model():
  cfg = dict(vars(conftest.T5X_TINY_CONFIG))
  cfg.update(num_tasks=8, hyperprompt=conftest.TINY_GLOBAL_PROMPTS)
  return network.Transformer(network.T5Config(**cfg))


# The run's two checkpoints (steps): by the second the model writes labels
# (test_inference_round_trips_through_the_postprocessor checks RTE's).
FIRST, LAST = 20, 40


@pytest.fixture(scope='module')
def run_dir(tmp_path_factory):
  """checkpoint_20 and checkpoint_40 of a tiny run on RTE, MNLI and STS-B
  (built-in runner): long enough to produce labels, not to be right."""
  model_dir = tmp_path_factory.mktemp('eval') / 'run'
  training_loop.train(_model(), settings=run_settings.RunSettings(
      model_dir=str(model_dir), train_steps=LAST, batch_size=16,
      mixture_or_task_name=TRAIN_MIXTURE, task_feature_lengths=LENGTHS,
      save_period=FIRST, log_period=LAST,
      optimizer=optimizers.make_optimizer(learning_rate=1e-2)))
  return model_dir


@pytest.fixture(scope='module')
def evaluated(run_dir):
  out = run_dir.parent / 'eval_out'
  summary = evaluator.evaluate(
      _model(), job=checkpoint_job.CheckpointJob(
          checkpoint_path=str(run_dir), output_dir=str(out),
          mixture_or_task_name=MIXTURE, task_feature_lengths=LENGTHS,
          batch_size=32),
      majority_baseline=True)
  return summary, out


def test_evaluation_of_a_checkpoint_directory(evaluated, run_dir, capsys):
  summary, out = evaluated
  assert sorted(summary['steps'], key=int) == [str(FIRST), str(LAST)]
  step = summary['steps'][str(LAST)]
  assert sorted(step['metrics']) == sorted(EVAL_TASKS)
  assert set(step['metrics']['fixture_glue_stsb']) == {
      'pearson_corrcoef', 'spearman_corrcoef'}
  # MNLI matched / mismatched are one task; fixtures score as their task.
  assert sorted(step['task_scores']) == ['glue_mnli', 'glue_rte', 'glue_stsb']
  np.testing.assert_allclose(
      step['task_scores']['glue_mnli'],
      (step['metrics']['fixture_glue_mnli_matched']['accuracy']
       + step['metrics']['fixture_glue_mnli_mismatched']['accuracy']) / 2)
  stsb = step['metrics']['fixture_glue_stsb']
  np.testing.assert_allclose(step['task_scores']['glue_stsb'],
                             (stsb['pearson_corrcoef']
                              + stsb['spearman_corrcoef']) / 2)
  assert step['averages'] == {}  # not every GLUE task was evaluated
  # The files: seqio's metrics (as t5x writes them), summary, best, plot.
  for task in EVAL_TASKS:
    lines = (out / 'inference_eval' / f'{task}-metrics.jsonl').read_text()
    steps = [json.loads(l)['step'] for l in lines.splitlines()]
    assert steps == [FIRST, LAST]
  assert json.loads((out / 'summary.json').read_text()) == summary
  best = json.loads((out / 'best_per_task.json').read_text())
  assert set(best) == {'tasks', 'averages', 'best_checkpoint'}
  assert set(best['tasks']) == {'glue_mnli', 'glue_rte', 'glue_stsb'}
  assert (out / 'task_scores.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  # Majority class of each evaluation split, scored by the task's metrics.
  assert summary['majority']['glue_rte'] == pytest.approx(50.0)
  assert summary['majority']['glue_stsb'] == 0.0  # constant: no correlation
  assert summary['majority']['glue_mnli'] == pytest.approx(
      (34.0 + 34.0) / 2)


def test_metrics_equal_an_independent_computation_from_predictions(
    evaluated, run_dir, tmp_path):
  summary, _ = evaluated
  written = inference.infer(_model(), job=checkpoint_job.CheckpointJob(
      checkpoint_path=str(run_dir / f'checkpoint_{LAST}'),
      output_dir=str(tmp_path), mixture_or_task_name=MIXTURE,
      task_feature_lengths=LENGTHS, batch_size=32))
  records = {task: [json.loads(l) for l in open(path)]
             for task, path in written.items()}
  got = summary['steps'][str(LAST)]['metrics']
  for task in ('fixture_glue_rte', 'fixture_glue_mnli_matched'):
    targets = [r['target_value'] for r in records[task]]
    preds = [r['prediction_value'] for r in records[task]]
    assert got[task]['accuracy'] == pytest.approx(
        100 * sklearn.metrics.accuracy_score(targets, preds))
  stsb = records['fixture_glue_stsb']
  targets = [r['target_value'] for r in stsb]
  preds = [r['prediction_value'] for r in stsb]
  if np.std(preds) > 0:
    want = 100 * scipy.stats.pearsonr(targets, preds)[0]
  else:  # a constant prediction has no correlation: scored 0
    want = 0.0
  assert got['fixture_glue_stsb']['pearson_corrcoef'] == pytest.approx(
      want, abs=1e-6)


def test_inference_round_trips_through_the_postprocessor(run_dir, tmp_path):
  written = inference.infer(
      _model(), job=checkpoint_job.CheckpointJob(
          checkpoint_path=str(run_dir / f'checkpoint_{LAST}'),
          output_dir=str(tmp_path), mixture_or_task_name='fixture_glue_rte',
          task_feature_lengths=LENGTHS, batch_size=16),
      num_examples=20)
  assert list(written) == ['fixture_glue_rte']
  assert os.path.basename(written['fixture_glue_rte']) == (
      f'fixture_glue_rte-{LAST}.jsonl')
  records = [json.loads(l) for l in open(written['fixture_glue_rte'])]
  assert len(records) == 20
  raw = [json.loads(l) for l in open(os.path.join(
      os.path.dirname(tasks.__file__), 'fixtures', 'glue_rte',
      'validation.jsonl'))][:20]
  labels = ('entailment', 'not_entailment')
  for record, example in zip(records, raw):
    assert record['targets'] == labels[example['label']]
    assert record['inputs'] == (f"rte sentence1: {example['sentence1']} "
                                f"sentence2: {example['sentence2']}")
    assert record['task_id'] == 7  # RTE is GLUE's 8th task
    assert record['target_value'] == example['label']
    assert record['prediction_value'] == (
        postprocessors.string_label_to_class_id(record['prediction'], labels))
  # The run is long enough to write labels (the fixture's promise).
  assert all(r['prediction'] in labels for r in records)


# ------------------------------------------------------- summaries by hand --

GLUE_METRICS = conftest.GLUE_METRICS


def _constructed_results():
  # Step 4 is better on CoLA, MNLI and RTE, worse on the rest (by 2).
  later = {t: {k: v + (4.0 if t in ('glue_cola', 'glue_mnli_matched',
                                    'glue_mnli_mismatched', 'glue_rte')
                       else -2.0) for k, v in m.items()}
           for t, m in GLUE_METRICS.items()}
  return {2: GLUE_METRICS, 4: later}


def test_best_step_per_task_on_a_constructed_case():
  summary = eval_summary.summarize(_constructed_results())
  # Hand computed: (40 + 90 + 86 + 85 + 75 + 81 + 88 + 70) / 8.
  assert summary['steps']['2']['averages'] == {'glue': pytest.approx(76.875)}
  assert summary['steps']['2']['task_scores']['glue_mnli'] == 81.0
  best = eval_summary.best_per_task(summary)
  assert {t: b['step'] for t, b in best['tasks'].items()} == {
      'glue_cola': 4, 'glue_sst2': 2, 'glue_mrpc': 2, 'glue_stsb': 2,
      'glue_qqp': 2, 'glue_mnli': 4, 'glue_qnli': 2, 'glue_rte': 4}
  assert best['tasks']['glue_cola']['score'] == 44.0
  # Best per task: 3 tasks +4 over step 2's scores.
  assert best['averages'] == {'glue': pytest.approx(76.875 + 12 / 8)}
  # The best single checkpoint: step 4 averages 76.875 + (12 - 10) / 8.
  assert best['best_checkpoint']['step'] == 4
  assert best['best_checkpoint']['averages']['glue'] == pytest.approx(77.125)
  table = eval_summary.table(summary)
  assert 'glue average' in table and '77.12' in table and '78.38' in table


def _write_t5x_metrics(directory, results):
  """seqio JSONLogger's layout, as t5x's evaluator writes it."""
  os.makedirs(directory, exist_ok=True)
  for task in sorted({t for r in results.values() for t in r}):
    with open(os.path.join(directory, f'{task}-metrics.jsonl'), 'w') as f:
      for step in sorted(results):
        if task in results[step]:
          f.write(json.dumps({'step': step, **results[step][task]}) + '\n')
    # Inference files sit beside them and are not metrics.
    with open(os.path.join(directory, f'{task}-000002.jsonl'), 'w') as f:
      f.write(json.dumps({'input': {}, 'prediction': 'x'}) + '\n')


def test_t5x_metrics_files_give_the_same_summary(tmp_path):
  results = _constructed_results()
  _write_t5x_metrics(tmp_path / 'inference_eval', results)
  read = eval_summary.read_metrics_dir(str(tmp_path / 'inference_eval'))
  assert eval_summary.summarize(read) == eval_summary.summarize(results)
  # t5x's EVAL_OUTPUT_DIR (the parent of inference_eval/) works as well.
  assert eval_summary.read_metrics_dir(str(tmp_path)) == read
  out = tmp_path / 'summary'
  assert eval_command.main([f'--metrics_dir={tmp_path / "inference_eval"}',
                        f'--output_dir={out}']) == 0
  assert json.loads((out / 'summary.json').read_text()) == (
      eval_summary.summarize(results))


def test_t5x_metrics_of_a_direct_evaluation_give_its_summary(evaluated,
                                                            tmp_path):
  summary, _ = evaluated
  results = {int(s): v['metrics'] for s, v in summary['steps'].items()}
  _write_t5x_metrics(tmp_path, results)
  read = eval_summary.summarize(eval_summary.read_metrics_dir(str(tmp_path)))
  assert read['steps'] == summary['steps']


def test_majority_scores_by_hand():
  mrpc = seqio.get_mixture_or_task('fixture_glue_mrpc')
  # Majority 1: accuracy 2/3, F1 of class 1 = 2*(2/3)/(1 + 2/3) = 0.8.
  assert evaluator.majority_score(mrpc, [1, 1, 0]) == pytest.approx(
      (100 * 2 / 3 + 80) / 2)
  cola = seqio.get_mixture_or_task('fixture_glue_cola')
  assert evaluator.majority_score(cola, [1, 0, 1, 1]) == 0.0
  multirc = seqio.get_mixture_or_task('fixture_super_glue_multirc')
  targets = [{'group': 0, 'value': 1}, {'group': 0, 'value': 0},
             {'group': 1, 'value': 0}, {'group': 1, 'value': 0}]
  # Predict 0 everywhere: exact match on question 1 only (50), F1a 0.
  assert evaluator.majority_score(multirc, targets) == pytest.approx(25.0)


# ---------------------------------------------------------------- bad input --

def _evaluate(tmp_path, **overrides):
  """`evaluate` of the fixture mixture; `overrides` of the job's fields
  and of evaluate's own arguments."""
  fields = {f.name for f in dataclasses.fields(checkpoint_job.CheckpointJob)}
  job = dict(checkpoint_path=str(tmp_path), output_dir=str(tmp_path / 'out'),
             mixture_or_task_name=MIXTURE, task_feature_lengths=LENGTHS)
  job.update({k: v for k, v in overrides.items() if k in fields})
  return evaluator.evaluate(
      _model(), job=checkpoint_job.CheckpointJob(**job),
      **{k: v for k, v in overrides.items() if k not in fields})


def test_empty_checkpoint_directory_is_a_clear_error(tmp_path):
  (tmp_path / 'empty').mkdir()
  with pytest.raises(FileNotFoundError, match='holds no checkpoint_<step>'):
    _evaluate(tmp_path, checkpoint_path=str(tmp_path / 'empty'))
  with pytest.raises(FileNotFoundError, match='does not exist'):
    _evaluate(tmp_path, checkpoint_path=str(tmp_path / 'nowhere'))


def test_an_unreadable_checkpoint_is_skipped_and_reported(run_dir, tmp_path):
  """A damaged checkpoint (its array files cut short) among good ones: the
  good one is still evaluated and summarised, the bad one listed."""
  checkpoints = tmp_path / 'run'
  for step in (FIRST, LAST):
    shutil.copytree(run_dir / f'checkpoint_{step}',
                    checkpoints / f'checkpoint_{step}')
  for p in (checkpoints / f'checkpoint_{LAST}' / 'state').rglob('*'):
    if p.is_file() and p.parent.name == 'd':
      os.truncate(p, p.stat().st_size // 2)
  summary = _evaluate(tmp_path, checkpoint_path=str(checkpoints),
                      mixture_or_task_name='fixture_glue_rte')
  assert list(summary['steps']) == [str(FIRST)]
  assert list(summary['unreadable_checkpoints']) == [str(LAST)]
  written = json.loads((tmp_path / 'out' / 'summary.json').read_text())
  assert written['unreadable_checkpoints'] == summary['unreadable_checkpoints']
  assert 'fixture_glue_rte' in written['steps'][str(FIRST)]['metrics']


def test_a_checkpoint_deleted_while_eval_runs_is_not_unreadable(
    run_dir, tmp_path, monkeypatch):
  """A training run beside eval removes its old checkpoints (its
  KEEP_CHECKPOINTS): skipped with a warning, not reported as damaged."""
  checkpoints = tmp_path / 'run'
  for step in (FIRST, LAST):
    shutil.copytree(run_dir / f'checkpoint_{step}',
                    checkpoints / f'checkpoint_{step}')
  restore = evaluator.checkpoints.restore_params

  def restore_after_the_trainer_deleted_the_last(path, *args, **kwargs):
    shutil.rmtree(checkpoints / f'checkpoint_{LAST}', ignore_errors=True)
    return restore(path, *args, **kwargs)

  monkeypatch.setattr(evaluator.checkpoints, 'restore_params',
                      restore_after_the_trainer_deleted_the_last)
  summary = _evaluate(tmp_path, checkpoint_path=str(checkpoints),
                      mixture_or_task_name='fixture_glue_rte')
  assert list(summary['steps']) == [str(FIRST)]
  assert 'unreadable_checkpoints' not in summary


def test_an_unlabelled_split_is_refused_before_any_checkpoint(run_dir,
                                                            tmp_path):
  """GLUE's test labels are hidden (-1): scoring them ended in an sklearn
  error; now one error names the tasks and the leaderboard."""
  with pytest.raises(ValueError, match=r"The 'test' split of "
                     r'fixture_glue_mnli_matched, fixture_glue_mnli_mismatched'
                     r', fixture_glue_rte, fixture_glue_stsb has no labels.*'
                     r'hyperprompt_jax.leaderboard'):
    _evaluate(tmp_path, checkpoint_path=str(run_dir), split='test')


def test_unlabelled_targets_by_hand():
  assert evaluator._unlabelled([-1, -1])  # GLUE / SuperGLUE classes
  assert evaluator._unlabelled([-1.0])  # STS-B
  assert evaluator._unlabelled([{'group': 0, 'value': -1}])  # MultiRC
  assert evaluator._unlabelled([[], []])  # ReCoRD: no answers
  assert not evaluator._unlabelled([-1, 0])
  assert not evaluator._unlabelled([{'group': 0, 'value': 1}])
  assert not evaluator._unlabelled([['an answer']])
  assert not evaluator._unlabelled(['free text'])


def test_unknown_task_is_a_clear_error(run_dir, tmp_path):
  with pytest.raises(ValueError, match="Unknown MIXTURE_OR_TASK_NAME 'glue_rt'"):
    _evaluate(tmp_path, checkpoint_path=str(run_dir),
              mixture_or_task_name='glue_rt')


def test_unwritable_output_dir_is_a_clear_error(run_dir, tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('x')
  with pytest.raises(ValueError, match='EVAL_OUTPUT_DIR .* is not writable'):
    _evaluate(tmp_path, checkpoint_path=str(run_dir),
              output_dir=str(blocker / 'out'))
  with pytest.raises(ValueError, match='INFER_OUTPUT_DIR .* is not writable'):
    inference.infer(_model(), job=checkpoint_job.CheckpointJob(
        checkpoint_path=str(run_dir / f'checkpoint_{FIRST}'),
        output_dir=str(blocker / 'out'), mixture_or_task_name=MIXTURE,
        task_feature_lengths=LENGTHS))


def test_metrics_dir_without_metrics_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match='holds no <task>-metrics.jsonl'):
    eval_summary.read_metrics_dir(str(tmp_path))
  with pytest.raises(FileNotFoundError, match='No metrics directory'):
    eval_summary.read_metrics_dir(str(tmp_path / 'nowhere'))



# ---------------------------------------------------------------- run files --

def _parsed_model(files, macros=()):
  from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
  import gin  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  try:
    gin_utils.parse_gin(files, [], [])
    config = gin.get_configurable(network.Transformer)().config
    return config, {m: gin.query_parameter(f'%{m}') for m in macros}
  finally:
    gin.clear_config()


def test_quickstart_eval_and_infer_files_build_the_trained_model():
  trained, _ = _parsed_model(['runs/quickstart.gin'])
  evaluated, macros = _parsed_model(
      ['runs/quickstart_eval.gin'],
      ['CHECKPOINT_PATH', 'MIXTURE_OR_TASK_NAME', 'MAJORITY_BASELINE'])
  assert evaluated == trained
  assert macros['CHECKPOINT_PATH'] == '/tmp/hyperprompt_quickstart'
  assert macros['MIXTURE_OR_TASK_NAME'] == (
      'fixture_glue_super_glue_proportional')
  assert macros['MAJORITY_BASELINE'] is True
  inferred, macros = _parsed_model(['runs/quickstart_infer.gin'],
                                   ['CHECKPOINT_PATH'])
  assert inferred == trained
  assert macros['CHECKPOINT_PATH'].endswith('/checkpoint_1300')


def test_evaluating_a_step_again_replaces_its_metrics_line(tmp_path):
  # A re-run into the same EVAL_OUTPUT_DIR: seqio's JSONLogger would append
  # a second line for the step.
  path = tmp_path / 'glue_rte-metrics.jsonl'
  path.write_text('{"step": 100, "accuracy": 40.0}\n'
                  '{"step": 200, "accuracy": 45.0}\n')
  logger = evaluator.json_logger_cls(0)(str(tmp_path))
  for accuracy in (50.0, 60.0):
    logger(task_name='glue_rte', step=200,
           metrics={'accuracy': seqio.metrics.Scalar(accuracy)},
           dataset=None, inferences=None, targets=None)
  logger(task_name='glue_rte', step=300,
         metrics={'accuracy': seqio.metrics.Scalar(70.0)},
         dataset=None, inferences=None, targets=None)
  assert [json.loads(line) for line in path.read_text().splitlines()] == [
      {'step': 100, 'accuracy': 40.0}, {'step': 200, 'accuracy': 60.0},
      {'step': 300, 'accuracy': 70.0}]


def test_several_runs_in_one_command(run_dir, tmp_path):
  """Two runs (here copies of one, with a checkpoint each) evaluated in one
  call: each run's files in its folder, the aggregate above them."""
  runs = []
  for name, step in (('seed0', FIRST), ('seed1', LAST)):
    shutil.copytree(run_dir / f'checkpoint_{step}',
                    tmp_path / name / f'checkpoint_{step}')
    runs.append(str(tmp_path / name))
  summary = _evaluate(tmp_path, checkpoint_path=runs,
                      mixture_or_task_name='fixture_glue_rte',
                      selection='last')
  out = tmp_path / 'out'
  per_run = {name: json.loads((out / name / 'summary.json').read_text())
             for name in ('seed0', 'seed1')}
  assert per_run['seed0']['selection']['step'] == FIRST
  assert per_run['seed1']['selection']['step'] == LAST
  rte = [per_run[n]['selection']['tasks']['glue_rte']['score']
         for n in ('seed0', 'seed1')]
  stats = summary['aggregate']['tasks']['glue_rte']
  assert stats['mean'] == pytest.approx(np.mean(rte))
  assert stats['std'] == pytest.approx(np.std(rte, ddof=1))
  assert json.loads((out / 'summary.json').read_text()) == summary
  assert (out / 'seed0' / 'inference_eval' /
          'fixture_glue_rte-metrics.jsonl').exists()
  with pytest.raises(ValueError, match="lacks \\['glue_cola'"):
    _evaluate(tmp_path, checkpoint_path=runs,
              mixture_or_task_name='fixture_glue_rte',
              selection='best_average')
