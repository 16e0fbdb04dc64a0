"""Restoring checkpoints written by real t5x (tests/testdata/t5x_tiny)."""

import dataclasses

from flax import traverse_util
import numpy as np
import pytest

import conftest
import numpy_t5
from conftest import T5X_TINY, T5X_TINY_CONFIG, random_tokens
from hyperprompt_jax.checkpointing import checkpoints
from hyperprompt_jax.model import network

CHECKPOINTS = {
    'orbax': (T5X_TINY / 'orbax' / 'checkpoint_100',
              T5X_TINY / 'orbax_checkpoint_100.params.npz'),
    'legacy': (T5X_TINY / 'legacy' / 'checkpoint_50',
               T5X_TINY / 'legacy_checkpoint_50.params.npz'),
}


def _abstract_params(cfg):
  model = network.Transformer(cfg)
  return model, network.abstract_variables(model)['params']


@pytest.mark.parametrize('layout', sorted(CHECKPOINTS))
def test_every_parameter_restores_from_a_real_t5x_checkpoint(layout):
  path, npz = CHECKPOINTS[layout]
  assert checkpoints.checkpoint_layout(str(path)) == layout
  model, abstract = _abstract_params(T5X_TINY_CONFIG)
  params, missing = checkpoints.restore_params(str(path), abstract)
  assert missing == []
  expected = np.load(npz)
  got = traverse_util.flatten_dict(params, sep='/')
  assert sorted(got) == sorted(expected.files)
  for key in expected.files:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)

  # The restored network computes T5 with these weights (numpy reference).
  rng = np.random.default_rng(0)
  enc = random_tokens(rng, (1, 7))
  tgt = random_tokens(rng, (1, 5))
  dec_in = np.concatenate([np.zeros((1, 1), np.int32), tgt[:, :-1]], 1)
  logits = model.apply({'params': params}, enc, dec_in, tgt,
                       enable_dropout=False)
  p = {k: expected[k].astype(np.float64) for k in expected.files}
  encoded = numpy_t5.encode(p, enc[0], 2, 2)
  want = numpy_t5.decode(p, encoded, enc[0], dec_in[0], tgt[0], 2, 2)
  conftest.assert_close_to_scale(logits[0], want, conftest.float32_bound(
      *conftest.t5_forward_lengths(T5X_TINY_CONFIG, 7, 5)))


def test_shape_mismatch_names_the_parameter():
  path, _ = CHECKPOINTS['orbax']
  _, abstract = _abstract_params(
      dataclasses.replace(T5X_TINY_CONFIG, mlp_dim=128))
  with pytest.raises(ValueError, match=r'encoder/layers_0/mlp/wi_0/kernel: '
                     r'checkpoint \(32, 64\), model \(32, 128\)'):
    checkpoints.restore_params(str(path), abstract)


def test_missing_parameters_are_reported_or_allowed():
  path, _ = CHECKPOINTS['legacy']
  _, abstract = _abstract_params(
      dataclasses.replace(T5X_TINY_CONFIG, num_encoder_layers=3))
  with pytest.raises(ValueError, match='lacks 9 model parameters'):
    checkpoints.restore_params(str(path), abstract)
  params, missing = checkpoints.restore_params(str(path), abstract,
                                               allow_missing=True)
  # 4 attention kernels + 3 FFN kernels + 2 layer norms of the new layer.
  assert len(missing) == 9
  assert all(k.startswith('encoder/layers_2/') for k in missing)
  assert params['encoder']['layers_2']['mlp']['wo']['kernel'] is None


def test_not_a_checkpoint_raises(tmp_path):
  with pytest.raises(FileNotFoundError, match='No checkpoint directory'):
    checkpoints.load_t5x_params(str(tmp_path / 'nowhere'))
  with pytest.raises(ValueError, match='neither an orbax'):
    checkpoints.load_t5x_params(str(tmp_path))


def test_a_run_directory_given_for_one_checkpoint_names_its_checkpoints(
    tmp_path):
  for step in (650, 1300):
    (tmp_path / f'checkpoint_{step}' / 'state').mkdir(parents=True)
  with pytest.raises(ValueError, match=r'is a run directory \(MODEL_DIR\) of '
                     r'2 checkpoints; this reads one: give one of its '
                     r'checkpoint_<step> folders, e.g. .*checkpoint_1300 \(the '
                     r'newest; steps: 650, 1300\)'):
    checkpoints.load_t5x_params(str(tmp_path))
