"""make_optimizer: Adafactor groups, per-scope parameter scaling and the
freeze switch."""

import dataclasses

import flax
from flax import traverse_util
import gin
import jax
import numpy as np
import optax
import pytest

from conftest import T5X_TINY_CONFIG, random_tokens
import conftest
from hyperprompt_jax.methods import hyperprompt
from hyperprompt_jax.model import network
from hyperprompt_jax.training import optimizers

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
  params = jax.jit(lambda r: model.init(r, enc, dec, tgt, enable_dropout=False,
                                        task_ids=ids)['params'])(
                                            jax.random.PRNGKey(0))

  def loss_fn(p):
    logits = model.apply({'params': p}, enc, dec, tgt, enable_dropout=False,
                         task_ids=ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()

  # Compiled: eagerly, the gradient is hundreds of one-op programs.
  return params, jax.jit(jax.grad(loss_fn))(params)


def _changed(before, after):
  flat_b = traverse_util.flatten_dict(before, sep='/')
  flat_a = traverse_util.flatten_dict(after, sep='/')
  return {k for k in flat_b if not np.array_equal(flat_b[k], flat_a[k])}


def _step(opt, params, grads):
  @jax.jit  # one program, not one per operation and parameter shape
  def step(params, grads):
    updates, _ = opt.update(grads, opt.init(params), params)
    return optax.apply_updates(params, updates)
  return step(params, grads)


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
  # T5's relative steps for every parameter: exactly optax's Adafactor.
  got = _step(optimizers.make_optimizer(multiply_by_parameter_scale=True),
              params, grads)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  # The default differs only under 'adapter' scopes: none in this model.
  default = _step(optimizers.make_optimizer(), params, grads)
  assert not _changed(want, default)
  # A multiplier of 0 on the backbone freezes it too, through the rate.
  zero = _step(optimizers.make_optimizer(
      learning_rate_multipliers={'backbone': 0.0}), params, grads)
  assert all('/hyperprompt/' in k for k in _changed(params, zero))


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="Unknown learning_rate_multipliers"):
    optimizers.make_optimizer(learning_rate_multipliers={'prompts': 2.0})
  with pytest.raises(ValueError, match='learning_rate must be a positive number, got 0.0'):
    optimizers.make_optimizer(learning_rate=0.0)
  with pytest.raises(ValueError, match='Unknown min_parameter_scale groups'):
    optimizers.make_optimizer(min_parameter_scale={'adapters': 0.1})
  with pytest.raises(ValueError, match='Unknown learning_rate_multipliers'):
    optimizers.make_optimizer(learning_rate_multipliers={'adapter': 2.0})
  with pytest.raises(ValueError, match="min_parameter_scale of 'backbone'"):
    optimizers.make_optimizer(min_parameter_scale=0.0)


# -- per-group Adafactor against a hand-written reference ---------------------


def _numpy_adafactor(x, grads, lr, scaled, floor, factored, decay=0.8,
                     clip=1.0, eps1=1e-30):
  """Adafactor (Shazeer & Stern, 2018, Algs. 4-5) in numpy: `len(grads)`
  steps from `x`, float64. Factored: row / column means of G^2 + eps1, V =
  R C / mean(R); the step is lr * max(eps2, RMS(X)) (relative) or lr."""
  x = np.asarray(x, np.float64)
  r = c = v = 0.0
  for t, g in enumerate(grads, start=1):
    g = np.asarray(g, np.float64)
    beta = 1.0 - t ** -decay
    g2 = g * g + eps1
    if factored:
      r = beta * r + (1 - beta) * g2.mean(axis=1)
      c = beta * c + (1 - beta) * g2.mean(axis=0)
      v_hat = np.outer(r, c) / r.mean()
    else:
      v = beta * v + (1 - beta) * g2
      v_hat = v
    u = g / np.sqrt(v_hat)
    u = u / max(1.0, np.sqrt(np.mean(u * u)) / clip)
    step = lr * max(floor, np.sqrt(np.mean(x * x))) if scaled else lr
    x = x - step * u
  return x


def _group_tree(rng):
  """The backbone, an 'adapter' and a 'hyperprompt' scope, each with a
  factored matrix, an unfactored vector and a zero-initialised vector."""
  def leaves(scale):
    return {'matrix': rng.normal(0, scale, (6, 5)).astype(np.float32),
            'vector': rng.normal(0, scale, (5,)).astype(np.float32),
            'zeros': np.zeros((5,), np.float32)}
  return {'encoder': {'layers_0': {'mlp': leaves(0.5),
                                   'adapter': leaves(0.01)},
                      'hyperprompt': leaves(0.05)}}


def _leaf_groups(tree):
  layer = tree['encoder']['layers_0']
  return {'mlp': layer['mlp'], 'adapter': layer['adapter'],
          'hyperprompt': tree['encoder']['hyperprompt']}


@pytest.mark.parametrize('adapter_scaled', [True, False])
def test_per_group_steps_match_hand_computed_adafactor(adapter_scaled):
  rng = np.random.default_rng(0)
  params = _group_tree(rng)
  grads = [jax.tree.map(lambda p: rng.normal(0, 1, p.shape).astype(
      np.float32), params) for _ in range(3)]
  lr = 0.05
  opt = optimizers.make_optimizer(
      learning_rate=lr, min_dim_size_to_factor=5,
      learning_rate_multipliers={'task_conditioned': 2.0},
      multiply_by_parameter_scale={'adapter': adapter_scaled},
      min_parameter_scale={'task_conditioned': 0.2, 'adapter': 0.3})
  state = opt.init(params)
  got = params
  for g in grads:
    updates, state = opt.update(g, state, got)
    got = optax.apply_updates(got, updates)
  settings = {  # rate, relative steps, floor
      'mlp': (lr, True, 1e-3),  # T5's Adafactor for the backbone
      'adapter': (2 * lr, adapter_scaled, 0.3),
      'hyperprompt': (2 * lr, True, 0.2)}
  for group, (g_lr, scaled, floor) in settings.items():
    for name, x in _leaf_groups(params)[group].items():
      want = _numpy_adafactor(
          x, [_leaf_groups(g)[group][name] for g in grads], g_lr, scaled,
          floor, factored=(name == 'matrix'))
      # Each step's update within float32 rounding of the moments' means
      # (over a row, a column), the clip's RMS and the parameter's (over
      # the tensor), relative to the update's size; the sums rounded once.
      rows, cols = x.shape if x.ndim == 2 else (1, x.size)
      conftest.assert_close_to_scale(
          _leaf_groups(got)[group][name], want,
          conftest.float32_bound(rows, cols, x.size, x.size),
          len(grads) * np.abs(want - x).max() + np.abs(want),
          f'{group}/{name}')


def test_default_gives_only_the_vanilla_adapter_absolute_steps():
  params = _group_tree(np.random.default_rng(1))
  g = jax.tree.map(np.ones_like, params)
  opt = optimizers.make_optimizer(learning_rate=1.0)
  updates = _leaf_groups(opt.update(g, opt.init(params), params)[0])
  # A first step of unit gradients has update RMS 1: the step is the rate
  # times max(1e-3, RMS(x)) (relative), or the rate (absolute).
  for group, leaves in _leaf_groups(params).items():
    for name, x in leaves.items():
      scale = (1.0 if group == 'adapter'
               else max(1e-3, float(np.sqrt(np.mean(x.astype(np.float64)**2)))))
      # The RMS over the tensor, a product, relative to the step.
      conftest.assert_close_to_scale(
          np.abs(updates[group][name]), np.full(x.shape, scale),
          conftest.float32_bound(x.size, 1), name=f'{group}/{name}')


def test_state_tree_is_optax_adafactors():
  """Checkpoints written before per-scope scaling resume: the optimizer state
  has the tree of the former `multi_transform` over `optax.adafactor`s."""
  params = flax.core.freeze(_group_tree(np.random.default_rng(2)))
  adafactor = optax.adafactor(1e-3, decay_rate=0.8, clipping_threshold=1.0,
                              min_dim_size_to_factor=5)
  former = optax.multi_transform(
      {'backbone': adafactor, 'task_conditioned': adafactor,
       'frozen': optax.set_to_zero()},
      lambda p: optimizers.parameter_labels(p, False))
  for kwargs in ({}, {'multiply_by_parameter_scale': False}):
    state = optimizers.make_optimizer(min_dim_size_to_factor=5,
                                      **kwargs).init(params)
    assert jax.tree.structure(state) == jax.tree.structure(
        former.init(params))


def test_operative_config_records_the_parameter_scaling():
  """A run's operative_config.gin must say which groups took relative
  steps (gin leaves out defaults it cannot write as literals)."""
  gin.clear_config()
  try:
    gin.parse_config('from __gin__ import dynamic_registration\n'
                     'from hyperprompt_jax.training import optimizers\n'
                     'optimizers.make_optimizer.learning_rate = 0.01\n')
    gin.get_configurable(optimizers.make_optimizer)()
    operative = gin.operative_config_str()
    gin.clear_config()
    gin.parse_config(operative)
    assert gin.query_parameter(
        'optimizers.make_optimizer.multiply_by_parameter_scale') == {
            'backbone': True, 'task_conditioned': True, 'adapter': False}
  finally:
    gin.clear_config()
