"""seqio's encoder-decoder feature converter, carrying task ids through.

Unpacked (`pack=False`, evaluation and inference): `task_ids` is a seqio
pass-through feature of rank 0 (`[batch]` once batched). Callers such as
t5x's evaluator give no length for it, and trim / pad cannot slice a
scalar, so the converter adds it to the lengths for seqio's checks only.

Packed (`pack=True`, training): a row may hold examples of several tasks,
so the ids become per-token features, `encoder_task_ids [input_length]`
and `decoder_task_ids [target_length]` (0 on padding, as the segment id).
seqio refuses pass-through features when packing, so the scalar id is
spread over each example's tokens before packing. Rows are packed best-fit
from a buffer of the next examples (`packing.best_fit_pack`), which fills
rows better than seqio's stream-order packer (docs/performance.md,
"Packing").

With `num_tasks`, every task id is checked on the host by a tf.data
assertion, before an out-of-range gather could silently read another
task's parameters; t5x builds its datasets through its model's converter, which
binds `num_tasks` (`t5x_model.TaskIdsEncoderDecoderModel`).

Prompt-Tuning's soft prompt takes `n` encoder positions per example, which
packed rows must reserve (`input_prompt_length=n`): `n` placeholder tokens
(`PROMPT_SLOT_TOKEN`) in front of each example's inputs, filled by the
model (positions `0..n-1` of every segment).
"""

from typing import Mapping, Optional

import seqio
import tensorflow as tf

from hyperprompt_jax.t5 import inputs
from hyperprompt_jax.tasks import packing

TASK_IDS = 'task_ids'
_TASK_IDS_SPEC = seqio.FeatureConverter.FeatureSpec(dtype=tf.int32, rank=0)
# Per-token task ids of packed rows: model feature -> task feature it follows.
PACKED_TASK_IDS = {'encoder_task_ids': 'inputs',
                   'decoder_task_ids': 'targets'}
PROMPT_SLOT_TOKEN = inputs.PROMPT_SLOT_TOKEN


class TaskIdsEncDecFeatureConverter(seqio.EncDecFeatureConverter):
  """`seqio.EncDecFeatureConverter` plus task ids.

  Output features: those of `seqio.EncDecFeatureConverter`, and
  `task_ids` (int32 `[]`) unpacked, or `encoder_task_ids` /
  `decoder_task_ids` (int32 `[input_length]` / `[target_length]`) packed.

  Args:
    pack: pack several examples per row (training).
    input_prompt_length: with `pack`, encoder positions reserved in front of
      each example for Prompt-Tuning's soft prompt (its `prompt_length`; 0
      for every other model).
    pack_buffer_size: with `pack`, examples the best-fit packer chooses
      from (`packing.best_fit_pack`).
    max_examples_per_row: with `pack`, the most examples a row holds (None:
      as many as fit); HyperGrid's MAX_SEGMENTS.
    num_tasks: if given, every example's task id must lie in `[0,
      num_tasks)` (T5Config.num_tasks, NUM_TASKS); the dataset's iterator
      raises `tf.errors.InvalidArgumentError` naming the id otherwise.
    use_custom_packing_ops, apply_length_check, bos_id, passthrough_features:
      as seqio's (no pass-through features when packing, as in seqio;
      `use_custom_packing_ops` is ignored: seqio's packer is not used).
  """

  def __init__(
      self,
      pack: bool = False,
      use_custom_packing_ops: bool = False,
      apply_length_check: bool = True,
      bos_id: int = 0,
      passthrough_features: Optional[
          Mapping[str, seqio.FeatureConverter.FeatureSpec]] = None,
      input_prompt_length: int = 0,
      pack_buffer_size: int = packing.BUFFER_SIZE,
      max_examples_per_row: Optional[int] = None,
      num_tasks: Optional[int] = None,
  ):
    if input_prompt_length < 0:
      raise ValueError('input_prompt_length must be >= 0, got '
                       f'{input_prompt_length}.')
    if num_tasks is not None and (isinstance(num_tasks, bool) or
                                  not isinstance(num_tasks, int) or
                                  num_tasks < 1):
      raise ValueError(f'num_tasks must be None or an int >= 1, got '
                       f'{num_tasks!r}.')
    self.num_tasks = num_tasks
    self._input_prompt_length = input_prompt_length if pack else 0
    self._pack_buffer_size = pack_buffer_size
    self._max_examples_per_row = max_examples_per_row if pack else None
    if pack:
      if passthrough_features:
        raise ValueError(
            'Packing is incompatible with pass-through features (seqio); '
            f'got {sorted(passthrough_features)}.')
      self.MODEL_FEATURES = {  # pylint: disable=invalid-name
          **seqio.EncDecFeatureConverter.MODEL_FEATURES,
          **{k: seqio.FeatureConverter.FeatureSpec(dtype=tf.int32)
             for k in PACKED_TASK_IDS}}
      passthrough = None
    else:
      passthrough = {TASK_IDS: _TASK_IDS_SPEC, **(passthrough_features or {})}
    super().__init__(
        pack=pack,
        use_custom_packing_ops=use_custom_packing_ops,
        apply_length_check=apply_length_check,
        bos_id=bos_id,
        passthrough_features=passthrough)

  def __call__(self, ds: tf.data.Dataset,
               task_feature_lengths: Mapping[str, int]) -> tf.data.Dataset:
    """Converts `ds`, which must carry `task_ids`, to model features."""
    if TASK_IDS not in ds.element_spec:
      raise ValueError(
          f"The dataset has no '{TASK_IDS}' feature (it has "
          f'{sorted(ds.element_spec)}). Register tasks with '
          'hyperprompt_jax.tasks.add_task, which attaches them, and mixtures '
          'with hyperprompt_jax.tasks.add_mixture: a plain seqio.Mixture keeps '
          'only the output features and drops task ids. Packing (PACK = True) '
          'needs them to give each token its own task.')
    lengths = {k: v for k, v in task_feature_lengths.items() if k != TASK_IDS}
    if not self.pack:
      # The length of a scalar is never checked (seqio skips rank-0 features).
      lengths[TASK_IDS] = 0
    elif self._input_prompt_length >= lengths['inputs']:
      raise ValueError(
          f'input_prompt_length={self._input_prompt_length} leaves no room for '
          f"tokens in packed rows of {lengths['inputs']} inputs: raise the "
          'inputs length or shorten the prompt.')
    return super().__call__(ds, lengths)

  def checks(self, num_tasks: int, max_examples: Optional[int]) -> bool:
    """Whether this converter's rows are checked on the host already.

    That is, task ids in `[0, num_tasks)` and, packed, at most
    `max_examples` examples a row (None: any number).
    """
    if self.num_tasks is None or self.num_tasks > num_tasks:
      return False
    return (max_examples is None or not self.pack or
            (self._max_examples_per_row is not None and
             self._max_examples_per_row <= max_examples))

  def _check_task_id(self, ex: Mapping[str, tf.Tensor]
                     ) -> Mapping[str, tf.Tensor]:
    """One example, passed on once its task id lies in `[0, num_tasks)`."""
    task_id = tf.cast(ex[TASK_IDS], tf.int64)
    in_range = tf.debugging.Assert(
        (task_id >= 0) & (task_id < self.num_tasks),
        [tf.strings.format(
            'task_ids must lie in [0, num_tasks) = [0, {}), got id {}. '
            'Raise NUM_TASKS (T5Config.num_tasks) or fix the task list.',
            (self.num_tasks, task_id))])
    with tf.control_dependencies([in_range]):
      return {k: tf.identity(v) for k, v in ex.items()}

  def _convert_features(self, ds: tf.data.Dataset,
                        task_feature_lengths: Mapping[str, int]
                        ) -> tf.data.Dataset:
    """seqio's conversion, task ids checked and, packed, spread per token."""
    lengths = {k: v for k, v in task_feature_lengths.items() if k != TASK_IDS}
    if self.num_tasks is not None:
      ds = ds.map(self._check_task_id, num_parallel_calls=tf.data.AUTOTUNE)
    if not self.pack:
      return super()._convert_features(ds, lengths)
    n = self._input_prompt_length

    def per_token_ids(ex):
      ex = dict(ex)
      if n:
        slots = tf.fill([n], tf.constant(PROMPT_SLOT_TOKEN, ex['inputs'].dtype))
        ex['inputs'] = tf.concat([slots, ex['inputs']], axis=0)
      for feature in PACKED_TASK_IDS.values():
        # Packed like tokens; padding gets 0, task 0's id, which the
        # segment id 0 tells apart.
        ex[f'{feature}_task_ids'] = tf.fill(
            tf.shape(ex[feature]), tf.cast(ex[TASK_IDS], tf.int32))
      # Spread over the tokens now (the packer keeps only packed features).
      del ex[TASK_IDS]
      return ex

    ds = ds.map(per_token_ids, num_parallel_calls=tf.data.AUTOTUNE)
    packed_lengths = {
        **lengths, **{f'{f}_task_ids': lengths[f]
                      for f in PACKED_TASK_IDS.values()}}
    ds = self._pack_or_pad(ds, packed_lengths)
    return ds.map(self._convert_example, num_parallel_calls=tf.data.AUTOTUNE)

  def _pack_or_pad(self, ds: tf.data.Dataset,
                   packed_lengths: Mapping[str, int]) -> tf.data.Dataset:
    """Packs best-fit (`packing.best_fit_pack`), or pads as seqio does."""
    if not self.pack:
      return super()._pack_or_pad(ds, packed_lengths)
    return packing.best_fit_pack(ds, packed_lengths, self._pack_buffer_size,
                                 self._max_examples_per_row)

  def _convert_example(self, features: Mapping[str, tf.Tensor]
                       ) -> Mapping[str, tf.Tensor]:
    """seqio's model features, with the packed per-token task ids."""
    d = dict(super()._convert_example(features))
    if self.pack:
      for model_feature, feature in PACKED_TASK_IDS.items():
        d[model_feature] = features[f'{feature}_task_ids']
    return d

  def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]
                                ) -> Mapping[str, int]:
    """seqio's model lengths, with the task ids' (a scalar's: 0)."""
    lengths = {k: v for k, v in task_feature_lengths.items() if k != TASK_IDS}
    if not self.pack:
      return super().get_model_feature_lengths({**lengths, TASK_IDS: 0})
    model_lengths = dict(super().get_model_feature_lengths(lengths))
    for model_feature, feature in PACKED_TASK_IDS.items():
      model_lengths[model_feature] = lengths[feature]
    return model_lengths
