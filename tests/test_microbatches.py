"""Gradient accumulation (NUM_MICROBATCHES): the batch's gradient
taken part by part is the one-batch update, packed or not."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

import conftest
from hyperprompt_jax import task_params
from hyperprompt_jax.common import batches as batch_lib
from hyperprompt_jax.common import input_pipeline
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.model import network
from hyperprompt_jax.runner import training_loop
from hyperprompt_jax.t5 import losses
from hyperprompt_jax.training import metabalance
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import run_settings
from hyperprompt_jax.training import trainer as trainer_lib

LENGTHS = {'inputs': 64, 'targets': 8}


@pytest.fixture(scope='module')
def model():
  """Tiny HyperPrompt-Global over the 8 fixture GLUE task ids (each row's
  prompts are its task's: the parts must keep rows and ids together), one
  encoder and one decoder layer (the parts split rows, not layers)."""
  return network.Transformer(dataclasses.replace(
      conftest.T5X_TINY_CONFIG, num_tasks=8, num_encoder_layers=1,
      num_decoder_layers=1,
      hyperprompt=conftest.TINY_GLOBAL_PROMPTS))


@pytest.fixture(scope='module')
def params(model):
  """The trainer's fresh parameters (seed 0), initialised once (numpy)."""
  return jax.device_get(jax.jit(lambda r: network.init_variables(
      model, r, LENGTHS['inputs'], LENGTHS['targets'])['params'])(
          jax.random.PRNGKey(0)))


def _reductions(model):
  """The model's reductions (`conftest.t5_reduction_lengths`: 8 rows of 64
  and 8 tokens, the prompts more keys)."""
  prompts = model.config.hyperprompt
  return conftest.t5_reduction_lengths(
      model.config, 8, LENGTHS['inputs'], LENGTHS['targets'],
      prompts.encoder_prompt_length, prompts.decoder_prompt_length)


def _bound(model):
  """The relative difference two orders of the model's sums may make in a
  gradient (`conftest.float32_bound`)."""
  return conftest.float32_bound(*_reductions(model))


def _loss_bound(model):
  """... in the loss: the forward half, then the sum over the 8 x 8
  target tokens."""
  reductions = _reductions(model)
  return conftest.float32_bound(*reductions[:len(reductions) // 2], 64)


def _unpacked_batch(rng):
  targets = conftest.random_tokens(rng, (8, 8),
                                   pad_from=[8, 3, 5, 2, 8, 6, 1, 4])
  return {
      'encoder_input_tokens': conftest.random_tokens(
          rng, (8, 64), pad_from=[64, 20, 9, 33, 64, 5, 40, 12]),
      'decoder_input_tokens': conftest.decoder_inputs(targets),
      'decoder_target_tokens': targets,
      'decoder_loss_weights': (targets > 0).astype(np.int32),
      'task_ids': np.array([7, 0, 1, 7, 2, 5, 6, 3], np.int32)}


@pytest.fixture(scope='module')
def batches():
  """Two unpacked and two packed batches of 8 rows (the packed ones the
  pipeline's: several tasks per row, rows of different token counts)."""
  rng = np.random.default_rng(0)
  packed = iter(input_pipeline.train_dataset(
      'fixture_glue_proportional', LENGTHS, 8, seed=0,
      rows=batch_lib.RowFormat(packed=True)))
  return {False: [_unpacked_batch(rng) for _ in range(2)],
          True: [input_pipeline.as_numpy(next(packed)) for _ in range(2)]}


def _steps(model, params, batches, num_microbatches):
  trainer = trainer_lib.Trainer(
      model, optimizers.make_optimizer(learning_rate=1e-2),
      partitioning.create_mesh(-1, 1), LENGTHS, z_loss=1e-4, seed=0,
      num_microbatches=num_microbatches)
  state = trainer.new_state(jax.device_put(params, trainer.param_shardings))
  losses_seen = []
  for batch in batches:
    state, terms = trainer.step(state, trainer.global_batch(batch))
    losses_seen.append(float(terms['loss']))
  return conftest.flat(jax.device_get(state['params'])), losses_seen


@pytest.mark.parametrize('packed', [False, True], ids=['unpacked', 'packed'])
def test_microbatched_grads_are_the_one_batch_grads(model, params, batches,
                                                    packed):
  """`microbatched_grads` in 2 and 4 parts against `jax.grad` of the whole
  batch's loss (normalised over all its real target tokens): the loss, the
  accuracy and every gradient, to float32 rounding (`_bound`): the loss
  terms within its forward half, the counts exactly."""
  batch = jax.tree.map(np.asarray, batches[packed][0])
  rng = jax.random.PRNGKey(3)
  (loss, terms), grads = jax.jit(jax.value_and_grad(
      lambda p: trainer_lib.loss_fn(model, p, batch, rng, 1e-4),
      has_aux=True))(params)
  want = conftest.flat(grads)
  for n in (2, 4):
    (got_loss, got_terms), got = jax.jit(
        lambda p, n=n: trainer_lib.microbatched_grads(
            model, p, batch, rng, 1e-4, None, n))(params)
    for key, value in (('loss', got_loss), ('cross_entropy', None),
                       ('z_loss', None), ('accuracy', None)):
      conftest.assert_close_in_norm(
          got_terms[key] if value is None else value,
          loss if value is not None else terms[key], _loss_bound(model),
          key)
    np.testing.assert_array_equal(got_terms['tokens'], terms['tokens'])
    got = conftest.flat(got)
    assert got.keys() == want.keys()
    for k in want:
      assert np.abs(want[k]).max() > 0, k
      conftest.assert_close_in_norm(got[k], want[k], _bound(model),
                                    f'{n} parts: {k}')


@pytest.mark.parametrize('packed, n', [(False, 2), (True, 4)],
                         ids=['unpacked', 'packed'])
def test_microbatched_steps_are_the_one_batch_steps(model, params, batches,
                                                    packed, n):
  """Two optimizer steps with NUM_MICROBATCHES = n give the parameters of
  two one-batch steps (Adafactor's update of the same gradient) and the
  same logged losses, to float32 rounding: the update within 3 times the
  gradient's bound (Adafactor divides the gradient by the root of its
  second moments, which round as the gradient's square, then by its RMS
  for clipping), the parameters within that and one rounding of the sum.
  (2 and 4 parts each, packed and unpacked: the gradients' test above.)"""
  want, want_losses = _steps(model, params, batches[packed], None)
  got, got_losses = _steps(model, params, batches[packed], n)
  conftest.assert_close_to_scale(got_losses, want_losses,
                                 _loss_bound(model), np.abs(want_losses))
  start = conftest.flat(params)
  for k in want:
    update = np.linalg.norm(want[k] - start[k])
    conftest.assert_close_in_norm(got[k] - start[k], want[k] - start[k],
                                  3 * _bound(model), f'{n} parts: Δ{k}')
    conftest.assert_close_in_norm(
        got[k], want[k], 3 * _bound(model) * update / np.linalg.norm(
            want[k]) + conftest.float32_bound(1), f'{n} parts: {k}')


# MetaBalance over the fixture GLUE ids: target glue_rte (id 7), every other
# task an auxiliary ('each': K = 7; the unpacked batches lack qqp and mnli,
# so absent shares are crossed too).
TASKS = ('glue_cola', 'glue_sst2', 'glue_mrpc', 'glue_stsb', 'glue_qqp',
         'glue_mnli', 'glue_qnli', 'glue_rte')


def _plan(model):
  return metabalance.make_plan(metabalance.Settings(target_task='glue_rte'),
                               TASKS, TASKS, task_params.task_axes(model))


def _metabalance_bounds(model):
  """float32 bounds of the part-by-part MetaBalance step against the
  one-batch one (`conftest.float32_bound`): a share's gradient is a sum in
  another order (g, the model's reductions); its norm is within g, so an
  auxiliary's scale r·m_tar/m_i + (1 - r) within 2g and the balanced sum
  (an SGD update) within 3g. The moving averages within g."""
  prompts = model.config.hyperprompt
  g = conftest.float32_bound(*conftest.t5_reduction_lengths(
      model.config, 8, LENGTHS['inputs'], LENGTHS['targets'],
      prompts.encoder_prompt_length, prompts.decoder_prompt_length))
  return {'grads': 3 * g, 'averages': g}


@pytest.mark.parametrize('packed', [False, True], ids=['unpacked', 'packed'])
def test_metabalance_in_parts_is_the_one_batch_metabalance(model, params,
                                                           batches, packed):
  """`balanced_grads` in 2 and 4 parts against the one-batch form (itself
  Algorithm 2 in numpy: `test_metabalance.py`): every share's gradient the
  whole batch's, so the same balanced gradient, moving averages and loss
  terms, over two calls (the second from non-zero averages)."""
  plan = _plan(model)
  bounds = _metabalance_bounds(model)
  rng = jax.random.PRNGKey(3)
  state = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype),
                       metabalance.shared_state_shapes(plan, params))
  batch = jax.tree.map(np.asarray, batches[packed][0])
  results = {}
  for n in (1, 2, 4):
    step = jax.jit(lambda s, n=n: trainer_lib.balanced_grads(
        model, params, s, batch, rng, 1e-4, None, plan, n))
    s, seen = state, []
    for _ in range(2):
      grads, s, terms = step(s)
      seen.append((conftest.flat(grads), s, terms))
    results[n] = seen
  for n in (2, 4):
    for (want, want_state, want_terms), (got, got_state, got_terms) in zip(
        results[1], results[n]):
      assert got.keys() == want.keys()
      for k in want:
        assert np.abs(want[k]).max() > 0, k
        conftest.assert_close_in_norm(got[k], want[k], bounds['grads'],
                                      f'{n} parts: {k}')
      for name, w, g in [('m_tar', want_state.target, got_state.target),
                         ('m_aux', want_state.auxiliary,
                          got_state.auxiliary)]:
        w, g = conftest.flat(w), conftest.flat(g)
        for k in w:
          conftest.assert_close_in_norm(g[k], w[k], bounds['averages'],
                                        f'{n} parts: {name} {k}')
      for key in ('loss', 'accuracy', 'tokens', 'task_tokens'):
        conftest.assert_close_in_norm(got_terms[key], want_terms[key],
                                      bounds['averages'], key)


def _balanced_steps(model, params, batches, num_microbatches):
  plan = _plan(model)
  trainer = trainer_lib.Trainer(
      model, optax.sgd(1e-2), partitioning.create_mesh(-1, 1), LENGTHS,
      z_loss=1e-4, seed=0, balancing=plan,
      num_microbatches=num_microbatches)
  state = trainer.new_state(jax.device_put(params, trainer.param_shardings))
  state, terms = trainer.step(state, trainer.global_batch(batches[0]))
  state = jax.device_get(state)
  return (conftest.flat(state['params']),
          conftest.flat(state[trainer_lib.METABALANCE]._asdict()),
          float(terms['loss']))


@pytest.mark.parametrize('packed, n', [(False, 2), (True, 4)],
                         ids=['unpacked', 'packed'])
def test_metabalance_steps_in_parts_are_the_one_batch_steps(
    model, params, batches, packed, n):
  """The built-in runner's step (`Trainer`) with MetaBalance and
  NUM_MICROBATCHES = n gives the one-batch MetaBalance step: its
  parameters (the update within the bound of float32 rounding), its moving
  averages and the logged loss.
  Plain SGD, whose update is linear in the gradient: Adafactor moves an
  entry whose gradient is ~0 by a full step of the sign rounding gives it
  (`test_t5x.py` saw one such entry flip)."""
  bounds = _metabalance_bounds(model)
  want, want_averages, want_loss = _balanced_steps(model, params,
                                                   batches[packed], None)
  got, got_averages, got_loss = _balanced_steps(model, params,
                                                batches[packed], n)
  start = conftest.flat(params)
  assert abs(got_loss - want_loss) <= bounds['averages'] * abs(want_loss)
  for k in want:
    # The parameters: the update's bound, and one rounding of the sum.
    update = np.linalg.norm(want[k] - start[k])
    conftest.assert_close_in_norm(
        got[k], want[k], bounds['grads'] * update / np.linalg.norm(want[k])
        + conftest.float32_bound(1), f'{n} parts: {k}')
    conftest.assert_close_in_norm(got[k] - start[k], want[k] - start[k],
                                  bounds['grads'], f'{n} parts: Δ{k}')
  for k in want_averages:
    conftest.assert_close_in_norm(got_averages[k], want_averages[k],
                                  bounds['averages'], k)


def test_loss_terms_from_sums_by_hand():
  """Two tokens of one real row, one padding token: cross-entropy of
  uniform logits over 4 classes is log 4, log Z = log 4 + 0 (logits 0)."""
  logits = np.zeros((1, 3, 4), np.float32)
  targets = np.array([[1, 2, 0]])
  weights = np.array([[1, 1, 0]])
  sums = losses.weighted_sums(logits, targets, weights, z_loss=0.5)
  # float32: log Z (a sum of 4, a log), a token's terms (a product, a
  # square), the sums of 3 tokens; relative to the value.
  bound = conftest.float32_bound(4, 1, 2, 3)
  conftest.assert_close_in_norm(sums['cross_entropy'], 2 * np.log(4), bound)
  conftest.assert_close_in_norm(sums['z_loss'], 2 * 0.5 * np.log(4) ** 2,
                                bound)
  assert float(sums['tokens']) == 2
  terms = losses.terms_from_sums(sums)
  conftest.assert_close_in_norm(terms['loss'],
                                np.log(4) + 0.5 * np.log(4) ** 2, bound)


@pytest.mark.parametrize('value, shard_batch, message', [
    (0, 8, 'NUM_MICROBATCHES=0: expected None or a positive integer'),
    (-2, 8, 'NUM_MICROBATCHES=-2: expected None or a positive integer'),
    (True, 8, 'NUM_MICROBATCHES=True'),
    (2.0, 8, 'NUM_MICROBATCHES=2.0'),
    (3, 8, 'NUM_MICROBATCHES=3 does not divide the 8 rows of each data'),
])
def test_bad_num_microbatches_are_named(value, shard_batch, message):
  with pytest.raises(ValueError, match=message):
    trainer_lib.check_num_microbatches(value, shard_batch)


def test_num_microbatches_settings_that_fit():
  assert trainer_lib.check_num_microbatches(None, 8) == 1
  assert trainer_lib.check_num_microbatches(4, 8) == 4
  assert trainer_lib.check_num_microbatches(8, 8) == 8


def test_train_refuses_a_bad_num_microbatches_before_compiling(model,
                                                              tmp_path):
  """Through `train`: BATCH_SIZE 8 on one data shard, 3 parts."""
  with pytest.raises(ValueError, match='NUM_MICROBATCHES=3 does not divide'):
    training_loop.train(model, settings=run_settings.RunSettings(
        model_dir=str(tmp_path / 'run'),
        mixture_or_task_name='fixture_glue_proportional',
        task_feature_lengths=LENGTHS, train_steps=1, batch_size=8,
        num_microbatches=3,
        optimizer=optimizers.make_optimizer()))
  assert not (tmp_path / 'run').exists()
