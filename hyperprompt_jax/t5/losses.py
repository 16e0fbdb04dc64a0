"""Training loss: token cross-entropy with t5x's z-loss, and token accuracy.

As in `t5x/losses.py`, `z_loss * log(Z)^2` per token (Z: the softmax
normaliser) keeps the logits' scale from drifting in bfloat16, and sums over
the real target tokens are divided by their number (t5x's
`NUM_REAL_TARGET_TOKENS`).
"""

from typing import Optional

import jax
import jax.numpy as jnp


def token_losses(logits: jax.Array, targets: jax.Array, z_loss: float = 1e-4
                 ) -> tuple[jax.Array, jax.Array]:
  """`(cross_entropy, z_term)` of every token, padding too: `[batch, len]`."""
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return log_z - target_logit, z_loss * jnp.square(log_z)


def weighted_sums(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                  z_loss: float = 1e-4, task_ids: Optional[jax.Array] = None,
                  num_tasks: int = 0) -> dict[str, jax.Array]:
  """Sums behind `cross_entropy_with_z_loss`; they add up over microbatches.

  Arguments are `cross_entropy_with_z_loss`'s.

  Returns:
    float32 scalars {'cross_entropy', 'z_loss', 'hits', 'tokens'} over the
    weighted tokens; with `task_ids`, also `per_task`'s sums.
  """
  logits = logits.astype(jnp.float32)
  weights = weights.astype(jnp.float32)
  cross_entropy, z_term = token_losses(logits, targets, z_loss)
  hits = (jnp.argmax(logits, -1) == targets) * weights
  sums = {'cross_entropy': (cross_entropy * weights).sum(),
          'z_loss': (z_term * weights).sum(),
          'hits': hits.sum(),
          'tokens': weights.sum()}
  if task_ids is not None:
    sums.update(per_task((cross_entropy + z_term) * weights, hits, weights,
                         task_ids, num_tasks))
  return sums


def per_task(token_loss: jax.Array, hits: jax.Array, weights: jax.Array,
             task_ids: jax.Array, num_tasks: int) -> dict[str, jax.Array]:
  """Sums weighted token loss, hits and weights by each token's task.

  One contraction with the tokens' one-hot tasks: a segment sum would
  scatter-add every token into T bins, which GPUs serialise.

  Args:
    token_loss: `[batch, length]`, weighted.
    hits: `[batch, length]`, weighted.
    weights: `[batch, length]`.
    task_ids: `[batch, length]`, each token's task.
    num_tasks: T.

  Returns:
    {'task_loss', 'task_hits', 'task_tokens'}, each float32 `[num_tasks]`.
  """
  one_hot = jax.nn.one_hot(task_ids.reshape(-1), num_tasks,
                           dtype=jnp.float32)  # [tokens, T]
  sums = jnp.einsum('kn,nt->kt', jnp.stack([
      x.reshape(-1).astype(jnp.float32) for x in (token_loss, hits, weights)]),
                    one_hot, precision=jax.lax.Precision.HIGHEST)
  return {'task_loss': sums[0], 'task_hits': sums[1], 'task_tokens': sums[2]}


def terms_from_sums(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """`cross_entropy_with_z_loss`'s terms from (summed) `weighted_sums`."""
  tokens = jnp.maximum(sums['tokens'], 1.0)
  return {
      'loss': (sums['cross_entropy'] + sums['z_loss']) / tokens,
      'cross_entropy': sums['cross_entropy'] / tokens,
      'z_loss': sums['z_loss'] / tokens,
      'accuracy': sums['hits'] / tokens,
      'tokens': sums['tokens'],
      **{k: v for k, v in sums.items() if k.startswith('task_')},
  }


def cross_entropy_with_z_loss(logits: jax.Array, targets: jax.Array,
                              weights: jax.Array, z_loss: float = 1e-4,
                              task_ids: Optional[jax.Array] = None,
                              num_tasks: int = 0) -> dict[str, jax.Array]:
  """Per-batch loss terms.

  Args:
    logits: [batch, length, vocab], any float dtype (computed in float32).
    targets: [batch, length] int token ids.
    weights: [batch, length], 1 for real target tokens, 0 for padding.
    z_loss: coefficient of log(Z)^2.
    task_ids: [batch, length], each target token's task (optional).
    num_tasks: the number of tasks (with `task_ids`).

  Returns:
    {'loss': (cross-entropy + z-loss) / tokens, 'cross_entropy': ... /
    tokens, 'z_loss': ... / tokens, 'accuracy': argmax hits / tokens,
    'tokens': the number of real target tokens}, all scalars; with
    `task_ids` also the per-task sums of `per_task`, each [num_tasks].
  """
  return terms_from_sums(weighted_sums(logits, targets, weights, z_loss,
                                       task_ids, num_tasks))
