"""The training loss against a numpy re-derivation of t5x's formula."""

import numpy as np

import conftest
from hyperprompt_jax.t5 import losses


def test_cross_entropy_with_z_loss_matches_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 5)).astype(np.float32) * 3
  targets = np.array([[1, 4, 0], [2, 2, 3]], np.int32)
  weights = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
  got = losses.cross_entropy_with_z_loss(logits, targets, weights, z_loss=0.1)

  log_z = np.log(np.exp(logits.astype(np.float64)).sum(-1))
  picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  ce = (log_z - picked) * weights
  z = 0.1 * log_z ** 2 * weights
  n = weights.sum()
  # float32: log Z (a sum of 5 exponentials, a log), a token's terms, the
  # sums over 6 tokens, the division; relative to the terms' magnitudes
  # (log Z and the picked logit; the z-loss twice log Z's relative error).
  bound = conftest.float32_bound(5, 2, 6, 1)
  ce_size = ((np.abs(log_z) + np.abs(picked)) * weights).sum() / n
  z_size = 2 * (0.1 * (np.abs(log_z) + 1) ** 2 * weights).sum() / n
  conftest.assert_close_to_scale(got['cross_entropy'], ce.sum() / n, bound,
                                 ce_size)
  conftest.assert_close_to_scale(got['z_loss'], z.sum() / n, bound, z_size)
  conftest.assert_close_to_scale(got['loss'], (ce.sum() + z.sum()) / n,
                                 bound, ce_size + z_size)
  hits = (logits.argmax(-1) == targets) * weights
  conftest.assert_close_to_scale(got['accuracy'], hits.sum() / n,
                                 conftest.float32_bound(1), hits.sum() / n)
  assert float(got['tokens']) == 5


def test_padding_only_batch_has_zero_loss():
  got = losses.cross_entropy_with_z_loss(
      np.zeros((1, 2, 3), np.float32), np.zeros((1, 2), np.int32),
      np.zeros((1, 2), np.float32))
  assert float(got['loss']) == 0.0 and float(got['tokens']) == 0.0
