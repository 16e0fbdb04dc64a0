"""The training loss against a numpy re-derivation of t5x's formula."""

import numpy as np
import pytest

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
  assert float(got['cross_entropy']) == pytest.approx(ce.sum() / n, rel=1e-5)
  assert float(got['z_loss']) == pytest.approx(z.sum() / n, rel=1e-5)
  assert float(got['loss']) == pytest.approx((ce.sum() + z.sum()) / n,
                                             rel=1e-5)
  hits = (logits.argmax(-1) == targets) * weights
  assert float(got['accuracy']) == pytest.approx(hits.sum() / n)
  assert float(got['tokens']) == 5


def test_padding_only_batch_has_zero_loss():
  got = losses.cross_entropy_with_z_loss(
      np.zeros((1, 2, 3), np.float32), np.zeros((1, 2), np.int32),
      np.zeros((1, 2), np.float32))
  assert float(got['loss']) == 0.0 and float(got['tokens']) == 0.0
