"""Whether a t5x run saves its data iterator with each checkpoint.

A run that saves it (`SaveCheckpointConfig.save_dataset`) continues its data
where a checkpoint left it; one that does not replays its data. t5x
restores the iterator from whatever checkpoint a run restores, the one it
starts from included, so saving is safe only where that start holds no
iterator t5x would read: `saves_data_iterator` decides it, and
`gin/t5x/train.gin` binds its answer to `SAVE_DATASET`.
"""

import os
from typing import Optional

from absl import logging
from t5x import checkpoint_utils
from t5x import checkpoints
from tensorflow.io import gfile

# The item under which t5x's Orbax manager writes the iterator in each
# checkpoint_<step>/ (t5x/checkpoints.py, `_DATASET_KEY`).
DATASET_ITEM = 'dataset'


def restores_an_iterator(checkpoint_path: str) -> bool:
  """Whether t5x, starting a run from `checkpoint_path`, reads an iterator.

  As `OrbaxCheckpointManager.restore`: TensorFlow and legacy t5x checkpoints
  (the public pretrained T5 ones) are read without it; an Orbax checkpoint
  with its `dataset` item when the run saves iterators.
  """
  if gfile.exists(checkpoint_path + '.index'):
    return False
  try:
    metadata = checkpoints.find_checkpoint(checkpoint_path)
  except ValueError:  # no `checkpoint` file: an Orbax checkpoint
    return True
  return (checkpoint_utils.detect_checkpoint_type(metadata)
          is checkpoint_utils.CheckpointTypes.ORBAX)


def saves_data_iterator(initial_checkpoint_path: Optional[str],
                        model_dir: str) -> bool:
  """`SAVE_DATASET`'s default: on unless the run's start forbids it.

  A run resumes as it began (its newest checkpoint holds an iterator or not).
  A new run saves it unless it starts from an Orbax checkpoint (a t5x run's
  own, or `import_task_params`' output), and then says so.
  """
  step = checkpoints.latest_step(model_dir) if gfile.isdir(model_dir) else None
  if step is not None:
    return gfile.isdir(os.path.join(
        checkpoints.get_checkpoint_dir(model_dir, step), DATASET_ITEM))
  if initial_checkpoint_path and restores_an_iterator(initial_checkpoint_path):
    logging.warning(
        'SAVE_DATASET is off: t5x would read a data iterator from the Orbax '
        'checkpoint this run starts from (INITIAL_CHECKPOINT_PATH=%s), which '
        'holds none or another run\'s. A preempted run replays its data from '
        'the beginning; start from a legacy or TensorFlow t5x checkpoint to '
        'keep the data position.', initial_checkpoint_path)
    return False
  return True
