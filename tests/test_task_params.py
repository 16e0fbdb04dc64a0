"""Task parameters after training: export / import round trips, growing the
task axis, training only the new tasks' parameters, and bad input."""

import dataclasses
import json
import pathlib
import re

from flax import traverse_util
import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from hyperprompt_jax import task_params
from hyperprompt_jax.checkpointing import checkpoints
from hyperprompt_jax.checkpointing import initial_checkpoint
from hyperprompt_jax.checkpointing import task_params_export
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.methods import param_groups
from hyperprompt_jax.model import network
from hyperprompt_jax.runner import training_loop
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import run_settings
from hyperprompt_jax.training import trainer as trainer_lib

import conftest
import task_separation as ts

MODEL = 'models/t5_1_1_tiny.gin'
BINDINGS = (  # small enough to build every method in a second
    'network.T5Config.vocab_size = 64',
    'network.T5Config.emb_dim = 32',
    'network.T5Config.num_heads = 2',
    'network.T5Config.head_dim = 16',
    'network.T5Config.mlp_dim = 128',  # HyperGrid's 32 x 128 grid divides it
    'network.T5Config.num_tasks = 4',
    'DROPOUT_RATE = 0.0',
)
METHODS = tuple(v for v in ts.VARIANTS if v != 'mtl')
TASKS = ('glue_rte', 'glue_mnli', 'glue_stsb', 'glue_cola')
LENGTHS = {'inputs': 128, 'targets': 16}


def _config(variant, **overrides):
  return dataclasses.replace(ts.build_config(variant, MODEL, BINDINGS),
                             **overrides)


def _flat(tree):
  return {k: np.asarray(v) for k, v in
          traverse_util.flatten_dict(tree, sep='/').items()}


def _random_params(model, seed):
  """Initialised parameters with every value moved, so no task's are left
  at a constant initialisation (zeros, ones) that would hide misplaced
  ones."""
  params = _flat(jax.jit(lambda rng: network.init_variables(
      model, rng, 8, 4)['params'])(jax.random.PRNGKey(seed)))
  rng = np.random.default_rng(seed)
  return {k: (v + rng.normal(0, 0.1, v.shape)).astype(v.dtype)
          for k, v in params.items()}


def _save(path, flat):
  """A checkpoint_<step> in the built-in runner's layout (params only)."""
  ocp.PyTreeCheckpointer().save(
      path / 'state', {'params': traverse_util.unflatten_dict(flat, sep='/'),
                       'step': np.int32(0)})
  return path


def _grown_axes(variant):
  """The axis that grows with num_tasks, per parameter: from the shapes of
  the same model at 4 and 5 tasks (independent of `task_params`)."""
  shapes = [traverse_util.flatten_dict(network.abstract_variables(
      network.Transformer(_config(variant, num_tasks=t)))['params'], sep='/')
            for t in (4, 5)]
  out = {}
  for k, a in shapes[0].items():
    diff = [i for i, (x, y) in enumerate(zip(a.shape, shapes[1][k].shape))
            if x != y]
    if diff:
      assert len(diff) == 1 and shapes[1][k].shape[diff[0]] == (
          a.shape[diff[0]] + 1), k
      out[k] = diff[0]
  return out


@pytest.mark.parametrize('variant', METHODS)
def test_task_axes_are_the_axes_that_grow_with_the_tasks(variant):
  model = network.Transformer(_config(variant))
  axes = task_params.task_axes(model)
  assert axes == _grown_axes(variant)
  assert axes and all(param_groups.is_task_conditioned(k) for k in axes)


def _trainer(model, optimizer=None):
  return trainer_lib.Trainer(model, optimizer or optimizers.make_optimizer(),
                             partitioning.create_mesh(), LENGTHS)


@pytest.mark.parametrize('variant', METHODS)
def test_export_then_import_gives_back_the_parameters(variant, tmp_path):
  model = network.Transformer(_config(variant))
  trained = _random_params(model, seed=1)
  checkpoint = _save(tmp_path / 'checkpoint_7', trained)
  out = task_params_export.export(model, str(checkpoint),
                                  str(tmp_path / 'task.npz'), TASKS)
  arrays, header = task_params.read(str(tmp_path / 'task.npz'))
  assert set(arrays) == {k for k in trained
                         if param_groups.is_task_conditioned(k)}
  for k, v in arrays.items():
    np.testing.assert_array_equal(v, trained[k], err_msg=k)
  assert header['task_list'] == list(TASKS) and header['num_tasks'] == 4
  assert out['bytes'] < out['checkpoint_bytes']
  # Import onto the checkpoint's backbone: the original parameters.
  params, fresh, trained_tasks = initial_checkpoint.params_from_t5x(
      _trainer(model), str(checkpoint), str(tmp_path / 'task.npz'),
      task_list=TASKS)
  assert fresh == [] and trained_tasks == 4
  for k, v in _flat(params).items():
    np.testing.assert_array_equal(v, trained[k], err_msg=k)


@pytest.fixture(scope='module')
def global_on_t5x(tmp_path_factory):
  """HyperPrompt-Global on the real t5x test backbone (orbax layout), its
  task parameters trained (random here), exported."""
  tmp = tmp_path_factory.mktemp('global')
  cfg = dataclasses.replace(conftest.T5X_TINY_CONFIG, num_tasks=4,
                            hyperprompt=ts.build_config(
                                'hyperprompt_global', MODEL,
                                BINDINGS).hyperprompt)
  model = network.Transformer(cfg)
  backbone = checkpoints.load_t5x_params(
      str(conftest.T5X_TINY / 'orbax' / 'checkpoint_100'))
  trained = {k: backbone.get(k, v)
             for k, v in _random_params(model, seed=2).items()}
  checkpoint = _save(tmp / 'checkpoint_3', trained)
  task_params_export.export(model, str(checkpoint), str(tmp / 'task.npz'),
                            TASKS)
  return model, trained, str(tmp / 'task.npz')


def test_artifact_on_a_real_t5x_backbone(global_on_t5x):
  """Backbone from t5x's own orbax checkpoint, task parameters from the
  artifact: each equals its source."""
  model, trained, artifact = global_on_t5x
  expected = np.load(conftest.T5X_TINY / 'orbax_checkpoint_100.params.npz')
  params, fresh, _ = initial_checkpoint.params_from_t5x(
      _trainer(model), str(conftest.T5X_TINY / 'orbax' / 'checkpoint_100'),
      artifact, task_list=TASKS)
  flat = _flat(params)
  assert not fresh
  for k in expected.files:
    np.testing.assert_array_equal(flat[k], expected[k], err_msg=k)
  for k, v in trained.items():
    np.testing.assert_array_equal(flat[k], v, err_msg=k)


def test_artifact_refuses_another_backbone_or_moved_ids(global_on_t5x):
  model, _, artifact = global_on_t5x
  trainer = _trainer(model)
  # t5x's legacy test checkpoint holds other backbone values.
  with pytest.raises(task_params.TaskParamsError,
                     match='backbone: the artifact was trained with'):
    initial_checkpoint.params_from_t5x(
        trainer, str(conftest.T5X_TINY / 'legacy/checkpoint_50'), artifact,
        task_list=TASKS)
  orbax = str(conftest.T5X_TINY / 'orbax' / 'checkpoint_100')
  with pytest.raises(task_params.TaskParamsError,
                     match="task 'glue_mnli' has id 1 in the artifact but has "
                     'id 0'):
    initial_checkpoint.params_from_t5x(trainer, orbax, artifact, task_list=(
        'glue_mnli', 'glue_rte', 'glue_stsb', 'glue_cola'))
  smaller = network.Transformer(dataclasses.replace(model.config,
                                                    num_tasks=3))
  with pytest.raises(task_params.TaskParamsError,
                     match='NUM_TASKS=3 is smaller than the artifact'):
    initial_checkpoint.params_from_t5x(_trainer(smaller), orbax, artifact,
                                       task_list=TASKS[:3])
  other = network.Transformer(dataclasses.replace(
      model.config, hyperprompt=dataclasses.replace(
          model.config.hyperprompt, encoder_prompt_length=6)))
  with pytest.raises(task_params.TaskParamsError,
                     match=r'encoder_prompt_length: artifact 16, model 6'):
    initial_checkpoint.params_from_t5x(_trainer(other), orbax, artifact,
                                       task_list=TASKS)
  mtl = network.Transformer(dataclasses.replace(model.config,
                                                hyperprompt=None))
  with pytest.raises(task_params.TaskParamsError,
                     match=r"method: artifact \['hyperprompt'\], model \[\]"):
    initial_checkpoint.params_from_t5x(_trainer(mtl), orbax, artifact,
                                       task_list=TASKS)


def test_an_unreadable_artifact_is_named(tmp_path):
  (tmp_path / 'x.npz').write_bytes(b'not a zip')
  with pytest.raises(task_params.TaskParamsError, match='not a task-parameter'):
    task_params.read(str(tmp_path / 'x.npz'))
  with pytest.raises(FileNotFoundError, match='export_task_params'):
    task_params.read(str(tmp_path / 'nowhere.npz'))


def test_non_finite_task_parameters_are_refused_on_export_and_import(
    global_on_t5x, tmp_path):
  """NaN values would load silently and the run would stop later on a NaN
  loss, blamed on the learning rate: refused, naming the array."""
  _, _, artifact = global_on_t5x
  arrays, header = task_params.read(artifact)
  name = sorted(arrays)[0]
  arrays[name] = arrays[name].copy()
  arrays[name].flat[[0, 3]] = [np.nan, np.inf]
  with pytest.raises(task_params.TaskParamsError,
                     match=f'NaN or Inf in {re.escape(name)} \\(2 of '):
    task_params.write(str(tmp_path / 'out.npz'), arrays, header)
  assert not (tmp_path / 'out.npz').exists()
  # An artifact damaged after it was written (np.savez by hand).
  np.savez(tmp_path / 'damaged.npz', **{
      task_params._HEADER: np.frombuffer(  # pylint: disable=protected-access
          json.dumps(header).encode(), np.uint8)}, **arrays)
  with pytest.raises(task_params.TaskParamsError,
                     match=f'damaged.npz holds NaN or Inf in {re.escape(name)}'):
    task_params.read(str(tmp_path / 'damaged.npz'))
  # Cut short (a copy interrupted): named, no zip traceback.
  data = pathlib.Path(artifact).read_bytes()
  (tmp_path / 'short.npz').write_bytes(data[:len(data) // 2])
  with pytest.raises(task_params.TaskParamsError, match='cut short'):
    task_params.read(str(tmp_path / 'short.npz'))


def test_an_array_unlike_its_header_is_blamed_on_the_artifact(
    global_on_t5x, tmp_path):
  """An artifact edited by hand (an array replaced by one of another shape)
  failed later as a checkpoint whose shapes do not match."""
  _, _, artifact = global_on_t5x
  arrays, header = task_params.read(artifact)
  name = sorted(arrays)[0]
  arrays[name] = arrays[name][:1]
  np.savez(tmp_path / 'edited.npz', **{
      task_params._HEADER: np.frombuffer(  # pylint: disable=protected-access
          json.dumps(header).encode(), np.uint8)}, **arrays)
  with pytest.raises(task_params.TaskParamsError,
                     match=f'edited.npz holds arrays that differ from its own '
                     f'header \\({re.escape(name)} \\[1'):
    task_params.read(str(tmp_path / 'edited.npz'))


# ------------------------------------------------------------ growing --

def _inputs(num_tasks_seen):
  rng = np.random.default_rng(0)
  enc = conftest.random_tokens(rng, (4, 10), vocab=64, pad_from=[10, 7, 9, 5])
  dec = conftest.random_tokens(rng, (4, 5), vocab=64)
  return enc, dec, np.arange(4, dtype=np.int32) % num_tasks_seen


@pytest.mark.parametrize('variant, rule', [
    ('hyperprompt_global', 'mean'), ('hyperprompt_global', 'copy'),
    ('hyperprompt_global', 'fresh'), ('hyperprompt_sep', 'mean'),
    ('hyperprompt_share', 'copy'), ('adapter', 'fresh'),
    ('prompt_tuning', 'mean'), ('hypergrid_lg', 'copy'),
    ('hyperformer_pp', 'mean')])
def test_growing_keeps_every_task_and_adds_tasks_by_the_rule(variant, rule,
                                                           tmp_path):
  """A 4-task checkpoint (t5x-like: no record, every task trained) into a
  6-task model."""
  old_model = network.Transformer(_config(variant))
  new_model = network.Transformer(_config(variant, num_tasks=6))
  trained = _random_params(old_model, seed=3)
  checkpoint = _save(tmp_path / 'checkpoint_5', trained)
  task_list = TASKS + ('glue_qqp', 'glue_qnli')
  growth = task_params.Growth(rule, 'glue_mnli' if rule == 'copy' else None)
  trainer = _trainer(new_model)
  params, _, trained_tasks = initial_checkpoint.params_from_t5x(
      trainer, str(checkpoint), growth=growth, task_list=task_list)
  assert trained_tasks == 4
  grown = _flat(params)
  init = _flat(trainer.fresh_params()) if rule == 'fresh' else None
  axes = _grown_axes(variant)
  for k, v in trained.items():
    if k not in axes:
      np.testing.assert_array_equal(grown[k], v, err_msg=k)
      continue
    a = axes[k]
    old_tasks = np.moveaxis(v, a, 0)
    np.testing.assert_array_equal(np.moveaxis(grown[k], a, 0)[:4], old_tasks,
                                  err_msg=k)
    for new_task in (4, 5):
      got = np.moveaxis(grown[k], a, 0)[new_task]
      if rule == 'mean':
        want = sum(old_tasks[i].astype(np.float64) for i in range(4)) / 4
        # A float32 sum of 4 and a division, per entry.
        conftest.assert_close_to_scale(
            got, want, conftest.float32_bound(4, 1),
            sum(np.abs(old_tasks[i].astype(np.float64))
                for i in range(4)) / 4, k)
      elif rule == 'copy':  # MNLI has id 1
        np.testing.assert_array_equal(got, old_tasks[1], err_msg=k)
      else:
        np.testing.assert_array_equal(
            got, np.moveaxis(init[k], a, 0)[new_task], err_msg=k)
  # The old tasks' outputs are the old model's.
  enc, dec, ids = _inputs(4)
  def logits(model, params):
    return jax.jit(lambda p: model.apply({'params': p}, enc, dec, dec,
                                         task_ids=ids, enable_dropout=False)
                   )(params)

  want = logits(old_model, traverse_util.unflatten_dict(trained, sep='/'))
  got = logits(new_model, params)
  # More tasks may reorder the sums that run over them: the forward
  # pass's float32 bound (`conftest.model_forward_lengths`).
  conftest.assert_close_to_scale(got, want, conftest.float32_bound(
      *conftest.model_forward_lengths(new_model.config, 10, 5)))


def test_ids_never_trained_are_new_tasks(global_on_t5x):
  """The artifact's model had 4 tasks' parameters; exported again with
  only 3 tasks in its list, id 3 counts as untrained: a new task at id 3
  gets the rule's parameters, not the leftover."""
  model, trained, artifact = global_on_t5x
  arrays, header = task_params.read(artifact)
  three = artifact.replace('.npz', '_3.npz')
  task_params.write(three, arrays, {**header, 'task_list': list(TASKS[:3])})
  params, _, trained_tasks = initial_checkpoint.params_from_t5x(
      _trainer(model), str(conftest.T5X_TINY / 'orbax' / 'checkpoint_100'),
      three, growth=task_params.Growth('copy', 'glue_rte'), task_list=TASKS)
  assert trained_tasks == 3
  flat = _flat(params)
  axes = task_params.task_axes(model)
  for k, a in axes.items():
    got = np.moveaxis(flat[k], a, 0)
    np.testing.assert_array_equal(got[:3], np.moveaxis(trained[k], a, 0)[:3])
    np.testing.assert_array_equal(got[3], np.moveaxis(trained[k], a, 0)[0])


def test_growth_errors():
  with pytest.raises(ValueError, match="NEW_TASK_INIT='median'"):
    task_params.Growth('median')
  with pytest.raises(ValueError, match='NEW_TASK_SOURCE names the task'):
    task_params.Growth('copy')
  flat = {'x': np.zeros((5, 2))}
  abstract = {'x': jax.ShapeDtypeStruct((4, 2), np.float32)}
  with pytest.raises(task_params.TaskParamsError,
                     match='checkpoint has 5 tasks, the model 4'):
    task_params.grow(flat, abstract, {'x': 0}, task_params.Growth(), 5)
  with pytest.raises(task_params.TaskParamsError, match='not a trained task'):
    task_params.grow({'x': np.zeros((2, 2))}, abstract, {'x': 0},
                     task_params.Growth('copy', 'glue_qqp'), 2,
                     ('glue_rte', 'glue_mnli', 'glue_qqp'))


# ------------------------------------- training the new tasks' parameters --

def test_training_only_new_tasks_leaves_everything_else_bit_identical(
    tmp_path):
  old_model = network.Transformer(_config('hyperprompt_global'))
  model = network.Transformer(_config('hyperprompt_global', num_tasks=5))
  checkpoint = _save(tmp_path / 'checkpoint_1',
                     _random_params(old_model, seed=4))
  axes = task_params.task_axes(model)
  optimizer = optimizers.only_task_params(
      optimizers.make_optimizer(learning_rate=1e-2),
      {k: (a, 4) for k, a in axes.items()})
  trainer = _trainer(model, optimizer)
  params, _, _ = initial_checkpoint.params_from_t5x(trainer, str(checkpoint),
                                                     task_list=TASKS)
  before = _flat(params)
  state = trainer.new_state(params)
  # No optimizer state for what is frozen: Adafactor's moments of the
  # new task's parameters only (factored or not, never more values than
  # they hold).
  new_values = sum(v.size // v.shape[axes[k]] for k, v in before.items()
                   if k in axes)
  state_values = sum(x.size for x in jax.tree.leaves(state['opt_state']))
  assert state_values <= new_values + 16
  batches = ts.make_batches(0, 3, 8, 5, 6, 20)
  batches['task_ids'][:] = np.arange(8) % 5  # id 4 in every batch
  for i in range(3):
    batch = trainer.global_batch({k: v[i] for k, v in batches.items()})
    state, _ = trainer.step(state, batch)
  after = _flat(state['params'])
  for k, v in before.items():
    if k in axes:
      old_tasks = np.moveaxis(after[k], axes[k], 0)[:4]
      np.testing.assert_array_equal(
          old_tasks.view(np.uint32),
          np.moveaxis(v, axes[k], 0)[:4].view(np.uint32), err_msg=k)
      assert not np.array_equal(np.moveaxis(after[k], axes[k], 0)[4],
                                np.moveaxis(v, axes[k], 0)[4]), k
    else:
      np.testing.assert_array_equal(after[k].view(np.uint32),
                                    v.view(np.uint32), err_msg=k)


def test_the_old_names_still_work_with_a_warning():
  """`optimizers.only_task_rows` and `initial_checkpoint.only_new_task_rows
  (first_new_row=...)` (a user's gin file may bind them) are
  `only_task_params` and `only_new_task_params(first_new_task=...)`:
  for one release they warn, naming the new, and build the same optimizer."""
  model = network.Transformer(_config('hyperprompt_global', num_tasks=5))
  params = traverse_util.unflatten_dict(_random_params(model, seed=1),
                                        sep='/')
  grads = jax.tree.map(np.ones_like, params)

  def first_update(optimizer):
    return _flat(optimizer.update(grads, optimizer.init(params), params)[0])

  tasks = {k: (a, 4) for k, a in task_params.task_axes(model).items()}
  want = first_update(optimizers.only_task_params(
      optimizers.make_optimizer(), tasks))
  with pytest.warns(DeprecationWarning, match='is now optimizers.'
                    'only_task_params'):
    old = optimizers.only_task_rows(optimizers.make_optimizer(), tasks)
  assert first_update(old).keys() == want.keys()
  for k, v in first_update(old).items():
    np.testing.assert_array_equal(v, want[k], err_msg=k)
  new = initial_checkpoint.only_new_task_params(
      optimizers.make_optimizer(), model, first_new_task=4)
  with pytest.warns(DeprecationWarning, match=re.escape(
      'is now initial_checkpoint.only_new_task_params(first_new_task=...)')):
    old = initial_checkpoint.only_new_task_rows(
        optimizers.make_optimizer(), model, first_new_row=4)
  for k, v in first_update(old).items():
    np.testing.assert_array_equal(v, first_update(new)[k], err_msg=k)
    np.testing.assert_array_equal(v, want[k], err_msg=k)


def test_train_only_new_tasks_from_a_trained_run(tmp_path):
  """The runner end to end: a 3-task run, then the 4th task (CoLA) added
  and trained alone, its parameters started from the mean."""
  gin.clear_config()
  old = network.Transformer(_config('hyperprompt_global', num_tasks=3,
                                    vocab_size=384))
  new = network.Transformer(_config('hyperprompt_global', num_tasks=4,
                                    vocab_size=384))
  # Short rows: what is trained, not how much text, is the point here.
  kwargs = dict(task_feature_lengths={'inputs': 32, 'targets': 8},
                batch_size=4, save_period=2, log_period=2,
                optimizer=optimizers.make_optimizer(learning_rate=1e-2))
  bind = 'hyperprompt_jax.tasks.task_ids.run_task_list.tasks'
  try:
    gin.bind_parameter(bind, list(TASKS[:3]))
    first = training_loop.train(old, settings=run_settings.RunSettings(
        model_dir=str(tmp_path / 'old'), train_steps=2,
        mixture_or_task_name='fixture_glue_rte', **kwargs))
    gin.bind_parameter(bind, list(TASKS))
    second = training_loop.train(new, settings=run_settings.RunSettings(
        model_dir=str(tmp_path / 'new'), train_steps=2,
        mixture_or_task_name='fixture_glue_cola',
        initial_checkpoint_path=str(tmp_path / 'old' / 'checkpoint_2'),
        train_only_new_tasks=True, **kwargs))
    gin.bind_parameter(bind, list(TASKS[:3]))
    with pytest.raises(ValueError, match='the model has no new tasks'):
      training_loop.train(old, settings=run_settings.RunSettings(
          model_dir=str(tmp_path / 'none'), train_steps=2,
          mixture_or_task_name='fixture_glue_rte',
          initial_checkpoint_path=str(tmp_path / 'old' / 'checkpoint_2'),
          train_only_new_tasks=True, **kwargs))
    with pytest.raises(ValueError, match='TASK_PARAMS_PATH needs '
                       'INITIAL_CHECKPOINT_PATH'):
      training_loop.train(new, settings=run_settings.RunSettings(
          model_dir=str(tmp_path / 'x'), train_steps=2,
          mixture_or_task_name='fixture_glue_cola',
          task_params_path=str(tmp_path / 'a.npz'), **kwargs))
  finally:
    gin.clear_config()
  axes = task_params.task_axes(new)
  was, now = _flat(first['params']), _flat(second['params'])
  for k, v in was.items():
    if k in axes:
      a = axes[k]
      np.testing.assert_array_equal(np.moveaxis(now[k], a, 0)[:3],
                                    np.moveaxis(v, a, 0), err_msg=k)
    else:
      np.testing.assert_array_equal(now[k], v, err_msg=k)
  assert any(not np.allclose(np.moveaxis(now[k], a, 0)[3],
                             np.moveaxis(was[k], a, 0).mean(0))
             for k, a in axes.items())  # the new task trained


def test_import_writes_a_checkpoint_both_runners_read(global_on_t5x, tmp_path):
  """import_task_params: t5x's layout ({target, state: {step}}), the real t5x
  backbone and the artifact's task parameters, grown to 5 tasks by
  'copy'."""
  from hyperprompt_jax.checkpointing import task_params_import  # pylint: disable=g-import-not-at-top
  model, trained, artifact = global_on_t5x
  grown = network.Transformer(dataclasses.replace(model.config, num_tasks=5))
  gin.clear_config()
  gin.bind_parameter('hyperprompt_jax.tasks.task_ids.run_task_list.tasks',
                     list(TASKS) + ['glue_qqp'])
  try:
    path = task_params_import.import_task_params(
        grown, str(conftest.T5X_TINY / 'orbax' / 'checkpoint_100'),
        str(tmp_path / 'out'), artifact,
        task_params.Growth('copy', 'glue_stsb'))
    with pytest.raises(ValueError, match='exists: choose a new --output_dir'):
      task_params_import.import_task_params(
          grown, str(conftest.T5X_TINY / 'orbax' / 'checkpoint_100'),
          str(tmp_path / 'out'), artifact)
  finally:
    gin.clear_config()
  assert path.endswith('out/checkpoint_0')
  restored = ocp.PyTreeCheckpointer().restore(tmp_path / 'out' /
                                              'checkpoint_0' / 'state')
  assert set(restored) == {'target', 'state'}
  assert int(restored['state']['step']) == 0
  flat = _flat(restored['target'])
  expected = np.load(conftest.T5X_TINY / 'orbax_checkpoint_100.params.npz')
  for k in expected.files:
    np.testing.assert_array_equal(flat[k], expected[k], err_msg=k)
  for k, a in task_params.task_axes(grown).items():
    tasks = np.moveaxis(flat[k], a, 0)
    np.testing.assert_array_equal(tasks[:4], np.moveaxis(trained[k], a, 0))
    np.testing.assert_array_equal(tasks[4], np.moveaxis(trained[k], a, 0)[2])


def test_sizes_count_the_task_parameters_in_float32():
  model = network.Transformer(_config('hyperprompt_global'))
  params = _random_params(model, seed=0)
  got = task_params_export.sizes(model)
  assert got['artifact'] == 4 * sum(
      v.size for k, v in params.items() if 'hyperprompt' in k)
  assert got['params'] == 4 * sum(v.size for v in params.values())
  assert 0 < got['optimizer_state'] < got['params']


def test_a_missing_initial_checkpoint_is_refused_except_by_a_compile(
    tmp_path):
  """A run from a local INITIAL_CHECKPOINT_PATH that is not there stops at
  its settings; the compile command, which reads no checkpoint, builds the
  same settings (`COMPILE_ONLY`) on a host without the checkpoint."""
  settings = dict(
      mixture_or_task_name='fixture_glue_proportional',
      task_feature_lengths={'inputs': 64, 'targets': 8}, train_steps=10,
      batch_size=8, optimizer=optimizers.make_optimizer(),
      initial_checkpoint_path=str(tmp_path / 'absent' / 'checkpoint_1000'),
      train_only_new_tasks=True)
  with pytest.raises(ValueError, match='INITIAL_CHECKPOINT_PATH .* does not '
                     'exist'):
    run_settings.RunSettings(model_dir=str(tmp_path / 'run'), **settings)
  compiled = run_settings.RunSettings(model_dir=run_settings.COMPILE_ONLY,
                                      **settings)
  assert compiled.train_only_new_tasks
  # TRAIN_ONLY_NEW_TASKS still needs a path set, compile or not.
  settings['initial_checkpoint_path'] = None
  with pytest.raises(ValueError, match='TRAIN_ONLY_NEW_TASKS needs '
                     'INITIAL_CHECKPOINT_PATH'):
    run_settings.RunSettings(model_dir=run_settings.COMPILE_ONLY, **settings)
