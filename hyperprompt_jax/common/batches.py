"""Host-side validation of model batches.

Inside `jax.jit` an out-of-range gather (a task id >= num_tasks, a token id
>= vocab) silently clamps, so batches are checked on the host, where the
error can name the feature, before they reach the device.
"""

import dataclasses
from typing import Any, Mapping, Optional

import numpy as np

from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.methods import prompt_tuning
from hyperprompt_jax.t5 import inputs

# Per-token task ids -> the segment ids they follow.
_TASK_ID_SEGMENTS = {'encoder_task_ids': 'encoder_segment_ids',
                     'decoder_task_ids': 'decoder_segment_ids'}


@dataclasses.dataclass(frozen=True)
class RowFormat:
  """How a run's rows hold its examples.

  Decided once from PACK and the model (`of`) and handed to the data
  pipeline, the feature converter and the batch checks.

  Attributes:
    packed: several examples per row, with segment ids, positions and
      per-token task ids (`inputs.PACKED_MODEL_FEATURES`).
    input_prompt_length: encoder positions reserved in front of every packed
      example for Prompt-Tuning's n soft tokens (0 unpacked: the network
      puts the prompt in front of the row itself).
    max_examples: packed rows hold at most this many examples (HyperGrid's
      MAX_SEGMENTS: one gated weight per example); None: as many as fit.
  """
  packed: bool = False
  input_prompt_length: int = 0
  max_examples: Optional[int] = None

  @classmethod
  def of(cls, model_config: Any, pack: bool) -> 'RowFormat':
    """The rows of a model (`network.T5Config`) with PACK = `pack`."""
    if not pack:
      return cls()
    return cls(
        packed=True,
        input_prompt_length=prompt_tuning.prompt_length(
            model_config.prompt_tuning),
        max_examples=hypergrid.max_segments(model_config.hypergrid))

  @property
  def features(self) -> tuple[str, ...]:
    """The model features a batch of these rows carries."""
    return inputs.required_features(self.packed)

  def converter(self) -> Any:
    """The seqio feature converter that makes these rows."""
    # Imported here: checking batches needs no seqio or TensorFlow.
    from hyperprompt_jax.tasks import feature_converter  # pylint: disable=g-import-not-at-top
    return feature_converter.TaskIdsEncDecFeatureConverter(
        pack=self.packed, input_prompt_length=self.input_prompt_length,
        max_examples_per_row=self.max_examples)


def validate_batch(
    batch: Mapping[str, np.ndarray],
    num_tasks: int,
    vocab_size: Optional[int] = None,
    rows: RowFormat = RowFormat(),
    required: Optional[tuple[str, ...]] = None,
) -> None:
  """Raises ValueError naming the first feature that is missing or malformed.

  Args:
    batch: feature name -> array (numpy or anything `np.asarray` accepts).
    num_tasks: task ids must lie in `[0, num_tasks)`.
    vocab_size: if given, token ids must lie in `[0, vocab_size)`.
    rows: the run's rows (default: unpacked). Packed rows with
      Prompt-Tuning must hold its n reserved slots in front of every example
      (else the soft prompt would overwrite real tokens); with a bound on
      examples, at most that many a row, each contiguous.
    required: features that must be present (default: `rows.features`).
  """
  required = rows.features if required is None else required
  missing = [k for k in required if k not in batch]
  if missing:
    raise ValueError(
        f'Batch is missing features {missing} (has {sorted(batch)}). Use the '
        "project's feature converter, which adds `task_ids`."
    )
  batch_size = None
  for name, value in batch.items():
    rank = inputs.MODEL_FEATURE_RANKS.get(name)
    if rank is None and name in inputs.PACKING_FEATURES:
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
  for name in ('task_ids', *_TASK_ID_SEGMENTS):
    if name not in batch:
      continue
    ids = np.asarray(batch[name])
    if ids.size and (ids.min() < 0 or ids.max() >= num_tasks):
      bad = sorted(set(ids[(ids < 0) | (ids >= num_tasks)].tolist()))
      raise ValueError(
          f'Feature {name} has ids {bad} outside [0, num_tasks={num_tasks}).'
          ' Raise NUM_TASKS or fix the run\'s task list.'
      )
    if name in _TASK_ID_SEGMENTS and _TASK_ID_SEGMENTS[name] in batch:
      inputs.check_one_task_per_segment(
          name, ids, np.asarray(batch[_TASK_ID_SEGMENTS[name]]))
  if rows.max_examples is not None and inputs.is_packed(batch):
    for name in ('encoder_segment_ids', 'decoder_segment_ids'):
      inputs.check_segments(name, np.asarray(batch[name]),
                            rows.max_examples)
  input_prompt_length = rows.input_prompt_length
  if input_prompt_length and inputs.is_packed(batch):
    positions = np.asarray(batch['encoder_positions'])
    slots = (positions < input_prompt_length) & (
        np.asarray(batch['encoder_segment_ids']) > 0)
    tokens = np.asarray(batch['encoder_input_tokens'])[slots]
    if (tokens != prompt_tuning.PROMPT_SLOT_TOKEN).any():
      raise ValueError(
          f'Packed rows lack the {input_prompt_length} Prompt-Tuning slots in '
          'front of each example (the soft prompt would overwrite real '
          'tokens): build the feature converter with input_prompt_length='
          f'{input_prompt_length} (TaskIdsEncDecFeatureConverter).')
