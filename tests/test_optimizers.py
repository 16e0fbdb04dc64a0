"""make_optimizer: Adafactor groups and the freeze switch."""

import dataclasses

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import T5X_TINY_CONFIG, random_tokens
from hyperprompt_jax import hyperprompt
from hyperprompt_jax import network
from hyperprompt_jax import optimizers

CFG = dataclasses.replace(
    T5X_TINY_CONFIG, num_tasks=3,
    hyperprompt=hyperprompt.HyperPromptConfig(
        variant='global', encoder_prompt_length=2, decoder_prompt_length=2,
        hypernet_reduction=8, task_embed_dim=4, task_hidden_dim=8,
        layer_task_embed_dim=4))


@pytest.fixture(scope='module')
def setup():
  model = network.Transformer(CFG)
  rng = np.random.default_rng(0)
  enc = random_tokens(rng, (2, 6))
  tgt = random_tokens(rng, (2, 4))
  dec = np.concatenate([np.zeros((2, 1), np.int32), tgt[:, :-1]], 1)
  ids = np.array([0, 2], np.int32)
  params = model.init(jax.random.PRNGKey(0), enc, dec, tgt,
                      enable_dropout=False, task_ids=ids)['params']

  def loss_fn(p):
    logits = model.apply({'params': p}, enc, dec, tgt, enable_dropout=False,
                         task_ids=ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()

  return params, jax.grad(loss_fn)(params)


def _changed(before, after):
  flat_b = traverse_util.flatten_dict(before, sep='/')
  flat_a = traverse_util.flatten_dict(after, sep='/')
  return {k for k in flat_b if not np.array_equal(flat_b[k], flat_a[k])}


def _step(opt, params, grads):
  state = opt.init(params)
  updates, _ = opt.update(grads, state, params)
  return optax.apply_updates(params, updates)


def test_freeze_switch_updates_only_task_conditioned(setup):
  params, grads = setup
  task_paths = {k for k in traverse_util.flatten_dict(params, sep='/')
                if '/hyperprompt/' in k}
  assert task_paths
  frozen = _step(optimizers.make_optimizer(train_only_task_conditioned=True),
                 params, grads)
  assert _changed(params, frozen) == task_paths
  everything = _step(optimizers.make_optimizer(), params, grads)
  assert _changed(params, everything) == set(
      traverse_util.flatten_dict(params, sep='/'))


def test_freeze_embeddings_keeps_only_the_token_embedding(setup):
  params, grads = setup
  after = _step(optimizers.make_optimizer(freeze_embeddings=True), params,
                grads)
  everything = set(traverse_util.flatten_dict(params, sep='/'))
  assert 'token_embedder/embedding' in everything
  assert _changed(params, after) == everything - {'token_embedder/embedding'}


def test_frozen_backbone_has_no_optimizer_state(setup):
  params, _ = setup
  state = optimizers.make_optimizer(train_only_task_conditioned=True).init(
      params)
  leaves = jax.tree.leaves(state)
  n_state = sum(np.size(x) for x in leaves)
  n_task = sum(np.size(v) for k, v in traverse_util.flatten_dict(
      params, sep='/').items() if '/hyperprompt/' in k)
  # Factored Adafactor state is at most one value per task parameter (plus
  # counters); nothing for the (much larger) backbone.
  assert n_state <= n_task + 100


def test_matches_plain_adafactor_and_multipliers(setup):
  params, grads = setup
  plain = optax.adafactor(learning_rate=1e-3, decay_rate=0.8,
                          clipping_threshold=1.0,
                          multiply_by_parameter_scale=True)
  want = _step(plain, params, grads)
  got = _step(optimizers.make_optimizer(), params, grads)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6,
                                                       atol=1e-9), got, want)
  # A multiplier of 0 on the backbone freezes it too, through the rate.
  zero = _step(optimizers.make_optimizer(
      learning_rate_multipliers={'backbone': 0.0}), params, grads)
  assert all('/hyperprompt/' in k for k in _changed(params, zero))


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="Unknown learning_rate_multipliers"):
    optimizers.make_optimizer(learning_rate_multipliers={'prompts': 2.0})
  with pytest.raises(ValueError, match='learning_rate must be positive'):
    optimizers.make_optimizer(learning_rate=0.0)
