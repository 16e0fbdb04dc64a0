"""Every shipped gin file parses, includes and all, with the project's parser
(`gin_utils.parse_gin`); the t5x run files (gin/t5x/) only where t5x is
installed, since they include t5x's own run configuration."""

import contextlib
import importlib
import os
import pathlib
import re
import sys

import gin
import pytest

from hyperprompt_jax import gin_utils
from hyperprompt_jax import param_groups
from hyperprompt_jax import paths

GIN_DIR = pathlib.Path(paths.gin_dir())
PROJECT_FILES = sorted(p.relative_to(GIN_DIR).as_posix()
                       for p in GIN_DIR.rglob('*.gin')
                       if p.relative_to(GIN_DIR).parts[0] != 't5x')
T5X_FILES = sorted(p.relative_to(GIN_DIR).as_posix()
                   for p in (GIN_DIR / 't5x').glob('*.gin'))
# The t5x script whose `__main__` functions a run configuration binds.
T5X_SCRIPTS = {'t5x/configs/runs/finetune.gin': 'train',
               't5x/configs/runs/pretrain.gin': 'train',
               't5x/configs/runs/eval.gin': 'eval',
               't5x/configs/runs/infer.gin': 'infer'}
_INCLUDE = re.compile(r"^include\s+'([^']+)'", re.MULTILINE)


@pytest.fixture(autouse=True)
def _clear_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def test_there_are_files_of_both_kinds():
  assert 'models/t5_1_1_base.gin' in PROJECT_FILES
  assert 't5x/hyperprompt_global_glue.gin' in T5X_FILES  # launch/ default


@pytest.mark.parametrize('name', PROJECT_FILES)
def test_project_gin_file_parses(name):
  gin_utils.parse_gin([name], [])


def _t5x_script(name: str) -> str | None:
  """'train' / 'eval' / 'infer' for a file that includes t5x's run
  configuration (directly or through another file), else None."""
  for include in _INCLUDE.findall((GIN_DIR / name).read_text()):
    if include in T5X_SCRIPTS:
      return T5X_SCRIPTS[include]
    if (GIN_DIR / include).exists():
      script = _t5x_script(include)
      if script:
        return script
  return None


@contextlib.contextmanager
def _t5x_main(script: str | None):
  """t5x's run files bind `__main__.train` (or evaluate / infer): parse them
  with that t5x script as `__main__`, as `python -m t5x.<script>` would."""
  saved = sys.modules['__main__']
  if script:
    sys.modules['__main__'] = importlib.import_module(f't5x.{script}')
  try:
    yield
  finally:
    sys.modules['__main__'] = saved


@pytest.mark.parametrize('name', T5X_FILES)
def test_t5x_gin_file_parses(name):
  # t5x's run files are included as 't5x/configs/runs/...', from the root
  # of the t5x package (t5x's scripts add it to the search paths).
  t5x_root = _t5x_root()
  text = (GIN_DIR / name).read_text()
  assert 'Required to be set' in text and 'Commonly overridden' in text
  with _t5x_main(_t5x_script(name)):
    gin_utils.parse_gin([name], [], [t5x_root])
  assert str(gin.query_parameter('MODEL/macro.value')) == (
      '@t5x_model.TaskIdsEncoderDecoderModel()')
  if name.startswith('t5x/hyper'):  # the papers' runs
    assert gin.query_parameter('USE_CACHED_TASKS/macro.value') is False
    assert gin.query_parameter('train/utils.DatasetConfig.pack') is False
    assert gin.query_parameter('train_eval/utils.DatasetConfig.pack') is False
    assert gin.query_parameter('SAVE_PERIOD/macro.value') == 2000
    assert gin.query_parameter('BATCH_SIZE/macro.value') == 128
    assert gin.query_parameter('TASK_FEATURE_LENGTHS/macro.value') == {
        'inputs': 512, 'targets': 32}
    assert gin.query_parameter('utils.RestoreCheckpointConfig.'
                               'fallback_to_scratch') is True
    assert gin.query_parameter('INITIAL_CHECKPOINT_PATH/macro.value') in (
        'gs://t5-data/pretrained_models/t5x/t5_1_1_base/checkpoint_1000000',
        'gs://t5-data/pretrained_models/t5x/t5_base/checkpoint_999900')


def _t5x_root() -> str:
  t5x = pytest.importorskip('t5x')
  return os.path.dirname(os.path.dirname(t5x.__file__))


def test_t5x_assignment_map_skips_exactly_the_task_conditioned_scopes():
  t5x_root = _t5x_root()
  with _t5x_main('train'):
    gin_utils.parse_gin(['t5x/train.gin'], [], [t5x_root])
  assignment_map = gin.query_parameter(
      'utils.RestoreCheckpointConfig.assignment_map')
  pattern = gin.query_parameter('TASK_CONDITIONED_PARAMETERS/macro.value')
  assert [m for m, _ in assignment_map][0] == 'state/.*'
  assert all(target is None for _, target in assignment_map)
  for scope in param_groups.TASK_CONDITIONED_SCOPES:
    assert re.fullmatch(pattern, f'target/encoder/{scope}/x')
    assert re.fullmatch(pattern, f'target/decoder/layers_0/mlp/{scope}/x/y')
  for backbone in ('target/encoder/layers_0/attention/query/kernel',
                   'target/token_embedder/embedding',
                   'state/param_states/encoder/hyperprompt/v'):
    assert not re.fullmatch(pattern, backbone)
  listed = set(re.search(r'\(([a-z_|]+)\)', pattern).group(1).split('|'))
  assert listed == set(param_groups.TASK_CONDITIONED_SCOPES)


@pytest.mark.parametrize('script', ['eval', 'infer'])
def test_t5x_eval_and_infer_take_a_run_s_model_variant_and_task_files(script):
  t5x_root = _t5x_root()
  with _t5x_main(script):
    gin_utils.parse_gin(
        [f't5x/{script}.gin', 'models/t5_1_1_base.gin',
         'variants/hyperprompt_global.gin', 'tasks/super_glue.gin'],
        ["PLACEMENT = 'decoder'"], [t5x_root])
  # The task file's lengths and ids, not t5x's defaults.
  assert gin.query_parameter('TASK_FEATURE_LENGTHS/macro.value') == {
      'inputs': 512, 'targets': 32}
  assert gin.query_parameter('NUM_TASKS/macro.value') == 8
  assert str(gin.query_parameter('utils.DatasetConfig.split')) == (
      f'%{script.upper()}_SPLIT')
  assert gin.query_parameter(f'{script.upper()}_SPLIT/macro.value') == (
      'validation')
  if script == 'eval':  # every checkpoint of a directory
    assert gin.query_parameter('utils.RestoreCheckpointConfig.mode') == 'all'


def test_a_t5x_run_file_takes_another_model_size():
  """The headers' recipe: a later model file and INITIAL_CHECKPOINT_PATH."""
  t5x_root = _t5x_root()
  path = 'gs://t5-data/pretrained_models/t5x/t5_1_1_large/checkpoint_1000000'
  with _t5x_main('train'):
    gin_utils.parse_gin(
        ['t5x/hyperprompt_global_glue.gin', 'models/t5_1_1_large.gin'],
        [f"INITIAL_CHECKPOINT_PATH = '{path}'"], [t5x_root])
  assert gin.query_parameter('network.T5Config.emb_dim') == 1024
  assert gin.query_parameter('NUM_TASKS/macro.value') == 8
  assert gin.query_parameter('PLACEMENT/macro.value') == 'both'
  assert gin.query_parameter('INITIAL_CHECKPOINT_PATH/macro.value') == path
