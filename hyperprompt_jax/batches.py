"""Host-side validation of model batches.

Inside `jax.jit` an out-of-range gather (a task id >= num_tasks, a token id
>= vocab) silently clamps, so batches are checked on the host, where the
error can name the feature, before they reach the device.
"""

from typing import Mapping, Optional

import numpy as np

# Feature -> rank of the encoder-decoder model's inputs (t5x's names).
MODEL_FEATURE_RANKS = {
    'encoder_input_tokens': 2,
    'decoder_input_tokens': 2,
    'decoder_target_tokens': 2,
    'decoder_loss_weights': 2,
    'task_ids': 1,
}
PACKING_FEATURES = (
    'encoder_segment_ids', 'decoder_segment_ids',
    'encoder_positions', 'decoder_positions',
)


def validate_batch(
    batch: Mapping[str, np.ndarray],
    num_tasks: int,
    vocab_size: Optional[int] = None,
    required: tuple[str, ...] = tuple(MODEL_FEATURE_RANKS),
) -> None:
  """Raises ValueError naming the first feature that is missing or malformed.

  Args:
    batch: feature name -> array (numpy or anything `np.asarray` accepts).
    num_tasks: task ids must lie in `[0, num_tasks)`.
    vocab_size: if given, token ids must lie in `[0, vocab_size)`.
    required: features that must be present.
  """
  missing = [k for k in required if k not in batch]
  if missing:
    raise ValueError(
        f'Batch is missing features {missing} (has {sorted(batch)}). Use the '
        "project's feature converter, which adds `task_ids`."
    )
  batch_size = None
  for name, value in batch.items():
    rank = MODEL_FEATURE_RANKS.get(name)
    if rank is None and name in PACKING_FEATURES:
      rank = 2
    if rank is None:
      continue
    value = np.asarray(value)
    if value.ndim != rank:
      raise ValueError(
          f'Feature {name!r} must have rank {rank}, got shape {value.shape}.'
      )
    if name != 'decoder_loss_weights' and not np.issubdtype(
        value.dtype, np.integer):
      raise ValueError(
          f'Feature {name!r} must be an integer array (int32), got '
          f'{value.dtype}.'
      )
    if batch_size is None:
      batch_size = value.shape[0]
    elif value.shape[0] != batch_size:
      raise ValueError(
          f'Feature {name!r} has batch size {value.shape[0]}, others have '
          f'{batch_size}.'
      )
    if name.endswith('_tokens') and value.size:
      if value.min() < 0 or (vocab_size is not None
                             and value.max() >= vocab_size):
        raise ValueError(
            f'Feature {name!r} has token ids from {value.min()} to '
            f'{value.max()}, outside [0, vocab_size={vocab_size}).'
        )
  if 'task_ids' in batch:
    ids = np.asarray(batch['task_ids'])
    if ids.size and (ids.min() < 0 or ids.max() >= num_tasks):
      bad = sorted(set(ids[(ids < 0) | (ids >= num_tasks)].tolist()))
      raise ValueError(
          f'Feature task_ids has ids {bad} outside [0, num_tasks={num_tasks}).'
          ' Raise NUM_TASKS or fix the run\'s task list.'
      )
