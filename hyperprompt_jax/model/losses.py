"""Training loss: token cross-entropy with t5x's z-loss, and token accuracy.

t5x (`t5x/losses.py`) adds `z_loss * log(Z)^2` per token, Z the softmax
normaliser, to keep the logits' scale from drifting in bfloat16. The sum
over real target tokens is divided by their number (t5x's
`NUM_REAL_TARGET_TOKENS` normalisation).
"""

import jax
import jax.numpy as jnp


def token_losses(logits: jax.Array, targets: jax.Array, z_loss: float = 1e-4
                 ) -> tuple[jax.Array, jax.Array]:
  """`(cross_entropy, z_term)`, each [batch, length] float32, of every token
  (padding included: weigh them)."""
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return log_z - target_logit, z_loss * jnp.square(log_z)


def weighted_sums(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                  z_loss: float = 1e-4) -> dict[str, jax.Array]:
  """The sums behind `cross_entropy_with_z_loss`, float32 scalars:
  {'cross_entropy', 'z_loss', 'hits', 'tokens'} over the weighted tokens
  (sums add up over microbatches; the ratios do not)."""
  logits = logits.astype(jnp.float32)
  weights = weights.astype(jnp.float32)
  cross_entropy, z_term = token_losses(logits, targets, z_loss)
  hits = (jnp.argmax(logits, -1) == targets) * weights
  return {'cross_entropy': (cross_entropy * weights).sum(),
          'z_loss': (z_term * weights).sum(),
          'hits': hits.sum(),
          'tokens': weights.sum()}


def terms_from_sums(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """`cross_entropy_with_z_loss`'s terms from `weighted_sums` (of one batch,
  or added up over its microbatches)."""
  tokens = jnp.maximum(sums['tokens'], 1.0)
  return {
      'loss': (sums['cross_entropy'] + sums['z_loss']) / tokens,
      'cross_entropy': sums['cross_entropy'] / tokens,
      'z_loss': sums['z_loss'] / tokens,
      'accuracy': sums['hits'] / tokens,
      'tokens': sums['tokens'],
  }


def cross_entropy_with_z_loss(logits: jax.Array, targets: jax.Array,
                              weights: jax.Array, z_loss: float = 1e-4
                              ) -> dict[str, jax.Array]:
  """Per-batch loss terms.

  Args:
    logits: [batch, length, vocab], any float dtype (computed in float32).
    targets: [batch, length] int token ids.
    weights: [batch, length], 1 for real target tokens, 0 for padding.
    z_loss: coefficient of log(Z)^2.

  Returns:
    {'loss': (cross-entropy + z-loss) / tokens, 'cross_entropy': ... /
    tokens, 'z_loss': ... / tokens, 'accuracy': argmax hits / tokens,
    'tokens': the number of real target tokens}, all scalars.
  """
  return terms_from_sums(weighted_sums(logits, targets, weights, z_loss))
