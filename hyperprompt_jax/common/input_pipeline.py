"""The training input pipeline: seqio batches carrying `task_ids`, per host.

Each host reads its shard of the mixture (`multihost.data_layout`) and
batches `batch_size / num_shards` examples; the runner assembles the global
batch with `jax.make_array_from_process_local_data`. The tf.data iterator is
checkpointable, so a resumed run continues where the data left off (t5x's
`save_dataset`).
"""

from typing import Mapping, Optional

import jax
import numpy as np
import seqio
import tensorflow as tf

# Registers the project's seqio tasks.
from hyperprompt_jax import tasks  # pylint: disable=unused-import
from hyperprompt_jax.common import batches


def get_mixture_or_task(name: str) -> seqio.DatasetProviderBase:
  """The registered seqio Task or Mixture, or a ValueError naming the fix."""
  try:
    return seqio.get_mixture_or_task(name)
  except ValueError as e:
    raise ValueError(
        f'Unknown MIXTURE_OR_TASK_NAME {name!r}: {e} Import the module that '
        'registers it (the project registers its tasks in '
        'hyperprompt_jax.tasks), or pick one of the gin/tasks/*.gin files.'
    ) from None


def _has_examples(task: seqio.Task, split: str) -> bool:
  """Whether `task`'s source has any example in `split`."""
  try:
    size = task.source.num_input_examples(split)
  except Exception:  # pylint: disable=broad-except
    size = None  # sources without sizes raise or return None
  if isinstance(size, int):
    return size > 0
  dataset = task.source.get_dataset(split=split, shuffle=False)
  return any(True for _ in dataset.take(1))


def _task_rates(mixture_or_task_name: str) -> list[tuple[seqio.Task, float]]:
  """`(task, rate)` of each task of the mixture."""
  provider = get_mixture_or_task(mixture_or_task_name)
  if isinstance(provider, seqio.Mixture):
    return [(t, provider.get_rate(t)) for t in provider.tasks]
  return [(provider, 1.0)]


def sampled_tasks(mixture_or_task_name: str) -> list[str]:
  """The names of the tasks the mixture trains (rate > 0)."""
  return [t.name for t, rate in _task_rates(mixture_or_task_name)
          if rate > 0]


def check_samplable(mixture_or_task_name: str, split: str = 'train') -> None:
  """Raises ValueError, naming the tasks, if the mixture cannot be sampled.

  That is, every task at rate 0, or a sampled task whose `split` is missing
  or empty (seqio would raise a bare StopIteration after compiling).
  """
  rates = _task_rates(mixture_or_task_name)
  sampled = [t for t, rate in rates if rate > 0]
  if not sampled:
    raise ValueError(
        f'MIXTURE_OR_TASK_NAME {mixture_or_task_name!r} has nothing to '
        f'train on: every task has rate 0 (evaluation only): '
        f'{sorted(t.name for t, _ in rates)}. Give a task a positive rate, '
        'or train on a mixture that has one.')
  empty = sorted(t.name for t in sampled
                 if split not in t.splits or not _has_examples(t, split))
  if empty:
    raise ValueError(
        f'MIXTURE_OR_TASK_NAME {mixture_or_task_name!r} samples tasks with no '
        f'{split!r} examples: {empty}. Prepare their data (TFDS_DATA_DIR), or '
        'give them rate 0 (tasks.EVAL_ONLY) to evaluate them only.')


def train_dataset(mixture_or_task_name: str,
                  task_feature_lengths: Mapping[str, int],
                  batch_size: int, seed: Optional[int] = 0,
                  split: str = 'train',
                  rows: batches.RowFormat = batches.RowFormat(),
                  use_cached: bool = False,
                  shard_index: Optional[int] = None,
                  num_shards: Optional[int] = None) -> tf.data.Dataset:
  """This host's infinite, shuffled, batched training data.

  Args:
    mixture_or_task_name: the registered seqio mixture or task.
    task_feature_lengths: `{'inputs': length, 'targets': length}`.
    batch_size: the global batch size.
    seed: the shuffle seed.
    split: the split.
    rows: the run's rows (`batches.RowFormat.of`).
    use_cached: read seqio's offline cache.
    shard_index: this host's shard (`multihost.DataLayout`; default: one
      per process).
    num_shards: the number of shards.

  Returns:
    A tf.data.Dataset of dicts with `encoder_input_tokens`,
    `decoder_input_tokens`, `decoder_target_tokens`, `decoder_loss_weights`
    (int32 [local_batch, length]) and `task_ids` (int32 [local_batch]);
    packed: `encoder_task_ids` / `decoder_task_ids` (int32 [local_batch,
    length]) instead, and seqio's segment ids and positions.
  """
  provider = get_mixture_or_task(mixture_or_task_name)
  if split not in provider.splits:
    raise ValueError(f'{mixture_or_task_name!r} has no {split!r} split; it '
                     f'has {list(provider.splits)}.')
  if num_shards is None:
    shard_index, num_shards = jax.process_index(), jax.process_count()
  if batch_size % num_shards:
    raise ValueError(f'BATCH_SIZE={batch_size} does not divide over the '
                     f'{num_shards} data shards of the hosts: set '
                     f'--gin.BATCH_SIZE to a multiple of {num_shards}.')
  converter = rows.converter()
  return seqio.get_dataset(
      mixture_or_task_name,
      task_feature_lengths=dict(task_feature_lengths),
      dataset_split=split,
      shuffle=True,
      num_epochs=None,
      shard_info=seqio.ShardInfo(index=shard_index, num_shards=num_shards),
      seed=seed,
      use_cached=use_cached,
      batch_size=batch_size // num_shards,
      feature_converter=converter)


def as_numpy(batch) -> dict[str, np.ndarray]:
  """A batch of tensors as numpy arrays."""
  return {k: v.numpy() for k, v in batch.items()}


def eval_tasks(mixture_or_task_name: str, split: str) -> list[seqio.Task]:
  """The tasks of the mixture that have `split` and metrics."""
  provider = get_mixture_or_task(mixture_or_task_name)
  found = seqio.evaluation.get_valid_eval_tasks(
      seqio.get_subtasks(provider), split)
  if not found:
    raise ValueError(f'{mixture_or_task_name!r} has no task with a {split!r} '
                     'split and metrics to evaluate.')
  return list(found)
