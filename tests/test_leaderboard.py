"""Test-server files: each format against a hand-written expected file, and
the command on a checkpoint over the fixtures' test splits."""

import json
import pathlib

import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from hyperprompt_jax.evaluation import checkpoint_job
from hyperprompt_jax.evaluation import submission_files
from hyperprompt_jax.model import network
from hyperprompt_jax.tasks import fixture_data

import conftest

EXPECTED = pathlib.Path(__file__).parent / 'testdata' / 'leaderboard'


def _records(idx_and_values):
  return [{'idx': i, 'prediction_value': v} for i, v in idx_and_values]


# Each task's hand-made predictions (postprocessed values, out of idx
# order, invalid ones included) and the file the servers take.
CASES = {
    'glue_cola': (_records([(2, -1), (0, 1), (1, 0)]), 1),
    'glue_stsb': (_records([(1, -1.0), (0, 4.25), (3, -1.0), (2, 7.5)]), 2),
    'glue_mnli_mismatched': (_records([(1, 2), (0, 0), (2, 1)]), 0),
    'glue_qnli': (_records([(1, 0), (0, 1)]), 0),
    'super_glue_boolq': (_records([(1, 0), (0, 1)]), 0),
    'super_glue_cb': (_records([(2, 1), (0, 2), (1, 0)]), 0),
    'super_glue_copa': (_records([(1, 0), (0, 1)]), 0),
    'super_glue_wsc': (_records([(2, -1), (0, 1), (1, 0)]), 1),
    'super_glue_record': ([
        {'idx': {'passage': 5, 'query': 7}, 'prediction_value':
         {'value': 'dog'}},
        {'idx': {'passage': 1, 'query': 3}, 'prediction_value':
         {'value': 'the owl'}}], 0),
    'super_glue_multirc': ([
        {'idx': {'paragraph': 1, 'question': 2, 'answer': 0},
         'prediction_value': {'value': 1}},
        {'idx': {'paragraph': 0, 'question': 0, 'answer': 1},
         'prediction_value': {'value': 0}},
        {'idx': {'paragraph': 0, 'question': 1, 'answer': 0},
         'prediction_value': {'value': -1}},
        {'idx': {'paragraph': 0, 'question': 0, 'answer': 0},
         'prediction_value': {'value': 1}}], 1),
}


@pytest.mark.parametrize('task', sorted(CASES))
def test_each_format_equals_its_hand_written_file(task):
  records, invalid = CASES[task]
  name, content, replaced = submission_files.format_file(task, records)
  assert content == (EXPECTED / name).read_text(), name
  assert replaced == invalid


def test_fixture_tasks_write_their_benchmark_file():
  assert submission_files.file_task('fixture_glue_mnli_matched') == (
      'glue_mnli_matched')
  assert submission_files.file_task('super_glue_wsc_simple_train') is None
  assert submission_files.FILES['glue_mnli_matched'][0] == 'MNLI-m.tsv'


def test_the_command_on_the_fixtures_test_splits(tmp_path):
  """A tiny checkpoint (random parameters: predictions mostly invalid),
  three tasks: one row per test example, in idx order, every file's
  invalid predictions counted."""
  cfg = conftest.T5X_TINY_CONFIG
  model = network.Transformer(cfg.__class__(**{**vars(cfg),
                                               'num_tasks': 16}))
  params = jax.device_get(network.init_variables(
      model, jax.random.PRNGKey(0), 8, 4)['params'])
  ocp.PyTreeCheckpointer().save(tmp_path / 'checkpoint_3' / 'state',
                                {'params': params, 'step': np.int32(3)})
  gin.clear_config()
  gin.bind_parameter('hyperprompt_jax.tasks.task_ids.run_task_list.benchmark',
                     'glue_super_glue')
  from hyperprompt_jax import tasks  # pylint: disable=g-import-not-at-top
  mixture = 'test_leaderboard_mix'
  import seqio  # pylint: disable=g-import-not-at-top
  if mixture not in seqio.MixtureRegistry.names():
    tasks.add_mixture(mixture, [('fixture_glue_mnli_matched', 1.0),
                                ('fixture_super_glue_multirc', 1.0),
                                ('fixture_super_glue_record', 1.0)])
  try:
    summary = submission_files.write_files(model, job=checkpoint_job.CheckpointJob(
        checkpoint_path=str(tmp_path / 'checkpoint_3'),
        output_dir=str(tmp_path / 'out'), mixture_or_task_name=mixture,
        task_feature_lengths={'inputs': 128, 'targets': 8}, split='test',
        batch_size=8))
  finally:
    gin.clear_config()
  out = tmp_path / 'out'
  n = fixture_data.TEST
  mnli = (out / 'MNLI-m.tsv').read_text().splitlines()
  assert mnli[0] == 'index\tprediction'
  assert [int(l.split('\t')[0]) for l in mnli[1:]] == list(range(n))
  assert all(l.split('\t')[1] in submission_files._NLI3 for l in mnli[1:])
  multirc = [json.loads(l) for l in (out / 'MultiRC.jsonl').read_text()
             .splitlines()]
  assert [p['idx'] for p in multirc] == list(range(n // 2))
  assert all(len(p['passage']['questions'][0]['answers']) == 2
             for p in multirc)
  record = [json.loads(l) for l in (out / 'ReCoRD.jsonl').read_text()
            .splitlines()]
  assert [r['idx'] for r in record] == list(range(n))
  written = json.loads((out / 'leaderboard_summary.json').read_text())
  assert written == json.loads(json.dumps(summary))
  assert written['files']['MNLI-m.tsv']['examples'] == n
  assert 0 <= written['files']['MNLI-m.tsv'][
      'invalid_predictions_replaced'] <= n
  assert 'WNLI.tsv' in written['missing']['glue']
  assert 'CoLA.tsv' in written['missing']['glue']


def test_a_mixture_without_server_tasks_is_refused(tmp_path):
  (tmp_path / 'checkpoint_1').mkdir()
  with pytest.raises(ValueError, match="no GLUE / SuperGLUE task with a "
                     "'test' split"):
    submission_files.write_files(
        network.Transformer(conftest.T5X_TINY_CONFIG.__class__(
            **{**vars(conftest.T5X_TINY_CONFIG), 'num_tasks': 8})),
        job=checkpoint_job.CheckpointJob(
            checkpoint_path=str(tmp_path / 'checkpoint_1'),
            output_dir=str(tmp_path / 'out'),
            mixture_or_task_name='fixture_super_glue_wsc_simple_train',
            task_feature_lengths={'inputs': 64, 'targets': 8},
            split='test'))
