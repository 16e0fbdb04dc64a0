"""seqio's encoder-decoder feature converter, carrying `task_ids` through.

`task_ids` is a seqio pass-through feature of rank 0 (int32 `[]` per example,
`[batch]` once batched). Callers such as t5x's evaluator pass feature lengths
without it, and trim / pad cannot slice a scalar, so the converter adds the
key to the lengths for seqio's checks and keeps it away from trim / pad.

Packing would put several tasks into one row; per-token task ids are future
work, so packing is refused.
"""

from typing import Mapping, Optional

import seqio
import tensorflow as tf

TASK_IDS = 'task_ids'
_TASK_IDS_SPEC = seqio.FeatureConverter.FeatureSpec(dtype=tf.int32, rank=0)


class TaskIdsEncDecFeatureConverter(seqio.EncDecFeatureConverter):
  """`seqio.EncDecFeatureConverter` plus a rank-0 int32 `task_ids` feature.

  Output features: those of `seqio.EncDecFeatureConverter` (unpacked) and
  `task_ids`.
  """

  def __init__(
      self,
      pack: bool = False,
      use_custom_packing_ops: bool = False,
      apply_length_check: bool = True,
      bos_id: int = 0,
      passthrough_features: Optional[
          Mapping[str, seqio.FeatureConverter.FeatureSpec]] = None,
  ):
    if pack:
      raise ValueError(
          'Packing mixes tasks in one row, and task-conditioned models take '
          'one task id per example: set DatasetConfig.pack = False (t5x: '
          'train/utils.DatasetConfig.pack = False, and the same for '
          'train_eval) or pack=False.')
    passthrough = {TASK_IDS: _TASK_IDS_SPEC, **(passthrough_features or {})}
    super().__init__(
        pack=False,
        use_custom_packing_ops=use_custom_packing_ops,
        apply_length_check=apply_length_check,
        bos_id=bos_id,
        passthrough_features=passthrough)

  def __call__(self, ds: tf.data.Dataset,
               task_feature_lengths: Mapping[str, int]) -> tf.data.Dataset:
    if TASK_IDS not in ds.element_spec:
      raise ValueError(
          f"The dataset has no '{TASK_IDS}' feature (it has "
          f'{sorted(ds.element_spec)}). Register tasks with '
          'hyperprompt_jax.tasks.add_task, which attaches them, and mixtures '
          'with hyperprompt_jax.tasks.add_mixture: a plain seqio.Mixture keeps '
          'only the output features and drops task ids.')
    # The length of a scalar is never checked (seqio skips rank-0 features).
    lengths = {**task_feature_lengths, TASK_IDS: 0}
    return super().__call__(ds, lengths)

  def _convert_features(self, ds: tf.data.Dataset,
                        task_feature_lengths: Mapping[str, int]
                        ) -> tf.data.Dataset:
    lengths = {k: v for k, v in task_feature_lengths.items() if k != TASK_IDS}
    return super()._convert_features(ds, lengths)

  def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]
                                ) -> Mapping[str, int]:
    """seqio's model lengths; `task_ids` maps to 0 (a scalar has none)."""
    return super().get_model_feature_lengths(
        {**task_feature_lengths, TASK_IDS: 0})
