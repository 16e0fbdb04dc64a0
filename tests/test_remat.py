"""Activation rematerialisation (REMAT_POLICY): the same parameter
paths (a real t5x checkpoint still loads) and the same gradients."""

import dataclasses

from flax import traverse_util
import jax
import numpy as np
import pytest

import conftest
from hyperprompt_jax.benchmarks import timing
from hyperprompt_jax.checkpointing import checkpoints
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.model import network
import test_packing

POLICIES = ('minimal', 'full')
# Every conditioning path a layer takes on unpacked rows: prompts (each
# HyperPrompt variant and placement), adapters, Prompt-Tuning, HyperGrid's
# grid gates (both targets, task attention) and Output Gating's (first
# token). HyperGrid's other variants and packed forms take the same path
# through a layer here (the gates differ before it; test_hypergrid,
# test_packing).
VARIANTS = {
    **{name: config for name, config in test_packing.PACKING_VARIANTS.items()
       if not name.startswith('hypergrid')},
    'hypergrid_lg': dict(hypergrid=hypergrid.HyperGridConfig(
        variant='lg', target='both', grid_rows=4, grid_cols=8)),
}


def _model(variant, policy, dropout_rate=0.0):
  """One encoder and one decoder layer, each rematerialised under `policy`
  (the encoder's output, recomputed in the backward, feeds the decoder's)."""
  return network.Transformer(dataclasses.replace(
      conftest.T5X_TINY_CONFIG, num_tasks=test_packing.TASKS,
      num_encoder_layers=1, num_decoder_layers=1,
      dropout_rate=dropout_rate, remat_policy=policy, **VARIANTS[variant]))


def _batch():
  rng = np.random.default_rng(1)
  targets = conftest.random_tokens(rng, (4, 6), pad_from=[6, 3, 5, 2])
  return dict(
      encoder_input_tokens=conftest.random_tokens(rng, (4, 12),
                                                  pad_from=[12, 7, 4, 9]),
      decoder_input_tokens=conftest.decoder_inputs(targets),
      decoder_target_tokens=targets,
      task_ids=np.array([0, 2, 1, 2], np.int32))


def _random_params(abstract):
  """Parameters of the shapes of `abstract`, drawn in numpy (nothing to
  compile), non-zero everywhere: norms' scales near 1, other vectors near
  0, each matrix's entries at 1 / sqrt(the product of its leading axes)."""
  rng = np.random.default_rng(0)
  out = {}
  for path, a in traverse_util.flatten_dict(abstract, sep='/').items():
    draw = rng.normal(size=a.shape)
    if len(a.shape) >= 2:
      draw /= np.sqrt(np.prod(a.shape[:-1]))
    elif path.endswith('scale'):
      draw = 1.0 + 0.1 * draw
    else:
      draw *= 0.1
    out[path] = draw.astype(a.dtype)
  return traverse_util.unflatten_dict(out, sep='/')


def _grads(model, params, batch, dropout):
  """The gradient of the sum of the logits' squares (every output matters),
  with dropout from a fixed rng when `dropout`."""

  def loss(params):
    logits = model.apply(
        {'params': params}, batch['encoder_input_tokens'],
        batch['decoder_input_tokens'], batch['decoder_target_tokens'],
        task_ids=batch['task_ids'], enable_dropout=dropout,
        rngs={'dropout': jax.random.PRNGKey(7)} if dropout else None)
    return (logits ** 2).mean()

  return conftest.flat(jax.jit(jax.grad(loss))(params))


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_remat_keeps_parameters_and_gradients(variant):
  """Under 'minimal' and 'full', the parameter tree (paths, shapes) is the
  plain model's, and from the same parameters (random, non-zero
  everywhere) the gradients are the plain model's to float32 rounding
  (`conftest.float32_bound` of the model's reductions), dropout on (the
  same masks: the recomputed layer draws what the first pass drew)."""
  batch = _batch()

  def abstract_params(model):
    return jax.eval_shape(lambda: model.init(
        jax.random.PRNGKey(0), batch['encoder_input_tokens'],
        batch['decoder_input_tokens'], batch['decoder_target_tokens'],
        task_ids=batch['task_ids'], enable_dropout=False)['params'])

  plain = _model(variant, 'none', dropout_rate=0.1)
  params = _random_params(abstract_params(plain))
  shapes = {k: v.shape for k, v in conftest.flat(params).items()}
  want = _grads(plain, params, batch, dropout=True)
  prompts, soft = plain.config.hyperprompt, plain.config.prompt_tuning
  bound = conftest.float32_bound(*conftest.t5_reduction_lengths(
      plain.config, *batch['encoder_input_tokens'].shape,
      batch['decoder_target_tokens'].shape[1],
      (prompts.encoder_prompt_length if prompts else 0)
      + (soft.prompt_length if soft else 0),
      prompts.decoder_prompt_length if prompts else 0))
  for policy in POLICIES:
    model = _model(variant, policy, dropout_rate=0.1)
    assert {k: v.shape for k, v in traverse_util.flatten_dict(
        abstract_params(model), sep='/').items()} == shapes, policy
    got = _grads(model, params, batch, dropout=True)
    for k in want:
      conftest.assert_close_in_norm(got[k], want[k], bound, f'{policy}: {k}')


@pytest.mark.parametrize('policy', POLICIES)
def test_a_real_t5x_checkpoint_loads_under_remat(policy):
  """The parameter paths are t5x's: the tiny checkpoint real t5x wrote
  restores into the remat model with nothing missing or left over."""
  loaded = checkpoints.load_t5x_params(
      str(conftest.T5X_TINY / 'orbax' / 'checkpoint_100'))
  model = network.Transformer(dataclasses.replace(
      conftest.T5X_TINY_CONFIG, remat_policy=policy))
  abstract = network.abstract_variables(model)['params']
  params, missing = checkpoints.match_params(loaded, abstract, 'tiny')
  assert not missing
  assert set(conftest.flat(params)) == set(loaded)


def test_an_unknown_remat_policy_is_named():
  with pytest.raises(ValueError, match="REMAT_POLICY='some'"):
    network.check_config(dataclasses.replace(conftest.T5X_TINY_CONFIG,
                                             remat_policy='some'))


def test_saved_activations_shrink_with_the_remat_policy_and_the_part():
  """What the backward keeps (`timing.saved_activation_bytes`): 'full'
  keeps each layer's inputs only, far less than 'minimal' (the matmul
  outputs too), itself less than 'none'; half the rows keep half. (Sizes
  depend on shapes only: the parameters are abstract.)"""
  base = network.T5Config(vocab_size=384, emb_dim=32, num_heads=4,
                          head_dim=8, mlp_dim=64, num_encoder_layers=2,
                          num_decoder_layers=2, num_tasks=4)
  batch = timing.random_batch(np.random.default_rng(0), 8, 16, 8, 384, 4)
  saved = {}
  for policy in network.REMAT_POLICIES:
    model = network.Transformer(dataclasses.replace(base,
                                                    remat_policy=policy))
    params = network.abstract_variables(model, 16, 8)['params']  # shapes
    saved[policy] = timing.saved_activation_bytes(model, params, batch)
  assert saved['full'] < saved['minimal'] < saved['none']
  assert saved['full'] * 2 < saved['none']
  half = {k: v[::2] for k, v in batch.items()}
  model = network.Transformer(base)
  params = network.abstract_variables(model, 16, 8)['params']
  assert timing.saved_activation_bytes(model, params, half) == pytest.approx(
      saved['none'] / 2, rel=0.05)
