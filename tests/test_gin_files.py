"""Every shipped gin file parses, includes and all, with the project's parser
(`gin_utils.parse_gin`); the t5x run files (gin/t5x/) only where t5x is
installed, since they include t5x's own run configuration."""

import contextlib
import dataclasses
import importlib
import os
import pathlib
import re
import sys

import gin
from gin import config_parser
import pytest

from hyperprompt_jax import methods
from hyperprompt_jax import paths
from hyperprompt_jax.common import batches
from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.evaluation import run_config
from hyperprompt_jax.methods import param_groups
from hyperprompt_jax.model import network

GIN_DIR = pathlib.Path(paths.gin_dir())
PROJECT_FILES = sorted(p.relative_to(GIN_DIR).as_posix()
                       for p in GIN_DIR.rglob('*.gin')
                       if p.relative_to(GIN_DIR).parts[0]
                       not in ('t5x', 'experiments'))
T5X_FILES = sorted(p.relative_to(GIN_DIR).as_posix()
                   for p in (GIN_DIR / 't5x').glob('*.gin'))
# The t5x script whose `__main__` functions a run configuration binds.
T5X_SCRIPTS = {'t5x/configs/runs/finetune.gin': 'train',
               't5x/configs/runs/pretrain.gin': 'train',
               't5x/configs/runs/eval.gin': 'eval',
               't5x/configs/runs/infer.gin': 'infer'}
_INCLUDE = re.compile(r"^include\s+'([^']+)'", re.MULTILINE)
# The papers' setups, each written once for both runners.
SETUPS = sorted(p.stem for p in (GIN_DIR / 'setups').glob('*.gin'))
# What a paper setup fixes besides the network.
PAPER_MACROS = ('MIXTURE_OR_TASK_NAME', 'TASK_FEATURE_LENGTHS', 'NUM_TASKS',
                'INITIAL_CHECKPOINT_PATH', 'TRAIN_STEPS', 'BATCH_SIZE',
                'SAVE_PERIOD', 'LEARNING_RATE', 'FREEZE_EMBEDDINGS', 'PACK')


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


# t5x files given after a run's own files, with the run they are tested on.
T5X_FRAGMENTS = {'t5x/add_task.gin': 't5x/quickstart_train.gin',
                 't5x/metabalance.gin': 't5x/quickstart_train.gin'}


@pytest.mark.parametrize('name', T5X_FILES)
def test_t5x_gin_file_parses(name):
  # t5x's run files are included as 't5x/configs/runs/...', from the root
  # of the t5x package (t5x's scripts add it to the search paths).
  t5x_root = _t5x_root()
  text = (GIN_DIR / name).read_text()
  assert 'Required to be set' in text and 'Commonly overridden' in text
  files = [T5X_FRAGMENTS[name], name] if name in T5X_FRAGMENTS else [name]
  with _t5x_main(_t5x_script(files[0])):
    gin_utils.parse_gin(files, [], [t5x_root])
  assert str(gin.query_parameter('MODEL/macro.value')) == (
      '@t5x_model.TaskIdsEncoderDecoderModel()')
  if _t5x_script(files[0]) == 'train':
    # Both runners read one NUM_MICROBATCHES / REMAT_POLICY.
    assert str(gin.query_parameter('trainer.Trainer.num_microbatches')) == (
        '%NUM_MICROBATCHES')
    assert str(gin.query_parameter('network.T5Config.remat_policy')) == (
        '%REMAT_POLICY')
  if name.startswith('t5x/hyper'):  # the papers' runs
    assert gin.query_parameter('USE_CACHED_TASKS/macro.value') is False
    # Packed, HyperGrid's setups too (at most MAX_SEGMENTS examples a row).
    assert gin.query_parameter('PACK/macro.value') is True
    for dataset in ('train', 'train_eval'):
      assert str(gin.query_parameter(
          f'{dataset}/utils.DatasetConfig.pack')) == '%PACK'
    assert gin.query_parameter('SAVE_PERIOD/macro.value') == 2000
    assert gin.query_parameter('BATCH_SIZE/macro.value') == 128
    assert gin.query_parameter('TASK_FEATURE_LENGTHS/macro.value') == {
        'inputs': 512, 'targets': 32}
    assert gin.query_parameter('utils.RestoreCheckpointConfig.'
                               'fallback_to_scratch') is True
    # t5x's published checkpoints (its docs/models.md) of the file's size.
    size = re.search(r'_(large|3b|11b)\.gin$', name)
    expected = {
        None: ('gs://t5-data/pretrained_models/t5x/t5_1_1_base/'
               'checkpoint_1000000',
               'gs://t5-data/pretrained_models/t5x/t5_base/checkpoint_999900'),
        'large': ('gs://t5-data/pretrained_models/t5x/t5_large/'
                  'checkpoint_1000700',),
        '3b': ('gs://t5-data/pretrained_models/t5x/t5_3B/checkpoint_1000000',),
        '11b': ('gs://t5-data/pretrained_models/t5x/t5_11B/'
                'checkpoint_1000000',),
    }[size and size.group(1)]
    assert gin.query_parameter('INITIAL_CHECKPOINT_PATH/macro.value') in (
        expected)


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


def test_every_paper_setup_has_a_run_file_for_each_runner():
  assert len(SETUPS) == 24  # 21 at Base, HyperGrid LG at 3 sizes
  for name in SETUPS:
    for runner in ('t5x', 'runs'):
      text = (GIN_DIR / runner / f'{name}.gin').read_text()
      assert f"include 'setups/{name}.gin'" in text, (runner, name)
      assert 'Required to be set' in text and 'Commonly overridden' in text
  # Every method's variant files and MTL, on GLUE, SuperGLUE or both.
  texts = [(GIN_DIR / 'setups' / f'{name}.gin').read_text()
           for name in SETUPS]
  for variant_file in methods.variant_files():
    assert any(f"include '{variant_file}'" in t for t in texts), variant_file
  assert {'mtl_glue', 'mtl_super_glue', 'mtl_glue_super_glue'} <= set(
      SETUPS)


def test_the_old_experiments_folder_holds_an_alias_of_each_setup():
  """gin/experiments/ is gin/setups/: for one release each old path
  is a two-line file, a deprecation comment and the new path's include
  (a run recorded before names experiments/ in its config)."""
  aliases = sorted((GIN_DIR / 'experiments').glob('*.gin'))
  assert [p.stem for p in aliases] == SETUPS
  for path in aliases:
    comment, include = path.read_text().splitlines()
    assert comment.startswith('# Deprecated') and (
        f'setups/{path.stem}.gin' in comment)
    assert include == f"include 'setups/{path.stem}.gin'"


@pytest.mark.parametrize('name', SETUPS)
def test_an_old_experiments_path_parses_as_its_setup_and_warns(name, capsys):
  gin_utils.parse_gin([f'setups/{name}.gin'], [])
  want = gin.config_str()
  assert capsys.readouterr().err == ''
  gin.clear_config()
  for given in (f'experiments/{name}.gin',
                str(GIN_DIR / 'experiments' / f'{name}.gin')):
    with pytest.warns(DeprecationWarning, match=re.escape(
        f'gin/experiments/ is now gin/setups/; give '
        f'--gin_file=setups/{name}.gin')):
      gin_utils.parse_gin([given], [])
    assert gin.config_str() == want
    assert f'--gin_file=setups/{name}.gin' in capsys.readouterr().err
    gin.clear_config()


def _bound_setup() -> tuple[network.T5Config, dict]:
  """The bound T5Config and the paper macros that are set."""
  config = gin.get_configurable(network.Transformer)().config
  macros = {}
  for macro in PAPER_MACROS:
    try:
      macros[macro] = gin.query_parameter(f'{macro}/macro.value')
    except ValueError:  # not set (t5x's own defaults, when t5x is absent)
      pass
  return config, macros


@pytest.mark.parametrize('name', SETUPS)
def test_both_runners_bind_the_same_model_for_a_paper_setup(name, tmp_path):
  """The t5x run file and the built-in one bind the same T5Config and paper
  macros. With t5x installed the t5x file parses whole; without, its
  `include 't5x/train.gin'` is dropped, which binds nothing of the model
  (checked below)."""
  gin_utils.parse_gin([f'runs/{name}.gin'], [])
  builtin_config, builtin_macros = _bound_setup()
  assert set(builtin_macros) == set(PAPER_MACROS)
  assert str(gin.query_parameter('run_settings.RunSettings.pack')) == '%PACK'
  # Every paper setup trains packed; HyperGrid's rows hold at most
  # MAX_SEGMENTS examples (one gated weight each), and so do the packer's.
  assert builtin_macros['PACK'] is True
  rows = batches.RowFormat.of(builtin_config, pack=True)
  if builtin_config.hypergrid is not None:
    assert rows.max_examples == builtin_config.hypergrid.max_segments == 8
  else:
    assert rows.max_examples is None
  gin.clear_config()
  try:
    t5x_root = _t5x_root()
  except pytest.skip.Exception:
    t5x_root = None
    text = (GIN_DIR / 't5x' / f'{name}.gin').read_text()
    stripped = tmp_path / f'{name}.gin'
    stripped.write_text(text.replace("include 't5x/train.gin'", '').replace(
        'from t5x import utils', '').replace(
            "utils.RestoreCheckpointConfig.assignment_map = "
            "(('state/.*', None),)", ''))
    gin_utils.parse_gin([str(stripped)], [])
  else:
    with _t5x_main('train'):
      gin_utils.parse_gin([f't5x/{name}.gin'], [], [t5x_root])
  t5x_config, t5x_macros = _bound_setup()
  if t5x_root is None:  # t5x/train.gin, dropped, binds REMAT_POLICY
    t5x_config = dataclasses.replace(
        t5x_config, remat_policy=builtin_config.remat_policy)
  assert t5x_config == builtin_config
  if t5x_root is not None:  # every macro; else those the setup sets
    assert set(t5x_macros) == set(PAPER_MACROS)
  assert t5x_macros == {m: builtin_macros[m] for m in t5x_macros}


def test_the_t5x_runner_files_bind_nothing_of_the_model():
  """The model is the setup files'; the runner may set only how a step
  spends memory (REMAT_POLICY: same parameters, same results)."""
  for name in ('t5x/train.gin', 't5x/model.gin'):
    text = (GIN_DIR / name).read_text().replace(
        'network.T5Config.remat_policy = %REMAT_POLICY', '')
    assert 'T5Config' not in text and 'NUM_TASKS =' not in text


@pytest.mark.parametrize('name', sorted(
    p.stem for p in (GIN_DIR / 'tasks').glob('*.gin')))
def test_a_task_file_s_num_tasks_is_its_task_list_s_length(name):
  gin_utils.parse_gin([f'tasks/{name}.gin'], [])
  from hyperprompt_jax.tasks import task_ids  # pylint: disable=g-import-not-at-top
  benchmark = gin.query_parameter(
      'hyperprompt_jax.tasks.task_ids.run_task_list.benchmark')
  num_tasks = gin.query_parameter('NUM_TASKS/macro.value')
  assert num_tasks == len(task_ids.BENCHMARKS[benchmark])
  assert gin.get_configurable(network.T5Config)(vocab_size=1).num_tasks == (
      num_tasks)


@pytest.mark.parametrize('flag,fix', [
    ('--gin.MODEL_DIR=/tmp/x', '--gin.MODEL_DIR="\'/tmp/x\'"'),
    ('--gin.MODEL_DIR=gs://b/run', '--gin.MODEL_DIR="\'gs://b/run\'"'),
    ('--gin.MIXTURE_OR_TASK_NAME=glue_rte',
     '--gin.MIXTURE_OR_TASK_NAME="\'glue_rte\'"'),
])
def test_an_unquoted_string_binding_is_an_error_naming_the_quotes(flag, fix):
  args = gin_utils.parse_command_line(
      'prog', '', ['--gin_file=runs/quickstart.gin', flag],
      parse_gin_files=False)
  with pytest.raises(ValueError, match='cannot parse') as info:
    gin_utils.parse_gin_flags(args)
  assert fix in str(info.value)


def test_a_binding_typo_that_is_no_string_gets_no_quoting_hint():
  with pytest.raises(ValueError, match='cannot parse') as info:
    gin_utils.parse_gin(['runs/quickstart.gin'], ['TRAIN_STEPS = 10x'])
  assert 'quote' not in str(info.value)


def test_an_include_cycle_is_one_error_naming_the_files(tmp_path):
  """gin recursed until Python's limit: a 3,269-line RecursionError."""
  (tmp_path / 'a.gin').write_text("include 'b.gin'\nX = 1\n")
  (tmp_path / 'b.gin').write_text("include 'a.gin'\n")
  a, b = tmp_path / 'a.gin', tmp_path / 'b.gin'
  with pytest.raises(ValueError, match=re.escape(
      f'include each other in a cycle: {a} -> {b} -> {a}.')) as info:
    gin_utils.parse_gin([str(a)], [], [str(tmp_path)])
  assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize('setup, mixture, partitions', [
    ('hyperprompt_global_glue', 'glue_proportional', 1),
    ('hypergrid_lg_glue_super_glue_3b', 'glue_super_glue_proportional', 8),
])
def test_t5x_eval_takes_the_setup_file(setup, mixture, partitions):
  """t5x/eval.gin then the setup file: the setup's model, tasks,
  lengths and model parallelism, over t5x's eval defaults."""
  t5x_root = _t5x_root()
  with _t5x_main('eval'):
    gin_utils.parse_gin(['t5x/eval.gin', f'setups/{setup}.gin'],
                        ["CHECKPOINT_PATH = '/run'",
                         "EVAL_OUTPUT_DIR = '/run/eval'"], [t5x_root])
    assert gin.query_parameter('MIXTURE_OR_TASK_NAME/macro.value') == mixture
    assert gin.query_parameter('TASK_FEATURE_LENGTHS/macro.value') == {
        'inputs': 512, 'targets': 32}
    assert gin.query_parameter('MESH_MODEL/macro.value') == partitions
    assert str(gin.query_parameter(
        'partitioning.PjitPartitioner.num_partitions')) == '%MESH_MODEL'


# Each model file and t5x's file for the same public checkpoint.
T5X_MODEL_FILES = {
    't5_1_1_small': 't5_1_1/small.gin', 't5_1_1_base': 't5_1_1/base.gin',
    't5_1_1_large': 't5_1_1/large.gin', 't5_1_1_xl': 't5_1_1/xl.gin',
    't5_1_1_xxl': 't5_1_1/xxl.gin', 't5_base': 't5_1_0/base.gin',
    't5_large': 't5_1_0/large.gin', 't5_3b': 't5_1_0/3B.gin',
    't5_11b': 't5_1_0/11B.gin'}


def _t5x_t5config_bindings(path: pathlib.Path, root: pathlib.Path) -> dict:
  """The `network.T5Config` bindings of a t5x gin file, its includes first,
  read by gin's parser without importing or binding anything (t5x's files
  and the project's both name their module `network`)."""
  bindings = {}
  for statement in config_parser.ConfigParser(
      path.read_text(), run_config._Values()):  # pylint: disable=protected-access
    if isinstance(statement, config_parser.IncludeStatement):
      bindings.update(_t5x_t5config_bindings(root / statement.filename, root))
    elif (isinstance(statement, config_parser.BindingStatement)
          and statement.selector == 'network.T5Config'):
      bindings[statement.arg_name] = statement.value
  return bindings


@pytest.mark.parametrize('name', sorted(T5X_MODEL_FILES))
def test_model_files_set_what_t5x_sets_for_the_checkpoint(name):
  """Every T5Config setting of a gin/models/ file equals t5x's for the same
  checkpoint (its examples/t5 file, or its T5Config default), attention
  logits' precision included; dropout is the one choice t5x leaves to the
  run (`%gin.REQUIRED`)."""
  t5x = pytest.importorskip('t5x')
  from t5x.examples.t5 import network as t5x_network  # pylint: disable=g-import-not-at-top
  gin_utils.parse_gin([f'models/{name}.gin'], [])
  ours = gin.get_configurable(network.T5Config)()
  root = pathlib.Path(t5x.__file__).parent.parent
  theirs = dataclasses.replace(
      t5x_network.T5Config(vocab_size=0), **_t5x_t5config_bindings(
          pathlib.Path(t5x_network.__file__).parent / T5X_MODEL_FILES[name],
          root))
  fields = [f.name for f in dataclasses.fields(theirs)
            if f.name != 'dropout_rate']
  assert fields and all(hasattr(ours, f) for f in fields)
  assert {f: getattr(ours, f) for f in fields} == {
      f: getattr(theirs, f) for f in fields}
