"""The T5 network against an independent numpy T5 (tests/numpy_t5.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_t5
from conftest import T5X_TINY_CONFIG, decode_with_cache, decoder_inputs
from conftest import flat, random_tokens
import conftest
from hyperprompt_jax.model import network
from hyperprompt_jax.t5 import layers

CFG = T5X_TINY_CONFIG


def _batch(seed=0, batch=3, inputs=9, targets=6):
  rng = np.random.default_rng(seed)
  enc = random_tokens(rng, (batch, inputs), pad_from=[inputs, 6, 3][:batch])
  tgt = random_tokens(rng, (batch, targets), pad_from=[targets, 4, 2][:batch])
  dec_in = np.concatenate([np.zeros((batch, 1), np.int32), tgt[:, :-1]], 1)
  dec_in = np.where(tgt > 0, dec_in, 0)
  return enc, dec_in, tgt


def _reference_logits(p, enc, dec_in, tgt, cfg=CFG):
  gated = len(cfg.mlp_activations) == 2
  out = []
  for e, d, t in zip(enc, dec_in, tgt):
    encoded = numpy_t5.encode(p, e, cfg.num_heads, cfg.num_encoder_layers,
                              gated)
    out.append(numpy_t5.decode(p, encoded, e, d, t, cfg.num_heads,
                               cfg.num_decoder_layers, gated,
                               cfg.logits_via_embedding))
  return np.stack(out)


def _bound(inputs, targets=0):
  """float32 rounding of the tiny network's forward pass at these lengths
  (`conftest.float32_bound`), relative to the output's largest entry."""
  return conftest.float32_bound(*conftest.t5_forward_lengths(CFG, inputs,
                                                             targets))


def _assert_close_where_valid(got, want, tgt, enc):
  valid = tgt > 0
  conftest.assert_close_to_scale(np.asarray(got)[valid], want[valid],
                                 _bound(enc.shape[1], tgt.shape[1]))


def test_teacher_forced_logits_match_numpy_reference(tiny_model_and_params):
  model, params = tiny_model_and_params
  enc, dec_in, tgt = _batch()
  logits = jax.jit(
      lambda p: model.apply({'params': p}, enc, dec_in, tgt,
                            enable_dropout=False,
                            task_ids=jnp.array([0, 1, 3]))
  )(params)
  assert logits.shape == (3, 6, CFG.vocab_size)
  assert logits.dtype == jnp.float32
  _assert_close_where_valid(logits, _reference_logits(flat(params), enc,
                                                      dec_in, tgt), tgt, enc)


def test_t5_v1_0_relu_ffn_and_tied_logits():
  cfg = dataclasses.replace(CFG, mlp_activations=('relu',),
                            logits_via_embedding=True)
  model = network.Transformer(cfg)
  enc, dec_in, tgt = _batch(seed=1)
  params = model.init(jax.random.PRNGKey(1), enc, dec_in, tgt,
                      enable_dropout=False)['params']
  paths = set(flat(params))
  assert 'encoder/layers_0/mlp/wi/kernel' in paths
  assert 'encoder/layers_0/mlp/wi_0/kernel' not in paths
  assert not any('logits_dense' in k for k in paths)
  logits = model.apply({'params': params}, enc, dec_in, tgt,
                       enable_dropout=False)
  _assert_close_where_valid(logits, _reference_logits(flat(params), enc,
                                                      dec_in, tgt, cfg), tgt,
                            enc)


def test_incremental_decoding_with_cache_equals_teacher_forcing(
    tiny_model_and_params):
  model, params = tiny_model_and_params
  enc, _, _ = _batch(seed=2, batch=2, targets=7)
  rng = np.random.default_rng(3)
  tgt = random_tokens(rng, (2, 7))  # no padding: every position is decoded
  dec_in = decoder_inputs(tgt)
  task_ids = jnp.array([1, 2])
  full = model.apply({'params': params}, enc, dec_in, tgt,
                     enable_dropout=False, task_ids=task_ids)
  got, cache = decode_with_cache(model, params, enc, dec_in, task_ids)
  # t5x's cache layout: [batch, heads, head_dim, max_length].
  assert cache['decoder']['layers_0']['self_attention']['cached_key'].shape == (
      2, CFG.num_heads, CFG.head_dim, 7)
  conftest.assert_close_to_scale(got, full, _bound(9, 7))


def _encode(model, params, tokens, segment_ids=None):
  return np.asarray(model.apply({'params': params}, tokens,
                                encoder_segment_ids=segment_ids,
                                enable_dropout=False, method=model.encode))


def test_encoder_is_bidirectional(tiny_model_and_params):
  model, params = tiny_model_and_params
  enc, _, _ = _batch(batch=1)
  changed = enc.copy()
  changed[0, -1] = changed[0, -1] % 383 + 1  # a different non-pad token
  before, after = _encode(model, params, enc), _encode(model, params, changed)
  assert np.abs(before[0, 0] - after[0, 0]).max() > _bound(9) * np.abs(
      before).max()


def test_padding_does_not_change_the_encoding(tiny_model_and_params):
  model, params = tiny_model_and_params
  enc, _, _ = _batch(batch=1)
  short = _encode(model, params, enc[:, :5])
  padded = _encode(model, params, np.pad(enc[:, :5], ((0, 0), (0, 7))))
  conftest.assert_close_to_scale(padded[:, :5], short, _bound(12))


def test_packed_segments_do_not_see_each_other(tiny_model_and_params):
  model, params = tiny_model_and_params
  rng = np.random.default_rng(4)
  a, b = random_tokens(rng, (1, 4)), random_tokens(rng, (1, 5))
  packed = np.concatenate([a, b], 1)
  segments = np.array([[1] * 4 + [2] * 5], np.int32)
  got = _encode(model, params, packed, segments)
  conftest.assert_close_to_scale(got[:, :4], _encode(model, params, a),
                                 _bound(9))
  conftest.assert_close_to_scale(got[:, 4:], _encode(model, params, b),
                                 _bound(9))


def test_decoder_is_causal(tiny_model_and_params):
  model, params = tiny_model_and_params
  enc, dec_in, tgt = _batch(batch=1, targets=6)
  logits = lambda d, t: np.asarray(model.apply(
      {'params': params}, enc, d, t, enable_dropout=False))
  before = logits(dec_in, tgt)
  dec2, tgt2 = dec_in.copy(), tgt.copy()
  dec2[0, 4] = dec2[0, 4] % 383 + 1  # change a later input token
  after = logits(dec2, tgt2)
  # Exact: a masked score is -1e10 whatever the token, its weight exp() = 0.
  np.testing.assert_array_equal(after[0, :4], before[0, :4])
  assert np.abs(after[0, 4] - before[0, 4]).max() > _bound(9, 6) * np.abs(
      before).max()


def test_bfloat16_activations_give_float32_logits_close_to_float32():
  cfg = dataclasses.replace(CFG, dtype='bfloat16')
  model32, model16 = network.Transformer(CFG), network.Transformer(cfg)
  enc, dec_in, tgt = _batch(seed=5)
  params = model32.init(jax.random.PRNGKey(2), enc, dec_in, tgt,
                        enable_dropout=False)['params']
  l32 = model32.apply({'params': params}, enc, dec_in, tgt,
                      enable_dropout=False)
  l16 = model16.apply({'params': params}, enc, dec_in, tgt,
                      enable_dropout=False)
  assert l16.dtype == jnp.float32
  valid = tgt > 0
  # Relative to the largest logit, as the float32 rounding.
  conftest.assert_close_to_scale(
      np.asarray(l16)[valid], np.asarray(l32)[valid], conftest.bfloat16_bound(
          *conftest.t5_forward_lengths(CFG, 9, 6)))


def test_dropout_needs_rng_and_changes_outputs(tiny_model_and_params):
  _, params = tiny_model_and_params
  model = network.Transformer(dataclasses.replace(CFG, dropout_rate=0.3))
  enc, dec_in, tgt = _batch()
  run = lambda seed: np.asarray(model.apply(
      {'params': params}, enc, dec_in, tgt, enable_dropout=True,
      rngs={'dropout': jax.random.PRNGKey(seed)}))
  assert not np.allclose(run(0), run(1))
  np.testing.assert_array_equal(run(0), run(0))


@pytest.mark.parametrize('task_ids, message', [
    (np.array([0, 1, 4]), r'\[0, 4\)'),
    (np.array([-1, 0, 0]), r'\[0, 4\)'),
    (np.array([0, 1]), r'task_ids must be int32 \[batch\]'),
    (np.array([[0, 1, 2]]), r'task_ids must be int32 \[batch\]'),
    (np.array([0.0, 1.0, 2.0]), 'must be integers'),
])
def test_bad_task_ids_raise(tiny_model_and_params, task_ids, message):
  model, params = tiny_model_and_params
  enc, dec_in, tgt = _batch()
  with pytest.raises(ValueError, match=message):
    model.apply({'params': params}, enc, dec_in, tgt, enable_dropout=False,
                task_ids=task_ids)


def test_wrong_token_rank_raises(tiny_model_and_params):
  model, params = tiny_model_and_params
  enc, dec_in, tgt = _batch()
  with pytest.raises(ValueError, match=r'encoder_input_tokens must be \[batch'):
    model.apply({'params': params}, enc[0], dec_in, tgt, enable_dropout=False)
  with pytest.raises(ValueError, match=r'decoder_input_tokens must be \[batch'):
    model.apply({'params': params}, enc, dec_in[..., None], tgt,
                enable_dropout=False)


def test_bad_config_raises():
  with pytest.raises(ValueError, match='num_heads must be positive'):
    network.Transformer(dataclasses.replace(CFG, num_heads=0)).init(
        jax.random.PRNGKey(0), np.ones((1, 2), np.int32),
        np.ones((1, 2), np.int32), np.ones((1, 2), np.int32))


@pytest.mark.parametrize('bidirectional', [True, False])
def test_relative_position_forms_agree_value_and_gradient(bidirectional):
  """t5x's one-hot contraction (the accelerators' form: the gather's
  gradient is a scatter-add of colliding atomics there) and the gather
  (XLA:CPU's) give the same bias and the same table gradient, exactly."""
  out = {}
  for form in ('gather', 'one_hot'):
    bias = layers.RelativePositionBiases(32, 128, 4, form=form)
    variables = bias.init(jax.random.PRNGKey(0), 20, 24, bidirectional)
    value, vjp = jax.vjp(lambda v: bias.apply(v, 20, 24, bidirectional),
                         variables)
    out[form] = (value, vjp(jnp.cos(value))[0])
  assert out['gather'][0].shape == (1, 4, 20, 24)
  np.testing.assert_array_equal(out['gather'][0], out['one_hot'][0])
  for a, b in zip(jax.tree.leaves(out['gather'][1]),
                  jax.tree.leaves(out['one_hot'][1])):
    np.testing.assert_array_equal(a, b)


def test_abstract_variables_are_the_initialised_shapes_each_caller_its_own():
  """The shapes of a real initialisation, for an equal configuration built
  anew too; a caller that edits its copy changes no later caller's."""
  cfg = dataclasses.replace(CFG, num_tasks=3)
  real = jax.tree.map(lambda x: (x.shape, x.dtype), network.init_variables(
      network.Transformer(cfg), jax.random.PRNGKey(0))['params'])
  first = network.abstract_variables(network.Transformer(cfg))
  assert jax.tree.map(lambda x: (x.shape, x.dtype), first['params']) == real
  first['params'].clear()
  again = network.abstract_variables(
      network.Transformer(dataclasses.replace(CFG, num_tasks=3)))
  assert jax.tree.map(lambda x: (x.shape, x.dtype), again['params']) == real


def test_kernel_gradients_laid_out_as_stored_batch_as_numbers():
  """`layers.gradient_laid_out_as_stored` is the identity with its gradient
  in the stored (row-major) layout: `x @ k`'s gradient for k is numpy's `x^T
  g`, and under `jax.vmap` with the batch on any axis the program's output is
  row major and reads back right element by element (JAX's own batching of
  a layout constraint makes the batch axis the most major one where it lies:
  indexing such an output eagerly reads wrong values on XLA:CPU)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(5, 4)).astype(np.float32)
  g = rng.normal(size=(5, 3)).astype(np.float32)
  cotangents = rng.normal(size=(4, 2, 3)).astype(np.float32)  # batch: axis 1

  def gradient(kernel):
    return jax.vjp(lambda k: x @ layers.gradient_laid_out_as_stored(k),
                   kernel)[1](g)[0]

  np.testing.assert_allclose(gradient(rng.normal(size=(4, 3))), x.T @ g,
                             rtol=1e-5)
  pullback = jax.vjp(layers.gradient_laid_out_as_stored, cotangents[:, 0])[1]
  batched = jax.jit(jax.vmap(lambda c: pullback(c)[0], in_axes=1,
                             out_axes=1))(cotangents)
  assert batched.format.layout.major_to_minor == (0, 1, 2)
  for i in range(2):
    np.testing.assert_array_equal(batched[:, i], cotangents[:, i])
