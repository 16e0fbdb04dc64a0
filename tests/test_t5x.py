"""The t5x integration (skipped when t5x is not installed).

- `python -m t5x.train` trains the quickstart (gin/t5x/quickstart_train.gin)
  from scratch, and `python -m t5x.eval` evaluates its checkpoints, whose
  metrics `python -m hyperprompt_jax.eval --metrics_dir` summarises;
- the adapter's loss, scores and decoding against independent references:
  the project's losses, a numpy log-likelihood, `decoding.greedy_decode`;
- fine-tuning from a real tiny t5x checkpoint through
  `RestoreCheckpointConfig` (assignment map + fallback_to_scratch);
- t5x's partitioner with the project's rules and optax Adafactor's state.
"""

import dataclasses
import importlib
import json
import os
import pathlib
import sys

import flax
from flax import traverse_util
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

t5x = pytest.importorskip('t5x')

# pylint: disable=g-import-not-at-top,g-bad-import-order
import orbax.checkpoint as ocp
import seqio
from t5x import optimizers as t5x_optimizers
from t5x import partitioning as t5x_partitioning
from t5x import train_state as t5x_train_state

from hyperprompt_jax import paths
from hyperprompt_jax import task_params
from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.methods import hyperformer
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.methods import hyperprompt
from hyperprompt_jax.methods import param_groups
from hyperprompt_jax.methods import prompt_tuning
from hyperprompt_jax.model import decoding
from hyperprompt_jax.model import network
from hyperprompt_jax.t5 import losses
from hyperprompt_jax.t5x import data_checkpoint
from hyperprompt_jax.t5x import metabalance_trainer
from hyperprompt_jax.t5x import t5x_model
from hyperprompt_jax.training import metabalance
from hyperprompt_jax.training import optimizers

import conftest

GIN_SEARCH_PATHS = f'--gin_search_paths={paths.gin_dir()}'
# t5x's run files (t5x/configs/runs/*.gin) live beside the installed package.
T5X_ROOT = os.path.dirname(os.path.dirname(t5x.__file__))
NUM_TASKS = 16  # the fixture mixture's joint task list
# Small and quick: a few steps of batch 4, no validation loss during training.
QUICK = ['--gin.BATCH_SIZE=4',
         '--gin.__main__.train.train_eval_dataset_cfg=None']
# tests/testdata/t5x_tiny's dimensions (conftest.T5X_TINY_CONFIG).
TINY_DIMS = ['--gin.network.T5Config.emb_dim=32',
             '--gin.network.T5Config.num_heads=2',
             '--gin.network.T5Config.head_dim=16',
             '--gin.network.T5Config.mlp_dim=64']


def _run(module: str, *args: str, timeout: int = 600) -> str:
  return conftest.run_module(module, *args, timeout=timeout)


def _read_t5x_state(checkpoint: pathlib.Path) -> dict[str, np.ndarray]:
  """Every array of a t5x orbax `checkpoint_<step>` (its `state/` tree:
  `target/...` parameters, `state/step`, `state/param_states/...`), as a
  flat '/'-keyed dict of numpy arrays."""
  state_dir = checkpoint.resolve() / 'state'
  metadata = ocp.PyTreeCheckpointHandler().metadata(state_dir).tree
  restore_args = jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
  restored = ocp.PyTreeCheckpointer().restore(
      state_dir, args=ocp.args.PyTreeRestore(item=metadata,
                                             restore_args=restore_args))
  return {k: np.asarray(v) for k, v in
          traverse_util.flatten_dict(restored, sep='/').items()}


def _steps(model_dir: pathlib.Path) -> list[int]:
  return sorted(int(p.name.split('_')[1])
                for p in model_dir.glob('checkpoint_*'))


# ------------------------------------------------- train / eval with t5x --

@pytest.fixture(scope='module')
def quickstart_dir(tmp_path_factory) -> pathlib.Path:
  """The t5x quickstart trained 2 steps, checkpoints at steps 0 and 2."""
  model_dir = tmp_path_factory.mktemp('t5x_quickstart')
  _run('t5x.train', GIN_SEARCH_PATHS, '--gin_file=t5x/quickstart_train.gin',
       f"--gin.MODEL_DIR='{model_dir}'", '--gin.TRAIN_STEPS=2',
       '--gin.SAVE_PERIOD=2', *QUICK)
  return model_dir


def test_t5x_train_quickstart(quickstart_dir):
  assert _steps(quickstart_dir) == [0, 2]
  before = _read_t5x_state(quickstart_dir / 'checkpoint_0')
  after = _read_t5x_state(quickstart_dir / 'checkpoint_2')
  assert int(before['state/step']) == 0 and int(after['state/step']) == 2
  params = [k for k in before if k.startswith('target/')]
  conditioned = [k for k in params if param_groups.is_task_conditioned(k)]
  assert conditioned, 'the quickstart is HyperPrompt-Global'
  # Both the backbone and the hyper-prompt parameters were trained.
  changed = {k for k in params if not np.array_equal(before[k], after[k])}
  assert set(conditioned) & changed
  assert 'target/encoder/layers_0/attention/query/kernel' in changed
  # The optimizer state is make_optimizer's optax Adafactor, in groups.
  assert any(k.startswith('state/param_states/inner_states/task_conditioned/')
             for k in after)


def test_t5x_trains_hypergrid_on_packed_rows(tmp_path):
  """t5x/quickstart_hypergrid_train.gin: t5x packs (PACK) with the model's
  feature converter, rows closed at MAX_SEGMENTS, and trains HyperGrid LG
  on them: the gates' parameters and the backbone move."""
  model_dir = tmp_path / 'run'
  _run('t5x.train', GIN_SEARCH_PATHS,
       '--gin_file=t5x/quickstart_hypergrid_train.gin',
       f"--gin.MODEL_DIR='{model_dir}'", '--gin.TRAIN_STEPS=2',
       '--gin.SAVE_PERIOD=2', '--gin.MAX_SEGMENTS=2', *QUICK)
  assert _steps(model_dir) == [0, 2]
  before = _read_t5x_state(model_dir / 'checkpoint_0')
  after = _read_t5x_state(model_dir / 'checkpoint_2')
  changed = {k for k in before if k.startswith('target/')
             and not np.array_equal(before[k], after[k])}
  assert 'target/encoder/layers_0/hypergrid/local_rows' in changed
  assert 'target/encoder/layers_0/mlp/wo/kernel' in changed
  assert 'target/encoder/hypergrid/task_embeddings' in changed


def test_t5x_resumes_its_data_where_the_checkpoint_left_it(tmp_path):
  """A t5x run fine-tuned from a legacy t5x checkpoint (the public T5 ones'
  layout) saves its data iterator by default; stopped after its step-2
  checkpoint and started again, it trains steps 3 and 4 on the batches an
  uninterrupted run trains them on, packed rows included: its step-4 state
  equals the uninterrupted run's, bit for bit (restarting the data would
  train steps 3 and 4 on batches 1 and 2; checked to fail with
  SAVE_DATASET=False)."""
  initial = conftest.T5X_TINY / 'legacy' / 'checkpoint_50'

  def train(model_dir, steps):
    _run('t5x.train', GIN_SEARCH_PATHS, '--gin_file=t5x/quickstart_train.gin',
         f"--gin.MODEL_DIR='{model_dir}'", f'--gin.TRAIN_STEPS={steps}',
         f"--gin.INITIAL_CHECKPOINT_PATH='{initial.resolve()}'",
         '--gin.SAVE_PERIOD=2', '--gin.PACK=True',
         '--gin.train/utils.DatasetConfig.seed=7', *TINY_DIMS, *QUICK)

  train(tmp_path / 'whole', 4)
  train(tmp_path / 'cut', 2)
  assert (tmp_path / 'cut' / 'checkpoint_2' / 'dataset').is_dir()
  train(tmp_path / 'cut', 4)
  whole = _read_t5x_state(tmp_path / 'whole' / 'checkpoint_4')
  cut = _read_t5x_state(tmp_path / 'cut' / 'checkpoint_4')
  assert int(cut['state/step']) == 4
  for key, value in whole.items():
    np.testing.assert_array_equal(cut[key], value, err_msg=key)


def test_save_dataset_default_follows_what_t5x_restores(tmp_path):
  """SAVE_DATASET's default: on from scratch and from a legacy or TensorFlow
  t5x checkpoint (t5x's legacy reader skips the iterator), off from an Orbax
  one (t5x would read its `dataset` item); a resumed run keeps its choice."""
  saves = data_checkpoint.saves_data_iterator
  empty = str(tmp_path / 'new_run')
  assert saves(None, empty)
  assert saves(str(conftest.T5X_TINY / 'legacy' / 'checkpoint_50'), empty)
  tf_checkpoint = tmp_path / 'tf' / 'model.ckpt-100'
  tf_checkpoint.parent.mkdir()
  pathlib.Path(str(tf_checkpoint) + '.index').write_bytes(b'')
  assert saves(str(tf_checkpoint), empty)
  assert not saves(str(conftest.T5X_TINY / 'orbax' / 'checkpoint_100'), empty)
  # Resuming: the newest checkpoint decides, whatever the start.
  run = tmp_path / 'run'
  (run / 'checkpoint_4' / 'state').mkdir(parents=True)
  assert not saves(None, str(run))
  (run / 'checkpoint_6' / 'dataset').mkdir(parents=True)
  assert saves(str(conftest.T5X_TINY / 'orbax' / 'checkpoint_100'), str(run))


def test_t5x_eval_and_metrics_summary(quickstart_dir, tmp_path):
  out = tmp_path / 'eval'
  _run('t5x.eval', GIN_SEARCH_PATHS, '--gin_file=t5x/quickstart_eval.gin',
       f"--gin.CHECKPOINT_PATH='{quickstart_dir}'",
       f"--gin.EVAL_OUTPUT_DIR='{out}'", '--gin.EVAL_BATCH_SIZE=8',
       '--gin.seqio.Evaluator.num_examples=8')
  metrics = out / 'inference_eval'
  files = sorted(p.name for p in metrics.glob('*-metrics.jsonl'))
  # The 17 evaluation tasks of the fixture mixture (MNLI has two).
  assert len(files) == 17, files
  rte = (metrics / 'fixture_glue_rte-metrics.jsonl').read_text()
  lines = [json.loads(line) for line in rte.splitlines()]
  assert [line['step'] for line in lines] == [0, 2]  # mode 'all'
  assert 'accuracy' in lines[0]
  # Every example reached the model with its task's id (RTE: 7 of 16).
  inferences = (metrics / 'fixture_glue_rte-000002.jsonl').read_text()
  assert {json.loads(line)['input']['task_ids']
          for line in inferences.splitlines()} == {7}

  summary_dir = tmp_path / 'summary'
  stdout = _run('hyperprompt_jax.eval', f'--metrics_dir={out}',
                f'--output_dir={summary_dir}')
  assert 'glue_super_glue average' in stdout
  summary = json.loads((summary_dir / 'summary.json').read_text())
  assert sorted(summary['steps'], key=int) == ['0', '2']
  assert len(summary['steps']['2']['task_scores']) == NUM_TASKS
  assert (summary_dir / 'best_per_task.json').exists()


def test_t5x_metabalance_quickstart_keeps_its_state_and_evaluates(tmp_path):
  """t5x/quickstart_metabalance.gin: t5x trains with MetaBalanceTrainer, its
  checkpoints hold the moving averages (a scalar per balanced parameter for
  the target, one per auxiliary: 7 other GLUE tasks), and t5x's plain eval
  reads them."""
  model_dir = tmp_path / 'train'
  _run('t5x.train', GIN_SEARCH_PATHS,
       '--gin_file=t5x/quickstart_metabalance.gin',
       f"--gin.MODEL_DIR='{model_dir}'", '--gin.TRAIN_STEPS=2',
       '--gin.SAVE_PERIOD=2', *QUICK)
  state = _read_t5x_state(model_dir / 'checkpoint_2')
  params = {k[len('target/'):] for k in state if k.startswith('target/')}
  averages = {k: v for k, v in state.items()
              if k.startswith('flax_mutables/metabalance/')}
  prefix = 'flax_mutables/metabalance/'
  target = {k[len(prefix + 'target/'):]: v for k, v in averages.items()
            if k.startswith(prefix + 'target/')}
  auxiliary = {k[len(prefix + 'auxiliary/'):]: v for k, v in averages.items()
               if k.startswith(prefix + 'auxiliary/')}
  # Every parameter but the task-indexed ones (HyperPrompt-Global's task
  # embeddings and per-task prompts, [8 GLUE tasks, ...]) is balanced.
  indexed = {k for k in params
             if k.rsplit('/', 1)[1] in ('task_embeddings', 'global_prompts')}
  assert len(indexed) == 4
  assert all(state[f'target/{k}'].shape[0] == 8 for k in indexed)
  assert target.keys() == auxiliary.keys() == params - indexed
  assert all(v.shape == () for v in target.values())
  assert all(v.shape == (7,) for v in auxiliary.values())
  assert any(np.any(v > 0) for v in auxiliary.values())

  out = tmp_path / 'eval'
  _run('t5x.eval', GIN_SEARCH_PATHS, '--gin_file=t5x/quickstart_eval.gin',
       '--gin_file=tasks/fixture_glue.gin',
       f"--gin.CHECKPOINT_PATH='{model_dir}'",
       f"--gin.EVAL_OUTPUT_DIR='{out}'", '--gin.EVAL_BATCH_SIZE=8',
       '--gin.seqio.Evaluator.num_examples=8')
  assert (out / 'inference_eval' / 'fixture_glue_rte-000002.jsonl').exists()


def test_t5x_plain_trainer_refuses_metabalance_state():
  """A MetaBalance model stepped by t5x's plain trainer (GRADIENT_BALANCING
  set without t5x/metabalance.gin) names the trainer to select."""
  model = _t5x_model('hyperprompt_global')
  params = model.get_initial_variables(
      jax.random.PRNGKey(1), {'encoder_input_tokens': (4, 10),
                              'decoder_input_tokens': (4, 6)})['params']
  batch = _batch(np.random.default_rng(0))
  with pytest.raises(ValueError, match='metabalance_trainer.MetaBalanceTrainer'):
    model.loss_fn(params, batch, None, {'metabalance': {}})
  # Without mutables, and in t5x's eval step (which passes them), the loss.
  loss, _ = model.loss_fn(params, batch, None)
  np.testing.assert_allclose(
      model.eval_fn(params, batch, {'metabalance': {}})[0], loss, rtol=1e-6)


def test_t5x_fine_tunes_from_a_t5x_checkpoint(tmp_path):
  """Restore through RestoreCheckpointConfig's assignment map with
  fallback_to_scratch: the backbone is the checkpoint's, the new parameters
  are freshly initialised, the optimizer state is fresh, the step 0."""
  model_dir = tmp_path / 'model'
  initial = conftest.T5X_TINY / 'orbax' / 'checkpoint_100'
  _run('t5x.train', GIN_SEARCH_PATHS, '--gin_file=t5x/quickstart_train.gin',
       f"--gin.MODEL_DIR='{model_dir}'",
       f"--gin.INITIAL_CHECKPOINT_PATH='{initial.resolve()}'",
       '--gin.TRAIN_STEPS=1', '--gin.SAVE_PERIOD=1', '--gin.RANDOM_SEED=0',
       *TINY_DIMS, *QUICK)
  # Fine-tuning counts from 0 (not from the checkpoint's step 100).
  assert _steps(model_dir) == [0, 1]
  state = _read_t5x_state(model_dir / 'checkpoint_0')
  assert int(state['state/step']) == 0

  expected = np.load(conftest.T5X_TINY / 'orbax_checkpoint_100.params.npz')
  params = {k[len('target/'):]: v for k, v in state.items()
            if k.startswith('target/')}
  assert set(expected.files) == {k for k in params
                                 if not param_groups.is_task_conditioned(k)}
  for k in expected.files:  # the backbone really loaded
    np.testing.assert_array_equal(params[k], expected[k], err_msg=k)

  # The new parameters are a fresh initialisation: t5x's init rng for
  # RANDOM_SEED = 0 is split(PRNGKey(0))[0] (t5x/train.py).
  gin.clear_config()
  gin_utils.parse_gin(['runs/quickstart_model.gin'],
                      [b[len('--gin.'):] for b in TINY_DIMS])
  try:
    module = gin.get_configurable(network.Transformer)()
  finally:
    gin.clear_config()
  init_rng = jax.random.split(jax.random.PRNGKey(0), 2)[0]
  fresh = conftest.flat(module.init(
      init_rng, np.ones((1, 8), np.int32), np.ones((1, 4), np.int32),
      np.ones((1, 4), np.int32), enable_dropout=False,
      task_ids=np.zeros((1,), np.int32))['params'])
  new = [k for k in params if param_groups.is_task_conditioned(k)]
  assert new and all('hyperprompt' in k for k in new)
  for k in new:
    np.testing.assert_allclose(params[k], fresh[k], rtol=1e-6, atol=0,
                               err_msg=k)

  # The optimizer state is make_optimizer's, fresh (the checkpoint's t5x
  # Adafactor state under other names was not restored).
  opt = {k: v for k, v in state.items() if k.startswith('state/param_states/')}
  assert opt and all(k.startswith('state/param_states/inner_states/')
                     for k in opt)
  assert all(not v.any() for v in opt.values())


def test_t5x_adds_a_task_and_trains_only_its_parameters(quickstart_dir,
                                                        tmp_path):
  """import_task_params grows the t5x quickstart's checkpoint to 17 tasks;
  t5x trains the new task from it (t5x/quickstart_add_task.gin): the
  backbone, the shared parameters and the 16 trained tasks' parameters stay
  bit-identical, task 16's train."""
  grown = tmp_path / 'grown'
  _run('hyperprompt_jax.import_task_params',
       '--gin_file=runs/quickstart_model.gin', '--gin.NUM_TASKS=17',
       f'--checkpoint_path={quickstart_dir / "checkpoint_2"}',
       f'--output_dir={grown}')
  model_dir = tmp_path / 'model'
  _run('t5x.train', GIN_SEARCH_PATHS, '--gin_file=t5x/quickstart_add_task.gin',
       f"--gin.MODEL_DIR='{model_dir}'",
       f"--gin.INITIAL_CHECKPOINT_PATH='{grown / 'checkpoint_0'}'",
       '--gin.TRAIN_STEPS=2', '--gin.SAVE_PERIOD=2', *QUICK)
  before = _read_t5x_state(grown / 'checkpoint_0')
  after = _read_t5x_state(model_dir / 'checkpoint_2')
  trained = _read_t5x_state(quickstart_dir / 'checkpoint_2')
  gin.clear_config()
  gin_utils.parse_gin(['runs/quickstart_model.gin'], ['NUM_TASKS = 17'])
  try:
    axes = task_params.task_axes(gin.get_configurable(network.Transformer)())
  finally:
    gin.clear_config()
  params = [k for k in before if k.startswith('target/')]
  assert params and any(k[len('target/'):] in axes for k in params)
  for k in params:
    path = k[len('target/'):]
    if path not in axes:
      assert before[k].tobytes() == after[k].tobytes() == trained[k].tobytes()
      continue
    tasks = lambda x, a=axes[path]: np.moveaxis(x, a, 0)
    assert tasks(before[k])[:16].tobytes() == tasks(trained[k]).tobytes()
    assert tasks(after[k])[:16].tobytes() == tasks(trained[k]).tobytes(), k
    assert not np.array_equal(tasks(after[k])[16], tasks(before[k])[16]), k


# ---------------------------------------------- the adapter, in process --

def _tiny_config(kind: str) -> network.T5Config:
  cfg = dict(vars(conftest.T5X_TINY_CONFIG), num_tasks=NUM_TASKS)
  if kind == 'hyperprompt_global':
    cfg['hyperprompt'] = hyperprompt.HyperPromptConfig(
        variant='global', encoder_prompt_length=3, decoder_prompt_length=2,
        hypernet_reduction=8, task_embed_dim=8, task_hidden_dim=16,
        layer_task_embed_dim=8)
  elif kind == 'hypergrid_lg':
    cfg['hypergrid'] = hypergrid.HyperGridConfig(variant='lg', grid_rows=4,
                                                 grid_cols=8)
  elif kind == 'hyperformer_pp':  # adapters in both stacks
    cfg['hyperformer'] = hyperformer.HyperFormerConfig(
        reduction=8, task_embed_dim=8, task_hidden_dim=16, projected_dim=8)
  else:  # prompt_tuning: `encoded` is longer than the inputs
    cfg['prompt_tuning'] = prompt_tuning.PromptTuningConfig(prompt_length=3)
  return network.T5Config(**cfg)


def _t5x_model(kind: str, **kwargs) -> t5x_model.TaskIdsEncoderDecoderModel:
  vocabulary = seqio.ByteVocabulary()
  return t5x_model.TaskIdsEncoderDecoderModel(
      module=network.Transformer(_tiny_config(kind)),
      input_vocabulary=vocabulary, output_vocabulary=vocabulary,
      optimizer_def=t5x_optimizers.OptaxWrapper(optimizers.make_optimizer()),
      z_loss=1e-4, loss_normalizing_factor='NUM_REAL_TARGET_TOKENS',
      **kwargs)


def _batch(rng: np.random.Generator, decode_length: int = 6) -> dict:
  enc = conftest.random_tokens(rng, (4, 10), pad_from=[10, 7, 4, 9])
  targets = conftest.random_tokens(rng, (4, decode_length),
                                   pad_from=[6, 3, 5, 2])
  for row, end in enumerate([5, 2, 4, 1]):
    targets[row, end] = 1  # EOS
  return {'encoder_input_tokens': enc,
          'decoder_input_tokens': conftest.decoder_inputs(targets),
          'decoder_target_tokens': targets,
          'decoder_loss_weights': (targets > 0).astype(np.int32),
          'task_ids': np.array([0, 9, 3, 9], np.int32)}


def _until_eos(tokens: np.ndarray) -> np.ndarray:
  """`[rows, length]` weights: 1 up to and including each row's first EOS
  (every position when there is none)."""
  eos = tokens == 1
  after = np.cumsum(eos, -1) - eos > 0  # strictly after the first EOS
  return (~after).astype(np.float64)


def _log_likelihood(module, params, enc, task_ids, targets, weights):
  """Independent reference: the network's teacher-forced forward (no target
  padding mask, so a decoded 0 counts like any token) and a numpy
  log-softmax, summed over the weighted positions of each row."""
  logits = np.asarray(module.apply(
      {'params': params}, enc, conftest.decoder_inputs(targets),
      np.ones_like(targets), enable_dropout=False, task_ids=task_ids),
                      np.float64)
  top = logits.max(-1, keepdims=True)
  log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  token = np.take_along_axis(logits, targets[..., None], -1)[..., 0] - log_z
  return (token * weights).sum(-1)


@pytest.fixture(scope='module', params=['hyperprompt_global', 'hypergrid_lg',
                                        'hyperformer_pp', 'prompt_tuning'])
def model_and_params(request):
  model = _t5x_model(request.param)
  shapes = {'encoder_input_tokens': (4, 10), 'decoder_input_tokens': (4, 6),
            'task_ids': (4,)}
  params = model.get_initial_variables(jax.random.PRNGKey(1), shapes)['params']
  return model, flax.core.unfreeze(params)


def test_loss_fn_equals_the_project_loss(model_and_params):
  model, params = model_and_params
  batch = _batch(np.random.default_rng(0))
  loss, metrics = jax.jit(model.loss_fn)(params, batch, None)
  logits = model.module.apply(
      {'params': params}, batch['encoder_input_tokens'],
      batch['decoder_input_tokens'], batch['decoder_target_tokens'],
      enable_dropout=False, task_ids=batch['task_ids'])
  want = losses.cross_entropy_with_z_loss(
      logits, batch['decoder_target_tokens'], batch['decoder_loss_weights'],
      z_loss=1e-4)
  np.testing.assert_allclose(loss, want['loss'], rtol=1e-5)
  np.testing.assert_allclose(metrics['accuracy'].compute(),
                             100 * want['accuracy'], rtol=1e-5)
  # The task ids are used: other ids, another loss.
  other = dict(batch, task_ids=np.array([5, 1, 12, 2], np.int32))
  assert abs(float(model.loss_fn(params, other, None)[0]) - float(loss)) > 1e-6


def test_score_batch_is_the_log_likelihood(model_and_params):
  model, params = model_and_params
  batch = _batch(np.random.default_rng(1))
  got = jax.jit(model.score_batch)(params, batch)
  want = _log_likelihood(model.module, params, batch['encoder_input_tokens'],
                         batch['task_ids'], batch['decoder_target_tokens'],
                         batch['decoder_loss_weights'])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_missing_task_ids_name_the_feature_converter(model_and_params):
  model, params = model_and_params
  batch = _batch(np.random.default_rng(1))
  del batch['task_ids']
  with pytest.raises(ValueError, match='TaskIdsEncDecFeatureConverter'):
    model.loss_fn(params, batch, None)


def test_beam_search_of_width_1_equals_greedy_decoding(model_and_params):
  """t5x's beam search with num_decodes=1 against the project's greedy
  decoding on the same parameters. Beam search keeps an EOS hypothesis
  whenever EOS is among the two best tokens, which greedy decoding never
  revisits; so the end token is one that is never among the two best along
  the greedy path, where both must then produce that path."""
  model, params = model_and_params
  batch = _batch(np.random.default_rng(2))
  enc, ids = batch['encoder_input_tokens'], batch['task_ids']
  length = batch['decoder_input_tokens'].shape[1]
  path = np.asarray(decoding.greedy_decode(model.module, params, enc, ids,
                                           length, eos_id=-1))
  logits = np.asarray(model.module.apply(
      {'params': params}, enc, conftest.decoder_inputs(path),
      np.ones_like(path), enable_dropout=False, task_ids=ids))
  top2 = set(np.argsort(logits, -1)[..., -2:].ravel().tolist())
  eos = min(set(range(1, logits.shape[-1])) - top2)

  greedy = np.asarray(decoding.greedy_decode(model.module, params, enc, ids,
                                             length, eos_id=eos))
  beam, _ = jax.jit(lambda p, b: model.predict_batch_with_aux(
      p, b, num_decodes=1, decoder_params={'eos_id': eos}))(params, batch)
  np.testing.assert_array_equal(greedy, path)
  np.testing.assert_array_equal(np.asarray(beam), greedy)


def test_every_beam_scores_its_log_likelihood(model_and_params):
  """num_decodes=4: each returned beam's score is the teacher-forced
  log-likelihood of that sequence for its example's task, so the cache
  (HyperPrompt's prompts) and the per-step task ids (HyperGrid's decoder
  gates) were expanded with the right rows."""
  model, params = model_and_params
  batch = _batch(np.random.default_rng(3))
  # Rows 0 and 2: one input under two tasks.
  batch['encoder_input_tokens'][2] = batch['encoder_input_tokens'][0]
  decodes, aux = jax.jit(lambda p, b: model.predict_batch_with_aux(
      p, b, num_decodes=4, return_all_decodes=True,
      decoder_params={'alpha': 0.0}))(params, batch)
  decodes, scores = np.asarray(decodes), np.asarray(aux['scores'])
  assert decodes.shape == (4, 4, 6)
  beams, scores = decodes.reshape(16, 6), scores.reshape(16)
  # Slots beam search could not fill with a finished hypothesis carry a
  # score of about -1e7 (t5x's NEG_INF); each example has a real one.
  real = scores > -1e6
  assert real.reshape(4, 4).any(axis=1).all(), scores
  weights = _until_eos(beams)
  assert not (beams * (1 - weights)).any()  # zeros after EOS
  want = _log_likelihood(model.module, params,
                         np.repeat(batch['encoder_input_tokens'], 4, 0),
                         np.repeat(batch['task_ids'], 4), beams, weights)
  np.testing.assert_allclose(scores[real], want[real], rtol=1e-4, atol=1e-4)
  # The same input under another task decodes differently.
  assert not np.allclose(scores[0:4], scores[8:12])


def test_cache_holds_the_prompts_of_each_example_task():
  """HyperPrompt's decoder prompts are generated when the cache is created,
  for each row's own task: equal ids give equal prefix entries."""
  model = _t5x_model('hyperprompt_global')
  params = model.get_initial_variables(
      jax.random.PRNGKey(1), {'encoder_input_tokens': (4, 10),
                              'decoder_input_tokens': (4, 6)})['params']
  batch = _batch(np.random.default_rng(4))
  encoded = model.module.apply(
      {'params': params}, batch['encoder_input_tokens'], enable_dropout=False,
      task_ids=batch['task_ids'], method=model.module.encode)
  cache, index = model._compute_kv_cache(  # pylint: disable=protected-access
      params, encoded, batch['encoder_input_tokens'],
      batch['decoder_input_tokens'], task_ids=batch['task_ids'])
  assert index is None
  prefix = np.asarray(
      cache['decoder']['layers_0']['self_attention']['cached_prefix_key'])
  assert prefix.shape[:2] == (4, 2)  # [batch, decoder prompt length, ...]
  np.testing.assert_array_equal(prefix[1], prefix[3])  # both task 9
  assert not np.allclose(prefix[0], prefix[1])


# ------------------------------------------- partitioning and optimizer --

def test_partitioner_rules_cover_the_train_state_axes():
  """t5x/model.gin gives t5x's partitioner the project's rules, and they
  name every logical axis of the train state (parameters and the optax
  Adafactor state), task-conditioning axes included; a name without a
  rule would be replicated silently."""
  saved = sys.modules['__main__']
  sys.modules['__main__'] = importlib.import_module('t5x.train')
  try:
    gin_utils.parse_gin(['t5x/train.gin', 'models/t5_1_1_tiny.gin'], [],
                        [T5X_ROOT])
    rules = gin.get_configurable(t5x_partitioning.PjitPartitioner)(
        )._logical_axis_rules  # pylint: disable=protected-access
  finally:
    sys.modules['__main__'] = saved
    gin.clear_config()
  assert tuple(rules) == tuple(partitioning.logical_axis_rules())
  names = {name for name, _ in rules}

  for kind in ('hyperprompt_global', 'hypergrid_lg'):
    model = _t5x_model(kind)
    shapes = {'encoder_input_tokens': (4, 10), 'decoder_input_tokens': (4, 6)}
    state = jax.eval_shape(
        lambda: t5x_train_state.FlaxOptimTrainState.create(
            model.optimizer_def,  # pylint: disable=cell-var-from-loop
            model.get_initial_variables(jax.random.PRNGKey(0), shapes)))
    axes = state.as_logical_axes()
    used = set()
    for spec in jax.tree.leaves(axes.state_dict(),
                                is_leaf=lambda x: isinstance(
                                    x, t5x_partitioning.PartitionSpec)):
      if isinstance(spec, t5x_partitioning.PartitionSpec):
        used.update(a for a in spec if a is not None)
    assert used <= names, used - names
    if kind == 'hyperprompt_global':
      assert {'task_hidden', 'tasks', 'prompt_length'} <= used
    partitioner = t5x_partitioning.PjitPartitioner(
        num_partitions=1, logical_axis_rules=rules)
    partitioner.get_mesh_axes(state)  # no unregistered optax state


def test_adafactor_state_axes():
  """Unfactored second moments follow their parameter's axes; factored ones
  (and the placeholder `v` of a factored parameter) are replicated; a
  parameter of another optimizer group is masked out of a group's state."""
  spec = t5x_partitioning.PartitionSpec
  params = flax.core.freeze({
      'encoder': {'mlp': {'kernel': jnp.zeros((256, 128))},
                  'norm': {'scale': jnp.zeros((64,))}},
      'hyperprompt': {'prompts': jnp.zeros((8, 4, 64))}})
  axes = flax.core.freeze({
      'encoder': {'mlp': {'kernel': spec('embed', 'mlp')},
                  'norm': {'scale': spec('embed')}},
      'hyperprompt': {'prompts': spec('tasks', 'prompt_length', 'embed')}})
  opt = t5x_optimizers.OptaxWrapper(optimizers.make_optimizer())
  derived = opt.derive_logical_axes(opt.create(params), axes)
  flat = traverse_util.flatten_dict(flax.core.unfreeze(
      derived.state_dict()['state']['param_states']), sep='/')
  backbone = 'inner_states/backbone/inner_state/0'
  conditioned = 'inner_states/task_conditioned/inner_state/0'
  assert flat[f'{backbone}/v/encoder/mlp/kernel'] is None  # factored
  assert flat[f'{backbone}/v_row/encoder/mlp/kernel'] is None
  assert flat[f'{backbone}/v/encoder/norm/scale'] == spec('embed')
  assert flat[f'{conditioned}/v/hyperprompt/prompts'] == spec(
      'tasks', 'prompt_length', 'embed')
  assert not any(k.startswith(backbone) and 'hyperprompt' in k for k in flat)


# ------------------------------------------- the two runners' train step --

def test_t5x_train_step_equals_the_builtin_step():
  """Issue 17: from the same parameters and batches, t5x's train step
  (`t5x.trainer.Trainer` with the adapter and `OptaxWrapper(make_optimizer)`,
  as t5x/model.gin builds them) and the built-in `Trainer.step` give the
  same parameters and optimizer state, step after step. With dropout: both
  take step n's dropout rng as fold_in(rng, n), t5x's rng being the
  trainer's (train.py: the second half of split(PRNGKey(RANDOM_SEED))), the
  built-in runner's PRNGKey(seed); given the same rng, the same masks."""
  _assert_t5x_steps_equal_the_builtin_steps(balancing=None)


@pytest.mark.parametrize('auxiliaries', ['each', 'all'])
def test_t5x_metabalance_step_equals_the_builtin_step(auxiliaries):
  """Issue 30: t5x's `MetaBalanceTrainer` (gin/t5x/metabalance.gin) and the
  built-in runner with the same MetaBalance plan take the same steps: the
  same parameters, optimizer state and moving averages (t5x's flax
  mutables, the built-in state's 'metabalance'), step after step. Task 9 is
  the target (two rows of each batch); 0 and 3 are the auxiliaries."""
  module = network.Transformer(_tiny_config('hyperprompt_global'))
  plan = metabalance.make_plan(
      metabalance.Settings(target_task='t9', auxiliaries=auxiliaries),
      [f't{i}' for i in range(NUM_TASKS)], ['t0', 't3', 't9'],
      task_params.task_axes(module))
  assert plan.num_auxiliary == (2 if auxiliaries == 'each' else 1)
  _assert_t5x_steps_equal_the_builtin_steps(balancing=plan)


def _assert_t5x_steps_equal_the_builtin_steps(balancing):
  """Three steps of t5x's trainer (MetaBalance's with `balancing`) and of
  the built-in `Trainer` from the same parameters and batches agree."""
  from t5x import trainer as t5x_trainer  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.training import trainer as trainer_lib  # pylint: disable=g-import-not-at-top

  learning_rate = 1e-2  # the quickstart's: larger steps, larger differences
  vocabulary = seqio.ByteVocabulary()
  model = t5x_model.TaskIdsEncoderDecoderModel(
      module=network.Transformer(dataclasses.replace(
          _tiny_config('hyperprompt_global'), dropout_rate=0.1)),
      input_vocabulary=vocabulary, output_vocabulary=vocabulary,
      optimizer_def=t5x_optimizers.OptaxWrapper(
          optimizers.make_optimizer(learning_rate=learning_rate)),
      z_loss=1e-4, loss_normalizing_factor='NUM_REAL_TARGET_TOKENS')
  # The plan as the constructor makes it from gin (balancing.run_plan),
  # without registering a mixture.
  model.balancing = balancing
  variables = model.get_initial_variables(
      jax.random.PRNGKey(1), {'encoder_input_tokens': (4, 10),
                              'decoder_input_tokens': (4, 6)})
  # Host copies: both steps donate their state's buffers.
  variables = jax.tree.map(np.array, flax.core.unfreeze(variables))
  params = variables['params']
  rng = np.random.default_rng(5)
  batches = [_batch(rng) for _ in range(3)]

  # t5x: its trainer, partitioner (the project's rules) and train state.
  rules = partitioning.logical_axis_rules()
  partitioner = t5x_partitioning.PjitPartitioner(num_partitions=1,
                                                 logical_axis_rules=rules)
  state = t5x_train_state.FlaxOptimTrainState.create(
      model.optimizer_def, flax.core.freeze(variables))
  trainer_cls = (t5x_trainer.Trainer if balancing is None
                 else metabalance_trainer.MetaBalanceTrainer)
  trainer = trainer_cls(
      model, state, partitioner, eval_names=[], summary_dir=None,
      train_state_axes=partitioner.get_mesh_axes(state),
      rng=jax.random.PRNGKey(0), learning_rate_fn=lambda step: learning_rate,
      num_microbatches=None)
  # The built-in runner, on the same parameters.
  builtin = trainer_lib.Trainer(
      model.module, optimizers.make_optimizer(learning_rate=learning_rate),
      partitioning.create_mesh(-1, 1), {'inputs': 10, 'targets': 6},
      z_loss=1e-4, seed=0, balancing=balancing)
  builtin_state = builtin.new_state(
      jax.device_put(params, builtin.param_shardings))

  for step, batch in enumerate(batches, 1):
    # One step: float32 rounding (t5x's custom cross-entropy gradient, other
    # reduction orders), ~1e-8 on updates of ~1e-2. Adafactor divides by
    # the root of second moments, so later steps amplify it on parameters
    # with tiny gradients; still ~1e-6 on updates of ~3e-2 by step 3.
    atol = 5e-8 if step == 1 else 2e-6
    trainer.train(iter([batch]), num_steps=1)
    builtin_state, _ = builtin.step(builtin_state, builtin.global_batch(batch))
    t5x_state = trainer.train_state
    assert int(t5x_state.step) == int(builtin_state['step']) == step
    got = conftest.flat(flax.core.unfreeze(t5x_state.params))
    want = conftest.flat(builtin_state['params'])
    before = conftest.flat(params)
    assert got.keys() == want.keys()
    for k in want:
      assert not np.array_equal(want[k], before[k]), f'{k} did not move'
      np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=atol,
                                 err_msg=f'step {step}: {k}')
    got_opt = jax.tree.leaves(t5x_state.param_states)
    want_opt = jax.tree.leaves(builtin_state['opt_state'])
    assert len(got_opt) == len(want_opt)
    for g, w in zip(got_opt, want_opt):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4,
                                 atol=1e-10)
    if balancing is not None:
      got_m = conftest.flat(flax.core.unfreeze(
          t5x_state.flax_mutables)[t5x_model.METABALANCE])
      want_m = conftest.flat(builtin_state['metabalance']._asdict())
      assert got_m.keys() == want_m.keys()
      for k in want_m:
        assert np.all(want_m[k] > 0), k  # every share has tokens
        np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-5,
                                   err_msg=f'step {step}: {k}')
  trainer.close()


def test_t5x_metabalance_in_microbatches_is_the_one_batch_step():
  """t5x's `MetaBalanceTrainer` with num_microbatches 2 and 4 takes its
  one-batch step (every share's gradient summed over the parts, each part's
  loss over the whole batch's NUM_REAL_TARGET_TOKENS): the same parameters
  and moving averages, two steps, rel <= 1e-5 (the issue's bound; the
  gradients' float32 rounding is derived in `tests/test_microbatches.py`).
  Plain SGD, whose update is linear in the gradient: Adafactor moves an
  entry whose gradient is ~0 by a full step of the sign rounding gives it
  (one entry of `logits_dense` flips between the orders). Dropout 0: the
  parts draw other masks than the whole batch. One encoder and one decoder
  layer."""
  from t5x import trainer as t5x_trainer  # pylint: disable=g-import-not-at-top

  vocabulary = seqio.ByteVocabulary()
  model = t5x_model.TaskIdsEncoderDecoderModel(
      module=network.Transformer(dataclasses.replace(
          _tiny_config('hyperprompt_global'), num_encoder_layers=1,
          num_decoder_layers=1, dropout_rate=0.0)),
      input_vocabulary=vocabulary, output_vocabulary=vocabulary,
      optimizer_def=t5x_optimizers.OptaxWrapper(optax.sgd(1e-2)),
      z_loss=1e-4, loss_normalizing_factor='NUM_REAL_TARGET_TOKENS')
  model.balancing = metabalance.make_plan(
      metabalance.Settings(target_task='t9'),
      [f't{i}' for i in range(NUM_TASKS)], ['t0', 't3', 't9'],
      task_params.task_axes(model.module))
  variables = jax.tree.map(np.array, flax.core.unfreeze(
      model.get_initial_variables(
          jax.random.PRNGKey(1), {'encoder_input_tokens': (4, 10),
                                  'decoder_input_tokens': (4, 6)})))
  rng = np.random.default_rng(5)
  batches = [_batch(rng) for _ in range(2)]
  partitioner = t5x_partitioning.PjitPartitioner(
      num_partitions=1, logical_axis_rules=partitioning.logical_axis_rules())

  def train(num_microbatches):
    state = t5x_train_state.FlaxOptimTrainState.create(
        model.optimizer_def, flax.core.freeze(variables))
    trainer = metabalance_trainer.MetaBalanceTrainer(
        model, state, partitioner, eval_names=[], summary_dir=None,
        train_state_axes=partitioner.get_mesh_axes(state),
        rng=jax.random.PRNGKey(0), learning_rate_fn=lambda step: 1e-2,
        num_microbatches=num_microbatches)
    assert isinstance(trainer, t5x_trainer.Trainer)
    trainer.train(iter(batches), num_steps=len(batches))
    state = trainer.train_state
    trainer.close()
    return (conftest.flat(flax.core.unfreeze(state.params)),
            conftest.flat(flax.core.unfreeze(
                state.flax_mutables)[t5x_model.METABALANCE]))

  want, want_m = train(None)
  for n in (2, 4):
    got, got_m = train(n)
    for k in want:
      conftest.assert_close_in_norm(got[k], want[k], 1e-5, f'{n} parts: {k}')
    for k in want_m:
      assert np.all(want_m[k] > 0), k
      conftest.assert_close_in_norm(got_m[k], want_m[k], 1e-5,
                                    f'{n} parts: {k}')


@pytest.mark.parametrize('packed', [False, True])
def test_loss_shares_are_t5x_loss_over_each_share_tokens(packed):
  """`loss_shares` (MetaBalance's split of t5x's loss, label smoothing and
  z-loss included): each share is t5x's own `loss_fn` on the batch with the
  weights of the share's tokens only, rescaled from their count to all real
  target tokens; so the shares sum to the loss. Packed rows split per
  token (tasks 2, 0, 1 share rows)."""
  import test_packing  # pylint: disable=g-import-not-at-top
  model = _t5x_model('hyperprompt_global', label_smoothing=0.1)
  plan = metabalance.make_plan(
      metabalance.Settings(target_task='t1'),
      [f't{i}' for i in range(NUM_TASKS)], ['t0', 't1', 't2'],
      task_params.task_axes(model.module))
  examples = test_packing._examples(0)  # pylint: disable=protected-access
  batch = (test_packing._packed(examples, test_packing.ROWS, 22, 10)[0]  # pylint: disable=protected-access
           if packed else test_packing._unpacked(examples, 8, 5))  # pylint: disable=protected-access
  params = model.get_initial_variables(
      jax.random.PRNGKey(1), {'encoder_input_tokens': (4, 10),
                              'decoder_input_tokens': (4, 6)})['params']
  in_share = metabalance.group_masks(plan, model.token_task_ids(batch),
                                     NUM_TASKS)
  shares, metrics = jax.jit(model.loss_shares)(params, batch, None, in_share)
  loss, want_metrics = jax.jit(model.loss_fn)(params, batch, None)
  np.testing.assert_allclose(shares.sum(), loss, rtol=1e-5)
  np.testing.assert_allclose(metrics['loss'].compute(),
                             want_metrics['loss'].compute(), rtol=1e-5)
  weights = batch['decoder_loss_weights']
  for g, tasks in enumerate([(1,), (0,), (2,)]):  # target t1, then t0, t2
    mask = np.asarray(in_share[..., g])
    assert mask.sum() > 0
    np.testing.assert_array_equal(
        mask > 0, np.isin(np.asarray(model.token_task_ids(batch)), tasks))
    only = dict(batch, decoder_loss_weights=weights * mask)
    share, _ = jax.jit(model.loss_fn)(params, only, None)
    np.testing.assert_allclose(
        shares[g], share * (weights * mask).sum() / weights.sum(), rtol=1e-5)


@pytest.mark.parametrize('kind', ['hyperprompt_global', 'prompt_tuning',
                                  'hypergrid_lg'])
def test_packed_loss_fn_equals_the_unpacked_one(kind):
  """t5x's loss on packed rows (per-token task ids, from the model's own
  converter for Prompt-Tuning's slots and HyperGrid's bound on examples a
  row) is the loss of the same examples one per row."""
  import test_packing  # pylint: disable=g-import-not-at-top
  model = _t5x_model(kind)
  n_slots = prompt_tuning.prompt_length(model.module.config.prompt_tuning)
  converter = model.FEATURE_CONVERTER_CLS(pack=True)
  assert converter._input_prompt_length == n_slots  # pylint: disable=protected-access
  hg = model.module.config.hypergrid
  assert converter._max_examples_per_row == (  # pylint: disable=protected-access
      hg and hg.max_segments)
  examples = test_packing._examples(0)  # pylint: disable=protected-access
  unpacked = test_packing._unpacked(examples, 8, 5)  # pylint: disable=protected-access
  packed, _ = test_packing._packed(  # pylint: disable=protected-access
      examples, test_packing.ROWS, 22, 10, n_slots)
  params = model.get_initial_variables(
      jax.random.PRNGKey(1), {'encoder_input_tokens': (4, 10),
                              'decoder_input_tokens': (4, 6)})['params']
  want, _ = jax.jit(model.loss_fn)(params, unpacked, None)
  loss, _ = jax.jit(model.loss_fn)(params, packed, None)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
