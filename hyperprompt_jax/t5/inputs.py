"""The network's batch features (t5x's names), unpacked and packed.

An unpacked row holds one example and its task (`task_ids [batch]`); a packed
row holds several, with segment ids, positions and per-token task ids. The
rules of packed rows (one task per example, a bound on examples per row) are
written here once, for the runner's host checks and the network's.
"""

from typing import Any, Mapping, Optional

import numpy as np

# The placeholder token of a packed example's reserved soft-prompt slots
# (the feature converter writes it, Prompt-Tuning overwrites its
# embedding): any valid (non-padding) id.
PROMPT_SLOT_TOKEN = 1
# Feature -> rank of the encoder-decoder model's inputs (t5x's names).
MODEL_FEATURE_RANKS = {
    'encoder_input_tokens': 2,
    'decoder_input_tokens': 2,
    'decoder_target_tokens': 2,
    'decoder_loss_weights': 2,
    'task_ids': 1,
}
# What packed rows add (also the network's keyword arguments for them).
PACKING_FEATURES = (
    'encoder_segment_ids', 'decoder_segment_ids',
    'encoder_positions', 'decoder_positions',
    'encoder_task_ids', 'decoder_task_ids',
)
# Packed rows carry per-token task ids instead of `task_ids [batch]`.
PACKED_MODEL_FEATURES = (
    'encoder_input_tokens', 'decoder_input_tokens', 'decoder_target_tokens',
    'decoder_loss_weights', 'encoder_segment_ids', 'decoder_segment_ids',
    'encoder_positions', 'decoder_positions', 'encoder_task_ids',
    'decoder_task_ids',
)


def is_packed(batch: Mapping[str, Any]) -> bool:
  """Whether a model batch holds packed rows."""
  return 'encoder_segment_ids' in batch


def required_features(packed: bool) -> tuple[str, ...]:
  """The features a batch of (un)packed rows must hold."""
  return PACKED_MODEL_FEATURES if packed else tuple(MODEL_FEATURE_RANKS)


def check_one_task_per_segment(name: str, task_ids: np.ndarray,
                               segment_ids: np.ndarray) -> None:
  """Raises ValueError if a packed example's tokens carry two task ids.

  Args:
    name: the feature, for the message.
    task_ids, segment_ids: int `[batch, length]`; segment 0 is padding.
  """
  for row in range(task_ids.shape[0]):
    for segment in np.unique(segment_ids[row]):
      if segment == 0:
        continue
      ids = np.unique(task_ids[row][segment_ids[row] == segment])
      if ids.size > 1:
        raise ValueError(
            f'Feature {name!r}: segment {segment} of row {row} carries task '
            f'ids {ids.tolist()}; a packed example has one task. Pack with '
            "the project's feature converter (TaskIdsEncDecFeatureConverter, "
            'pack=True), which gives every token its example\'s id.')


def check_segments(name: str, segment_ids: np.ndarray, bound: int) -> None:
  """Checks the rows of a model that weighs each example of a row apart.

  Args:
    name: the feature, for the message.
    segment_ids: int `[batch, length]`, 0 on padding.
    bound: the most examples a row (MAX_SEGMENTS).

  Raises:
    ValueError: a row over `bound`, or not each example contiguous, in
      order, with padding last (as packers make rows).
  """
  segment_ids = np.asarray(segment_ids)
  for row, ids in enumerate(segment_ids.reshape(-1, segment_ids.shape[-1])):
    check_segment_bound(name, ids.max(initial=0), bound, row)
    real = ids > 0
    ends = np.flatnonzero(~real)
    if (np.diff(ids[real]) < 0).any() or (
        ends.size and real[ends[0]:].any()):
      raise ValueError(
          f'Feature {name!r}: packed row {row} has segment ids '
          f'{ids.tolist()}; the model needs each example contiguous, in '
          'order, and padding (0) last, as the feature converter packs.')


def check_segment_bound(name: str, high: int, bound: int,
                        row: Optional[int] = None) -> None:
  """Raises ValueError if segment id `high` is over `bound` (MAX_SEGMENTS).

  `row` is None for the compiled check, which sees only the batch's highest.
  """
  if high > bound:
    where = 'a packed row' if row is None else f'packed row {row}'
    raise ValueError(
        f'Feature {name!r}: {where} holds segment ids up to {high}, over '
        f'MAX_SEGMENTS={bound} (HyperGridConfig.max_segments): each example '
        "of a row needs its own gated weights. Pack with the run's row "
        'format (batches.RowFormat.of: the packer closes a row at the bound) '
        'or raise MAX_SEGMENTS.')
