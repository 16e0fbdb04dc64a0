"""Checkpoint selection protocols and runs over seeds, against hand-computed
selections and numpy statistics (`eval_summary.select`, `aggregate`)."""

import json

import numpy as np
import pytest

from hyperprompt_jax import eval as eval_command
from hyperprompt_jax.evaluation import eval_summary
from hyperprompt_jax.evaluation import evaluator
from hyperprompt_jax.evaluation import run_config as protocol

import conftest

BASE = conftest.GLUE_METRICS
BASE_SCORES = {'glue_cola': 40.0, 'glue_sst2': 90.0, 'glue_mrpc': 86.0,
               'glue_stsb': 85.0, 'glue_qqp': 75.0, 'glue_mnli': 81.0,
               'glue_qnli': 88.0, 'glue_rte': 70.0}  # GLUE average 76.875


def _shift(metrics, by):
  return {t: {k: v + by(t) for k, v in m.items()} for t, m in metrics.items()}


def _results():
  """Step 2: BASE. Step 4: CoLA, MNLI, RTE +4, the rest -2 (GLUE 77.125).
  Step 6: step 4 again (a tie). Step 8: BASE + 1 without RTE (no GLUE
  average; mean of its 7 tasks (545 + 7) / 7)."""
  step4 = _shift(BASE, lambda t: 4.0 if t in (
      'glue_cola', 'glue_mnli_matched', 'glue_mnli_mismatched', 'glue_rte')
                 else -2.0)
  step8 = _shift({t: m for t, m in BASE.items() if t != 'glue_rte'},
                 lambda t: 1.0)
  return {2: BASE, 4: step4, 6: step4, 8: step8}


@pytest.fixture(scope='module')
def summary():
  return eval_summary.summarize(_results())


def _steps(selection):
  return {t: v['step'] for t, v in selection['tasks'].items()}


def _scores(selection):
  return {t: v['score'] for t, v in selection['tasks'].items()}


def test_best_per_task_reads_each_task_at_its_best_step(summary):
  got = eval_summary.select(summary, 'best_per_task')
  # Hand-picked: CoLA 44 at 4 (6 ties, the earliest wins), SST-2 91 at 8,
  # MRPC 87, STS-B 86, QQP 76, QNLI 89 at 8, MNLI (86 + 84) / 2 = 85 at 4,
  # RTE 74 at 4.
  assert _steps(got) == {
      'glue_cola': 4, 'glue_sst2': 8, 'glue_mrpc': 8, 'glue_stsb': 8,
      'glue_qqp': 8, 'glue_mnli': 4, 'glue_qnli': 8, 'glue_rte': 4}
  assert _scores(got) == {
      'glue_cola': 44.0, 'glue_sst2': 91.0, 'glue_mrpc': 87.0,
      'glue_stsb': 86.0, 'glue_qqp': 76.0, 'glue_mnli': 85.0,
      'glue_qnli': 89.0, 'glue_rte': 74.0}
  assert got['averages'] == {'glue': pytest.approx(632 / 8)}
  assert got['step'] is None and got['missing'] == []


def test_best_average_reads_every_task_at_the_best_glue_step(summary):
  got = eval_summary.select(summary, 'best_average', 'glue')
  # Steps 4 and 6 tie at 77.125 (step 8 has no GLUE average): the earlier.
  assert got['step'] == 4 and got['benchmark'] == 'glue'
  assert set(_steps(got).values()) == {4}
  assert got['tasks']['glue_mnli']['score'] == 85.0
  assert got['tasks']['glue_sst2']['score'] == 88.0
  assert got['averages'] == {'glue': pytest.approx(76.875 + (12 - 10) / 8)}


def test_best_average_over_all_tasks_may_pick_an_incomplete_step(summary):
  got = eval_summary.select(summary, 'best_average', 'all')
  # Step 8's 7 tasks average (545 + 7) / 7 = 78.86 > 77.125.
  assert got['step'] == 8
  assert got['missing'] == ['glue_rte']
  assert got['averages'] == {}  # GLUE needs RTE


def test_last_reads_the_newest_step_and_names_what_it_lacks(summary):
  got = eval_summary.select(summary, 'last')
  assert got['step'] == 8
  assert _scores(got) == {t: s + 1 for t, s in BASE_SCORES.items()
                          if t != 'glue_rte'}
  assert got['missing'] == ['glue_rte']
  text = eval_summary.table(summary | {'selection': got})
  assert 'Not evaluated at step 8: glue_rte' in text


def test_summary_keeps_every_applicable_protocol(summary):
  assert summary['selection']['protocol'] == 'best_per_task'
  assert set(summary['selections']) == set(eval_summary.SELECTIONS)
  only_superglue = eval_summary.summarize(
      {2: {'super_glue_cb': {'accuracy': 80.0, 'f1_multiclass': 70.0}}})
  # best_average on GLUE does not apply to a SuperGLUE-only evaluation.
  assert set(only_superglue['selections']) == {'best_per_task', 'last'}


def test_selection_errors_name_the_fix():
  results = {2: {'super_glue_cb': {'accuracy': 80.0}}}
  with pytest.raises(ValueError, match=r"missing: \['glue_cola'.*"
                     r"SELECTION_BENCHMARK"):
    eval_summary.summarize(results, selection='best_average')
  with pytest.raises(ValueError, match="SELECTION='best'; expected one of"):
    eval_summary.summarize(results, selection='best')
  with pytest.raises(ValueError, match="SELECTION_BENCHMARK='gleu'"):
    eval_summary.summarize(results, selection='best_average',
                           benchmark='gleu')


def test_table_shows_the_selection_and_the_other_protocols(summary):
  text = eval_summary.table(eval_summary.summarize(
      _results(), selection='best_average'))
  assert text.splitlines()[0] == (
      'best_average: one checkpoint, the best glue average (step 4)')
  assert 'glue average' in text and '77.12' in text
  assert 'best_per_task: each task at its best checkpoint: glue 79.00' in text


# ------------------------------------------------------------ several runs --

RUN_SCORES = {  # run -> its single evaluation, task scores by hand
    'seed0': {'glue_rte': 70.0, 'glue_cola': 40.0, 'super_glue_cb': 80.0},
    'seed1': {'glue_rte': 74.0, 'glue_cola': 46.0},
    'seed2': {'glue_rte': 66.0, 'glue_cola': 43.0, 'super_glue_cb': 90.0},
}


def _run_summaries():
  return {run: eval_summary.summarize(
      {100: {t: {'accuracy': s} for t, s in scores.items()}})
          for run, scores in RUN_SCORES.items()}


def test_aggregate_equals_numpy_statistics():
  agg = eval_summary.aggregate(_run_summaries())
  for task in ('glue_rte', 'glue_cola'):
    values = np.array([RUN_SCORES[r][task] for r in RUN_SCORES])
    got = agg['tasks'][task]
    assert got['mean'] == pytest.approx(np.mean(values))
    assert got['std'] == pytest.approx(np.std(values, ddof=1))
    assert (got['min'], got['max'], got['n']) == (values.min(), values.max(),
                                                  3)
  # RTE: 70, 74, 66 -> mean 70, sample std sqrt((0 + 16 + 16) / 2) = 4.
  assert agg['tasks']['glue_rte']['std'] == pytest.approx(4.0)
  # A task two runs have: aggregated over those two.
  cb = agg['tasks']['super_glue_cb']
  assert (cb['n'], cb['mean'], cb['runs']) == (2, 85.0, {'seed0': 80.0,
                                                         'seed2': 90.0})
  assert cb['std'] == pytest.approx(np.std([80.0, 90.0], ddof=1))


def test_aggregate_of_averages_and_the_best_run():
  runs = {}
  for run, offset in (('a', 0.0), ('b', 3.0), ('c', -1.0), ('d', 3.0)):
    runs[run] = eval_summary.summarize(
        {10: _shift(BASE, lambda t, o=offset: o)})
  agg = eval_summary.aggregate(runs)
  glue = np.array([76.875, 79.875, 75.875, 79.875])
  assert agg['averages']['glue']['mean'] == pytest.approx(glue.mean())
  assert agg['averages']['glue']['std'] == pytest.approx(glue.std(ddof=1))
  assert agg['averages']['glue']['max'] == pytest.approx(79.875)
  assert agg['best_run'] == {'glue': 'b'}  # b and d tie: the first
  one = eval_summary.aggregate({'a': runs['a']})
  assert one['averages']['glue']['std'] is None  # undefined for one run


def test_runs_with_different_selections_are_refused():
  runs = _run_summaries()
  runs['seed1'] = eval_summary.summarize(
      {100: {'glue_rte': {'accuracy': 1.0}}}, selection='last')
  with pytest.raises(ValueError, match='different selections'):
    eval_summary.aggregate(runs)


def test_several_metrics_dirs_are_summarised_and_aggregated(tmp_path, capsys):
  dirs = []
  for run, scores in RUN_SCORES.items():
    d = tmp_path / run / 'eval' / 'inference_eval'
    d.mkdir(parents=True)
    for task, score in scores.items():
      for step, s in ((100, score - 5), (200, score)):
        with open(d / f'{task}-metrics.jsonl', 'a') as f:
          f.write(json.dumps({'step': step, 'accuracy': s}) + '\n')
    dirs.append(str(d))
  out = tmp_path / 'summary'
  assert eval_command.main(['--metrics_dir', *dirs, f'--output_dir={out}',
                        '--selection=last']) == 0
  # Names: the folder above eval/inference_eval collide ('eval'): run<i>.
  written = json.loads((out / 'summary.json').read_text())
  assert list(written['runs']) == ['run0', 'run1', 'run2']
  assert written['selection'] == 'last'
  rte = written['aggregate']['tasks']['glue_rte']
  assert rte['mean'] == pytest.approx(70.0) and rte['std'] == pytest.approx(4)
  for run in ('run0', 'run1', 'run2'):
    per_run = json.loads((out / run / 'summary.json').read_text())
    assert per_run['selection']['step'] == 200
  assert (out / 'task_scores.png').read_bytes()[:4] == b'\x89PNG'
  printed = capsys.readouterr().out
  assert '3 runs; last: every task at the last checkpoint' in printed
  assert '70.00 ± 4.00' in printed
  with pytest.raises(ValueError, match='need an --output_dir'):
    eval_command.main(['--metrics_dir', *dirs])


def test_run_names():
  assert evaluator.run_names(['/r/seed0', 'gs://b/seed1/']) == ['seed0',
                                                               'seed1']
  assert evaluator.run_names(['/a/run/inference_eval', '/a/x']) == ['run', 'x']
  assert evaluator.run_names(['/a/run', '/b/run']) == ['run0', 'run1']


# ---------------------------------------------------------------- gin files --

def _macros(files):
  from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
  import gin  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  try:
    gin_utils.parse_gin(files, [], [])
    return (gin.query_parameter('%SELECTION'),
            gin.query_parameter('%SELECTION_BENCHMARK'))
  finally:
    gin.clear_config()


@pytest.mark.parametrize('setup, expected', [
    ('hypergrid_l2_glue_super_glue', ('best_average', 'glue')),
    ('hypergrid_lg_glue_super_glue', ('best_average', 'glue')),
    ('mtl_glue_super_glue', ('last', None)),
    ('hyperprompt_global_glue', ('best_per_task', None)),
    ('adapter_super_glue', ('best_per_task', None)),
])
def test_setup_files_set_their_papers_selection(setup, expected):
  assert _macros(['runs/eval.gin', f'setups/{setup}.gin']) == (
      expected)
  # The other order leaves the protocol to the run's record (below).
  assert _macros([f'setups/{setup}.gin', 'runs/eval.gin']) == (
      None, None)


def test_quickstart_eval_takes_the_runs_protocol():
  assert _macros(['runs/quickstart_eval.gin']) == (None, None)


# ------------------------------------------------ the protocol a run records --

# What t5x.train writes to MODEL_DIR/config.gin (gin.config_str(): imports,
# configurables, then macros), abridged.
T5X_TRAIN_CONFIG = """from __gin__ import dynamic_registration
import __main__ as train_script
from t5x import utils

# Macros:
# ==============================================================================
BATCH_SIZE = 128
MIXTURE_OR_TASK_NAME = 'glue_super_glue_proportional'
SELECTION = 'best_average'
SELECTION_BENCHMARK = 'super_glue'
TASK_FEATURE_LENGTHS = {'inputs': 512, 'targets': 32}

# Parameters for train_script.train:
# ==============================================================================
train_script.train.model = %MODEL
train_script.train.train_dataset_cfg = @train/utils.DatasetConfig()
"""


def test_config_macros_reads_literal_macros_only():
  macros = protocol.config_macros(T5X_TRAIN_CONFIG)
  assert macros == {'BATCH_SIZE': 128,
                    'MIXTURE_OR_TASK_NAME': 'glue_super_glue_proportional',
                    'SELECTION': 'best_average',
                    'SELECTION_BENCHMARK': 'super_glue',
                    'TASK_FEATURE_LENGTHS': {'inputs': 512, 'targets': 32}}


def _t5x_eval_output(tmp_path, run_config):
  """A t5x run and its t5x eval output: the run's config, the eval's config
  naming the run, and metrics where the protocols pick differently
  (`_results`: the best GLUE average at step 4, SST-2's best score at 8)."""
  run = tmp_path / 'run'
  run.mkdir()
  if run_config is not None:
    (run / 'config.gin').write_text(run_config)
  out = tmp_path / 'eval'
  metrics = out / 'inference_eval'
  metrics.mkdir(parents=True)
  (out / 'config.gin').write_text(
      f"CHECKPOINT_PATH = '{run}'\nEVAL_OUTPUT_DIR = '{out}'\n")
  for step, results in _results().items():
    for task, values in results.items():
      with open(metrics / f'{task}-metrics.jsonl', 'a') as f:
        f.write(json.dumps({'step': step, **values}) + '\n')
  return run, out


@pytest.fixture
def protocol_log(caplog):
  """The protocol lines, whatever `log_to_stdout` did to their logger."""
  caplog.set_level('INFO', logger=protocol.log.name)
  protocol.log.addHandler(caplog.handler)
  yield caplog
  protocol.log.removeHandler(caplog.handler)


def test_metrics_dir_is_scored_with_the_runs_protocol(tmp_path, protocol_log):
  caplog = protocol_log
  config = T5X_TRAIN_CONFIG.replace("'super_glue'", "'glue'")
  _, out = _t5x_eval_output(tmp_path, config)
  assert eval_command.main([f'--metrics_dir={out / "inference_eval"}']) == 0
  written = json.loads((out / 'inference_eval' / 'summary.json').read_text())
  assert written['selection']['protocol'] == 'best_average'
  assert written['selection']['step'] == 4  # GLUE 77.125 vs 76.875 at 2
  assert 'as the run records' in caplog.text
  # Given explicitly and different from the run's: scored so, and said.
  caplog.clear()
  assert eval_command.main([f'--metrics_dir={out}',
                            '--selection=best_per_task']) == 0
  written = json.loads((out / 'summary.json').read_text())
  assert written['selection']['protocol'] == 'best_per_task'
  assert _steps(written['selection'])['glue_sst2'] == 8  # 91 there
  assert 'though the run records best_average' in caplog.text


def test_an_unrecorded_protocol_is_the_default_and_said(tmp_path,
                                                        protocol_log):
  _, out = _t5x_eval_output(tmp_path, None)
  assert eval_command.main([f'--metrics_dir={out}']) == 0
  written = json.loads((out / 'summary.json').read_text())
  assert written['selection']['protocol'] == 'best_per_task'
  assert 'the run records none' in protocol_log.text


def test_the_protocol_of_a_checkpoint_is_its_runs(tmp_path):
  run = tmp_path / 'run'
  run.mkdir()
  (run / 'config.gin').write_text(T5X_TRAIN_CONFIG)
  expected = protocol.Protocol('best_average', 'super_glue')
  for path in (run, run / 'checkpoint_300', f'{run}/'):
    assert protocol.resolve(None, None, [str(path)]) == expected
  assert protocol.resolve('last', None, [str(run)]) == protocol.Protocol(
      'last', 'super_glue')
  other = tmp_path / 'other'
  other.mkdir()
  (other / 'config.gin').write_text("SELECTION = 'last'\n")
  with pytest.raises(ValueError, match='record different evaluation'):
    protocol.resolve(None, None, [str(run), str(other)])
  assert protocol.resolve('last', 'glue', [str(run), str(other)]) == (
      protocol.Protocol('last', 'glue'))


def test_a_checkpoint_job_takes_the_runs_model_parallelism(tmp_path):
  from hyperprompt_jax.evaluation import checkpoint_job  # pylint: disable=g-import-not-at-top
  run = tmp_path / 'run'
  run.mkdir()
  (run / 'config.gin').write_text(
      T5X_TRAIN_CONFIG.replace('BATCH_SIZE = 128', 'MESH_MODEL = 8'))
  job = lambda **kw: checkpoint_job.CheckpointJob(
      str(run / 'checkpoint_300'), str(tmp_path / 'out'), 'glue_rte',
      {'inputs': 8, 'targets': 4}, **kw)
  assert job().model_parallelism() == 8  # the run's
  assert job(mesh_model=2).model_parallelism() == 2  # given
  (run / 'config.gin').write_text(T5X_TRAIN_CONFIG)
  assert job().model_parallelism() == 1  # not recorded
