"""The built-in runner's checkpoints: orbax, in `checkpoint_<step>` folders.

Each checkpoint holds two items, written atomically together by orbax (into a
temporary folder renamed when complete):

  checkpoint_<step>/state/    the train state (step, params, optimizer state),
                              orbax's standard PyTree layout
  checkpoint_<step>/dataset/  the tf.data iterator's position, one file per
                              host (`tf.train.Checkpoint`)

so a killed run resumes from its last complete checkpoint and, with the
data's position restored, continues exactly as an uninterrupted run would.
Folders are named like t5x's, so one evaluator reads both runners' output.
"""

import dataclasses
import os
from typing import Any, Optional

from etils import epath
import jax
import orbax.checkpoint as ocp
import tensorflow as tf

STATE = 'state'
DATASET = 'dataset'
PREFIX = 'checkpoint'


class DatasetIteratorHandler(ocp.CheckpointHandler):
  """Saves / restores a tf.data iterator with `tf.train.Checkpoint`.

  orbax has no tf.data handler of its own (t5x writes the iterator beside its
  checkpoint the same way); one file per host, since every host reads its
  own shard of the data.
  """

  def _prefix(self, directory: epath.Path) -> str:
    return os.fspath(directory / f'process_{jax.process_index()}' / 'iterator')

  def save(self, directory: epath.Path, args: 'DatasetIteratorSave'):
    tf.train.Checkpoint(iterator=args.iterator).write(self._prefix(directory))

  def restore(self, directory: epath.Path,
              args: 'DatasetIteratorRestore') -> Any:
    tf.train.Checkpoint(iterator=args.iterator).read(
        self._prefix(directory)).assert_consumed()
    return args.iterator


@ocp.args.register_with_handler(DatasetIteratorHandler, for_save=True)
@dataclasses.dataclass
class DatasetIteratorSave(ocp.args.CheckpointArgs):
  iterator: Any


@ocp.args.register_with_handler(DatasetIteratorHandler, for_restore=True)
@dataclasses.dataclass
class DatasetIteratorRestore(ocp.args.CheckpointArgs):
  iterator: Any


def make_manager(model_dir: str, save_period: int,
                 keep: Optional[int]) -> ocp.CheckpointManager:
  """An orbax manager saving every `save_period` steps, keeping the newest
  `keep` (None: all), asynchronously."""
  options = ocp.CheckpointManagerOptions(
      save_interval_steps=save_period,
      max_to_keep=keep,
      step_prefix=PREFIX,
      create=True,
      enable_async_checkpointing=True,
  )
  return ocp.CheckpointManager(
      epath.Path(model_dir), options=options,
      item_handlers={STATE: ocp.StandardCheckpointHandler(),
                     DATASET: DatasetIteratorHandler()})


def save(manager: ocp.CheckpointManager, step: int, state: Any, iterator,
         force: bool = False) -> bool:
  """Saves if `step` is due (or `force`); returns whether it saved."""
  return manager.save(
      step,
      args=ocp.args.Composite(**{
          STATE: ocp.args.StandardSave(state),
          DATASET: DatasetIteratorSave(iterator),
      }),
      force=force)


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any,
            iterator) -> Any:
  """Restores `step`'s state (into `abstract_state`'s shapes and shardings)
  and moves `iterator` to the saved position."""
  restored = manager.restore(
      step,
      args=ocp.args.Composite(**{
          STATE: ocp.args.StandardRestore(abstract_state),
          DATASET: DatasetIteratorRestore(iterator),
      }))
  return restored[STATE]
