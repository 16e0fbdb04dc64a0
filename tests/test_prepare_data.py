"""`python -m hyperprompt_jax.prepare_data`: the TFDS datasets of a mixture,
listed and prepared with TFDS's real builders (the download replaced by
local files; no network is used)."""

import importlib.util
import socket
from unittest import mock

import gin
import pytest
import tensorflow_datasets as tfds

from hyperprompt_jax import prepare_data
from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.tasks import prepare
import tfds_sources

# Written by hand from the tasks' TFDS names (tasks/glue.py,
# tasks/super_glue.py): what the joint mixture reads.
GLUE = ['glue/cola:2.0.0', 'glue/mnli:2.0.0', 'glue/mrpc:2.0.0',
        'glue/qnli:2.0.0', 'glue/qqp:2.0.0', 'glue/rte:2.0.0',
        'glue/sst2:2.0.0', 'glue/stsb:2.0.0']
SUPER_GLUE = ['definite_pronoun_resolution:1.1.0', 'super_glue/boolq:1.0.2',
              'super_glue/cb:1.0.2', 'super_glue/copa:1.0.2',
              'super_glue/multirc:1.0.2', 'super_glue/record:1.0.2',
              'super_glue/rte:1.0.2', 'super_glue/wic:1.0.2',
              'super_glue/wsc.fixed:1.0.2']


@pytest.fixture(autouse=True)
def _clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def _names(mixture):
  return [d.tfds_name for d in prepare.datasets_of(mixture)]


def test_each_mixture_resolves_to_its_datasets():
  assert _names('glue_super_glue_proportional') == sorted(GLUE + SUPER_GLUE)
  assert len(_names('glue_super_glue_proportional')) == 17
  assert _names('glue_proportional') == GLUE
  assert _names('super_glue_proportional') == SUPER_GLUE
  by_name = {d.tfds_name: d.tasks
             for d in prepare.datasets_of('super_glue_proportional')}
  # DPR is WSC's second training set, in SuperGLUE's mixture.
  assert by_name['definite_pronoun_resolution:1.1.0'] == ('dpr_simple',)
  assert by_name['super_glue/wsc.fixed:1.0.2'] == (
      'super_glue_wsc', 'super_glue_wsc_simple_train')
  assert prepare.datasets_of('glue_proportional')[1].tasks == (
      'glue_mnli', 'glue_mnli_matched', 'glue_mnli_mismatched')
  assert _names('glue_rte') == ['glue/rte:2.0.0']
  assert _names('fixture_glue_super_glue_proportional') == []


def _offline_download(result=None, error=None):
  """TFDS's download replaced: returns `result` or raises `error`."""
  return mock.patch.object(tfds.download.DownloadManager,
                           'download_and_extract', return_value=result,
                           side_effect=error)


def _network(up: bool):
  return mock.patch.object(prepare, 'can_reach', return_value=up)


def _lines(capsys):
  return capsys.readouterr().out.splitlines()


def test_an_empty_directory_lists_every_dataset_missing(tmp_path, capsys):
  assert prepare_data.main(['--mixture=glue_super_glue_proportional',
                            f'--data_dir={tmp_path}']) == 1
  lines = _lines(capsys)
  assert lines[0] == (f'TFDS datasets of glue_super_glue_proportional in '
                      f'{tmp_path}:')
  states = [line.split()[:2] for line in lines[1:18]]
  assert states == [['missing', n] for n in sorted(GLUE + SUPER_GLUE)]
  assert lines[18] == '0 of 17 prepared.'
  assert '--prepare' in lines[19]
  assert list(tmp_path.iterdir()) == []  # listing writes nothing


def test_a_dataset_prepared_by_tfds_is_listed_prepared(tmp_path, capsys):
  data_dir = tmp_path / 'data'
  builder = tfds.builder('glue/rte:2.0.0', data_dir=str(data_dir))
  with _offline_download(tfds_sources.rte_download(tmp_path)):
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  capsys.readouterr()  # TFDS's own lines
  assert prepare_data.main(['--list', '--mixture=glue_proportional',
                            f'--data_dir={data_dir}']) == 1
  lines = _lines(capsys)
  assert [line.split()[:2] for line in lines[1:9]] == [
      ['prepared' if n == 'glue/rte:2.0.0' else 'missing', n] for n in GLUE]
  assert lines[9] == '1 of 8 prepared.'
  assert prepare_data.main(['--mixture=glue_rte',
                            f'--data_dir={data_dir}']) == 0
  assert _lines(capsys)[-1] == (
      f'Give the runs --gin.TFDS_DATA_DIR="\'{data_dir}\'" (t5x: '
      f'--tfds_data_dir={data_dir}).')


def test_prepare_builds_the_missing_dataset_with_tfds(tmp_path, capsys):
  data_dir = tmp_path / 'data'
  with _network(True), _offline_download(tfds_sources.rte_download(tmp_path)):
    assert prepare_data.main(['--mixture=glue_rte', f'--data_dir={data_dir}',
                              '--prepare']) == 0
  lines = _lines(capsys)
  assert 'Preparing glue/rte:2.0.0 (1 of 1) ...' in lines
  assert lines[-1].startswith(f'All 1 prepared in {data_dir}. Give the runs '
                              f'--gin.TFDS_DATA_DIR="\'{data_dir}\'"')
  assert prepare.is_prepared('glue/rte:2.0.0', str(data_dir))
  info = tfds.builder('glue/rte:2.0.0', data_dir=str(data_dir)).info
  assert info.splits['train'].num_examples == 2
  assert prepare_data.main(['--mixture=glue_rte',
                            f'--data_dir={data_dir}']) == 0
  assert _lines(capsys)[1].split()[:2] == ['prepared', 'glue/rte:2.0.0']
  # Nothing left to prepare: nothing downloaded.
  with _offline_download(error=AssertionError('downloaded again')):
    assert prepare_data.main(['--mixture=glue_rte', f'--data_dir={data_dir}',
                              '--prepare']) == 0


def test_prepare_without_network_fails_at_once_naming_the_fix(tmp_path):
  # No host answers: refused before TFDS's downloader (which retries for
  # minutes).
  download = _offline_download(error=AssertionError('must not download'))
  with mock.patch.object(socket, 'create_connection',
                         side_effect=OSError('no network')), download:
    with pytest.raises(gin_utils.ReportedError) as e:
      prepare_data.main(['--mixture=glue_rte', f'--data_dir={tmp_path}',
                         '--prepare'])
  message = str(e.value)
  assert message.startswith('Preparing glue/rte:2.0.0 needs network access '
                            'to its source (')
  assert 'dl.fbaipublicfiles.com' in message
  assert 'on a machine with network access' in message
  assert 'copy DIR here, or pass --try_gcs' in message
  # The download itself fails: TFDS's error, wrapped.
  with _network(True), _offline_download(
      error=ConnectionError('Failed to resolve dl.fbaipublicfiles.com')):
    with pytest.raises(gin_utils.ReportedError) as e:
      prepare_data.main(['--mixture=glue_rte', f'--data_dir={tmp_path}',
                         '--prepare'])
  message = str(e.value)
  assert message.startswith(f'Preparing glue/rte:2.0.0 in {tmp_path} failed '
                            '(ConnectionError: Failed to resolve')
  assert 'copy DIR here, or pass --try_gcs' in message
  assert not prepare.is_prepared('glue/rte:2.0.0', str(tmp_path))


def test_gcs_is_read_only_when_asked(tmp_path):
  configs = []

  def download_and_prepare(self, download_config):
    del self
    configs.append(download_config)

  with _network(True), mock.patch.object(
      tfds.core.DatasetBuilder, 'download_and_prepare', download_and_prepare):
    for flags in ([], ['--try_gcs']):
      prepare_data.main(['--mixture=glue_rte', f'--data_dir={tmp_path}',
                         '--prepare', *flags])
  assert [c.try_download_gcs for c in configs] == [False, True]
  with pytest.raises(ValueError, match='--try_gcs only changes what '
                     '--prepare downloads'):
    prepare_data.main(['--mixture=glue_rte', '--try_gcs'])


def test_the_mixture_and_directory_come_from_gin(tmp_path, capsys):
  assert prepare_data.main(['--gin_file=tasks/super_glue.gin',
                            f"--gin.TFDS_DATA_DIR='{tmp_path}'"]) == 1
  lines = _lines(capsys)
  assert lines[0] == f'TFDS datasets of super_glue_proportional in {tmp_path}:'
  assert lines[10] == '0 of 9 prepared.'
  # --mixture and --data_dir win over the gin files.
  other = tmp_path / 'other'
  assert prepare_data.main(['--gin_file=tasks/super_glue.gin',
                            '--mixture=glue_rte', f'--data_dir={other}']) == 1
  assert _lines(capsys)[0] == f'TFDS datasets of glue_rte in {other}:'


def test_a_setup_file_gives_its_mixture(tmp_path, capsys):
  assert prepare_data.main(['--gin_file=setups/hyperprompt_global_glue.gin',
                            f'--data_dir={tmp_path}']) == 1
  assert _lines(capsys)[0] == (
      f'TFDS datasets of glue_proportional in {tmp_path}:')
  # Its t5x run file: read by gin where t5x is installed, else refused with
  # the setup file to give instead.
  flags = ['--gin_file=t5x/mtl_glue_super_glue.gin', f'--data_dir={tmp_path}']
  if importlib.util.find_spec('t5x') is None:
    with pytest.raises(ValueError, match="Give its setup file"):
      prepare_data.main(flags)
  else:
    assert prepare_data.main(flags) == 1
    assert _lines(capsys)[0] == (
        f'TFDS datasets of glue_super_glue_proportional in {tmp_path}:')


def test_usage_mistakes_name_the_fix():
  with pytest.raises(ValueError, match=r"Unknown mixture or task "
                     r"'glue_proportinal' \(did you mean glue_proportional"):
    prepare_data.main(['--mixture=glue_proportinal'])
  with pytest.raises(ValueError, match='no --mixture or --gin_file given: '
                     'pass --mixture=glue_super_glue_proportional'):
    prepare_data.main([])
  with pytest.raises(SystemExit):  # argparse: one action at a time
    prepare_data.main(['--mixture=glue_rte', '--list', '--prepare'])


def test_fixture_mixtures_need_nothing(capsys):
  assert prepare_data.main(['--mixture=fixture_glue_proportional']) == 0
  assert _lines(capsys) == [
      'fixture_glue_proportional reads no TFDS dataset: nothing to prepare.']
