"""Greedy decoding with the cache against a cache-free reference."""

import jax
import numpy as np
import pytest

from hyperprompt_jax.common import partitioning
from hyperprompt_jax.evaluation import predictor as predictor_lib
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.methods import hyperprompt
from hyperprompt_jax.model import decoding
from hyperprompt_jax.model import network

import conftest


def _reference_greedy(model, params, enc, task_ids, length, eos=1):
  """Greedy decoding without a cache: the full teacher-forced forward on the
  growing prefix at every step, argmax of the last position."""
  out = np.zeros((enc.shape[0], length), np.int32)
  done = np.zeros(enc.shape[0], bool)
  forward = jax.jit(lambda dec: model.apply(
      {'params': params}, enc, dec, jax.numpy.ones_like(dec),
      enable_dropout=False, task_ids=task_ids))
  for i in range(length):
    dec_in = conftest.decoder_inputs(out)
    logits = np.asarray(forward(dec_in))
    token = np.where(done, 0, logits[:, i].argmax(-1))
    out[:, i] = token
    done |= token == eos
  return out


def _model(kind):
  cfg = dict(vars(conftest.T5X_TINY_CONFIG))
  if kind == 'hyperprompt':
    cfg['hyperprompt'] = hyperprompt.HyperPromptConfig(
        variant='global', encoder_prompt_length=3, decoder_prompt_length=2,
        hypernet_reduction=8, task_embed_dim=8, task_hidden_dim=16,
        layer_task_embed_dim=8)
  elif kind == 'hypergrid':
    cfg['hypergrid'] = hypergrid.HyperGridConfig(variant='lg', grid_rows=4,
                                                 grid_cols=8)
  return network.Transformer(network.T5Config(**cfg))


@pytest.mark.parametrize('kind', ['mtl', 'hyperprompt', 'hypergrid'])
def test_greedy_decode_equals_uncached_reference(kind):
  model = _model(kind)
  rng = np.random.default_rng(0)
  enc = conftest.random_tokens(rng, (4, 10), pad_from=[10, 7, 4, 9])
  task_ids = None if kind == 'mtl' else np.array([0, 3, 1, 3], np.int32)
  params = model.init(jax.random.PRNGKey(1), enc, enc[:, :6], enc[:, :6],
                      enable_dropout=False, task_ids=task_ids)['params']
  # Make EOS likely at some steps so early stopping and post-EOS zeros are
  # exercised: raise the EOS logit's weight.
  kernel = np.array(params['decoder']['logits_dense']['kernel'])
  kernel[:, 1] += 3 * np.abs(kernel).mean()
  params['decoder']['logits_dense']['kernel'] = kernel
  length = 6
  got = np.asarray(jax.jit(
      lambda p, e, t: decoding.greedy_decode(model, p, e, t, length))(
          params, enc, task_ids))
  want = _reference_greedy(model, params, enc, task_ids, length)
  np.testing.assert_array_equal(got, want)
  # Some rows stop early (EOS before the last step), and are zero after it.
  assert ((got[:, :-1] == 1).any(axis=1)).any(), got
  for row in got:
    eos = np.flatnonzero(row == 1)
    if eos.size:
      assert not row[eos[0] + 1:].any()


def test_predictor_pads_the_last_batch_and_keeps_the_order(tmp_path):
  model = _model('hyperprompt')
  rng = np.random.default_rng(2)
  enc = conftest.random_tokens(rng, (5, 10), pad_from=[10, 3, 8, 10, 5])
  ids = np.array([2, 0, 1, 3, 2], np.int32)
  variables = model.init(jax.random.PRNGKey(1), enc, enc[:, :4], enc[:, :4],
                         enable_dropout=False, task_ids=ids)
  predictor = predictor_lib.Predictor(model, variables['params_axes'],
                                 partitioning.create_mesh(), batch_size=4,
                                 max_decode_length=5)
  predictor.set_params(variables['params'])
  want = _reference_greedy(model, variables['params'], enc, ids, 5)
  first = predictor.predict({'encoder_input_tokens': enc[:4],
                             'task_ids': ids[:4]})
  last = predictor.predict({'encoder_input_tokens': enc[4:],
                            'task_ids': ids[4:]})
  np.testing.assert_array_equal(np.concatenate([first, last]), want)
  with pytest.raises(ValueError, match='exceed the batch size'):
    predictor.predict({'encoder_input_tokens': enc, 'task_ids': ids})
  # Out-of-range ids would clamp inside jit: refused on the host.
  with pytest.raises(ValueError, match=r'task_ids has ids \[4\] outside'):
    predictor.predict({'encoder_input_tokens': enc[:2],
                       'task_ids': np.array([0, 4], np.int32)})
  with pytest.raises(ValueError, match='encoder_input_tokens.*vocab_size'):
    predictor.predict({'encoder_input_tokens': enc[:2] + 1000,
                       'task_ids': ids[:2]})
