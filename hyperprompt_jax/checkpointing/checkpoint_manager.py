"""The built-in runner's checkpoints: orbax, in `checkpoint_<step>` folders.

Each checkpoint holds three items, written atomically together by orbax:

  checkpoint_<step>/state/    the train state (step, params, optimizer state)
  checkpoint_<step>/dataset/  the tf.data iterator's position, one file per
                              process; a process restores that of a process
                              that read the same data shard, so the process
                              count may change
  checkpoint_<step>/run/      the record of the run that wrote it
                              (`run_record`; absent in older checkpoints)

so a killed run resumes exactly from its last complete checkpoint. A newest
checkpoint that cannot be read is moved to `MODEL_DIR/unreadable/` and the
run resumes from the newest that restores (`restore_newest`). Folders are
named like t5x's, so one evaluator reads both runners' output.
"""

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Iterator, Optional

from etils import epath
import jax
import orbax.checkpoint as ocp
import tensorflow as tf

from hyperprompt_jax.checkpointing import checkpoints
from hyperprompt_jax.common import multihost

STATE = 'state'
DATASET = 'dataset'
RUN = 'run'
PREFIX = 'checkpoint'
UNREADABLE = 'unreadable'  # where checkpoints that fail to restore are kept

log = logging.getLogger('hyperprompt_jax.train')


class ResumeMismatchError(ValueError):
  """The checkpoint was written by another model or data configuration."""


class UnreadableCheckpointsError(ValueError):
  """No checkpoint of the directory restores."""


class DatasetIteratorHandler(ocp.CheckpointHandler):
  """Saves / restores a tf.data iterator with `tf.train.Checkpoint`.

  orbax has none (t5x writes the iterator the same way). One file per
  process, as each reads a shard; a restore reads the file of a process of
  the saving run that read the same shard (`run_record.data_source`).
  """

  def save(self, directory: epath.Path, args: 'DatasetIteratorSave'):
    """Writes this process's iterator position."""
    tf.train.Checkpoint(iterator=args.iterator).write(
        iterator_prefix(directory, jax.process_index()))

  def restore(self, directory: epath.Path,
              args: 'DatasetIteratorRestore') -> Any:
    """Moves the iterator to `args.source_process`'s saved position."""
    source = (jax.process_index() if args.source_process is None
              else args.source_process)
    tf.train.Checkpoint(iterator=args.iterator).read(
        iterator_prefix(directory, source)).assert_consumed()
    return args.iterator


def iterator_prefix(directory: epath.Path, process: int) -> str:
  """Where process `process` saves its data position in `dataset`."""
  return os.fspath(directory / f'process_{process}' / 'iterator')


@ocp.args.register_with_handler(DatasetIteratorHandler, for_save=True)
@dataclasses.dataclass
class DatasetIteratorSave(ocp.args.CheckpointArgs):
  """Saves `iterator`."""
  iterator: Any


@ocp.args.register_with_handler(DatasetIteratorHandler, for_restore=True)
@dataclasses.dataclass
class DatasetIteratorRestore(ocp.args.CheckpointArgs):
  """Restores `iterator` from `source_process`'s file (None: its own)."""
  iterator: Any
  source_process: Optional[int] = None


def make_manager(model_dir: str, save_period: int, keep: Optional[int],
                 keep_also: Optional[Any] = None) -> ocp.CheckpointManager:
  """An orbax manager of the run's checkpoints, saving asynchronously.

  Args:
    model_dir: MODEL_DIR.
    save_period: steps between checkpoints.
    keep: the newest checkpoints kept; None: all.
    keep_also: an orbax preservation policy keeping more (KEEP_BEST_BY's).

  Returns:
    The manager.
  """
  options = ocp.CheckpointManagerOptions(
      save_interval_steps=save_period,
      step_prefix=PREFIX,
      create=True,
      enable_async_checkpointing=True,
      preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(
          [ocp.checkpoint_managers.LatestN(keep)]
          + ([keep_also] if keep_also is not None else [])),
  )
  return ocp.CheckpointManager(
      epath.Path(model_dir), options=options,
      item_handlers={STATE: ocp.StandardCheckpointHandler(),
                     DATASET: DatasetIteratorHandler(),
                     RUN: ocp.JsonCheckpointHandler()})


def save(manager: ocp.CheckpointManager, step: int, state: Any, iterator,
         record: dict[str, Any], force: bool = False) -> bool:
  """Saves if `step` is due or `force`, with the run's `record`.

  Returns:
    Whether it saved.
  """
  return manager.save(
      step,
      args=ocp.args.Composite(**{
          STATE: ocp.args.StandardSave(state),
          DATASET: DatasetIteratorSave(iterator),
          RUN: ocp.args.JsonSave(record),
      }),
      force=force)


def read_record(manager: ocp.CheckpointManager, step: int
                ) -> Optional[dict[str, Any]]:
  """The run record saved with `step`; None in older checkpoints."""
  directory = manager.directory / f'{PREFIX}_{step}' / RUN
  if not directory.exists():
    return None
  return manager.restore(
      step, args=ocp.args.Composite(**{RUN: ocp.args.JsonRestore()}))[RUN]


def state_shapes(manager: ocp.CheckpointManager, step: int
                 ) -> dict[str, tuple[int, ...]]:
  """`{'params/encoder/...': shape}` of the saved state, from its metadata."""
  tree = manager.item_metadata(step)[STATE]
  return state_shapes_of(getattr(tree, 'tree', tree))


def check_shapes(saved: dict[str, tuple[int, ...]], abstract_state: Any,
                 checkpoint: str) -> None:
  """Raises ResumeMismatchError naming every array that does not match."""
  wanted = state_shapes_of(abstract_state)
  # Parameters first: the optimizer state only mirrors them.
  order = lambda k: (not k.startswith('params/'), k)  # pylint: disable=unnecessary-lambda-assignment
  missing = sorted(set(wanted) - set(saved), key=order)
  extra = sorted(set(saved) - set(wanted), key=order)
  reshaped = sorted((k for k in set(saved) & set(wanted)
                     if saved[k] != wanted[k]), key=order)
  if not (missing or extra or reshaped):
    return
  def some(names, fmt=str):
    return ', '.join(fmt(n) for n in names[:6]) + (
        f' (+{len(names) - 6} more)' if len(names) > 6 else '')
  lines = []
  if reshaped:
    lines.append('shapes differ: ' + some(
        reshaped, lambda k: f'{k} {saved[k]} -> {wanted[k]}'))
  if missing:
    lines.append(f'new in this configuration: {some(missing)}')
  if extra:
    lines.append(f'in the checkpoint only: {some(extra)}')
  raise ResumeMismatchError(
      f'{checkpoint} was written by a different model or optimizer '
      f'configuration; {"; ".join(lines)}. Resume with the configuration '
      'that wrote it (its config.gin), or train the new configuration in a '
      'new MODEL_DIR (INITIAL_CHECKPOINT_PATH can load this checkpoint\'s '
      'backbone).')


def state_shapes_of(tree: Any) -> dict[str, tuple[int, ...]]:
  """`{'params/encoder/...': shape}` of a state of arrays or shape structs."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path, simple=True, separator='/'):
          tuple(v.shape) for path, v in flat}


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any,
            iterator, source_process: Optional[int] = None) -> Any:
  """Restores `step`'s state and, if given, `iterator`'s position.

  Args:
    manager: the run's manager.
    step: the checkpoint's step.
    abstract_state: the state's shapes and shardings.
    iterator: the data iterator; None: the state only.
    source_process: whose saved position to take; None: this process's.

  Returns:
    The state.
  """
  items = {STATE: ocp.args.StandardRestore(abstract_state)}
  if iterator is not None:
    items[DATASET] = DatasetIteratorRestore(iterator, source_process)
  return manager.restore(step, args=ocp.args.Composite(**items))[STATE]


def _has_iterator(manager: ocp.CheckpointManager, step: int,
                  process: int) -> bool:
  """Whether `step` holds process `process`'s data position."""
  prefix = iterator_prefix(manager.directory / f'{PREFIX}_{step}' / DATASET,
                           process)
  return tf.io.gfile.exists(prefix + '.index')


class _FailedElsewhere(Exception):
  """Another process could not read the checkpoint."""


def _set_aside(manager: ocp.CheckpointManager, step: int) -> str:
  """Moves `checkpoint_<step>` into `MODEL_DIR/unreadable/`; returns where.

  Never deletes: the user may want to inspect or repair it.
  """
  source = manager.directory / f'{PREFIX}_{step}'
  target_dir = manager.directory / UNREADABLE
  target_dir.mkdir(parents=True, exist_ok=True)
  target = target_dir / source.name
  if target.exists():
    target = target_dir / f'{source.name}-{time.strftime("%Y%m%d-%H%M%S")}'
  source.rename(target)
  return os.fspath(target)


def restore_newest(
    manager: ocp.CheckpointManager, abstract_state: Any,
    make_iterator: Callable[[], Iterator],
    check: Callable[[int, Optional[dict[str, Any]]], Optional[int]],
) -> Optional[tuple[int, Any, Iterator]]:
  """Restores the newest checkpoint that can be read, on every process.

  Newer checkpoints that fail to restore are moved to `MODEL_DIR/unreadable/`
  with a warning, so later saves do not collide with them; a checkpoint of
  another configuration is an error, not a fallback. Processes decide each
  step together (process 0's list; one that a process cannot read is
  skipped by all), so none waits in orbax's restore for one that gave up.

  Args:
    manager: the run's manager (`make_manager`).
    abstract_state: the state's shapes and shardings.
    make_iterator: a fresh data iterator (one per attempt: a failed restore
      may leave an iterator half-moved).
    check: `(step, record)` raises ResumeMismatchError when the checkpoint's
      run record (None: no record) does not match this run; it returns the
      process whose saved data position this process takes
      (`run_record.data_source`), or None to start the data afresh.

  Returns:
    `(step, state, iterator)`, or None when the directory has no checkpoint.

  Raises:
    ResumeMismatchError: the newest readable checkpoint is of another model
      or data configuration.
    UnreadableCheckpointsError: checkpoints exist and none restores.
  """
  failures = []

  def agreed(error: Optional[Exception], step: int) -> bool:
    ok = multihost.all_true(error is None)
    if not ok:
      failures.append((step, error or _FailedElsewhere(
          'another process could not read it')))
    return ok

  steps = multihost.broadcast_json(sorted(manager.all_steps(), reverse=True))
  for step in steps:
    name = f'checkpoint_{step}'
    error = saved = record = None
    try:
      saved = state_shapes(manager, step)
      record = read_record(manager, step)
    except Exception as e:  # pylint: disable=broad-except
      error = e
    if not agreed(error, step):
      continue
    # Every process reads the same record: they refuse alike.
    source = check(step, record)  # names settings, so before the shapes
    check_shapes(saved, abstract_state, name)
    error = None
    if source is not None and not _has_iterator(manager, step, source):
      error = FileNotFoundError(
          f'{DATASET}/process_{source}/iterator (the data position of this '
          "process's shard) is missing")
    if not agreed(error, step):
      continue
    iterator = make_iterator()
    try:
      state = restore(manager, step, abstract_state,
                      iterator if source is not None else None, source)
    except Exception as e:  # pylint: disable=broad-except
      error = e
    if not agreed(error, step):
      continue
    if failures and jax.process_index() == 0:
      for bad, failure in failures:
        where = _set_aside(manager, bad)
        log.warning('checkpoint_%d cannot be restored (%s); moved it to %s '
                    'and resumed from checkpoint_%d.', bad,
                    checkpoints.error_summary(failure), where, step)
    if failures:
      multihost.sync('unreadable checkpoints moved')  # every host lists them
      manager.reload()
    return step, state, iterator
  if failures:
    raise UnreadableCheckpointsError(
        f'None of the checkpoints in {manager.directory} can be restored: ' +
        '; '.join(f'checkpoint_{s}: {checkpoints.error_summary(e)}'
                  for s, e in failures) +
        '. Nothing was moved or deleted. Check the file system; to start '
        'afresh, use a new MODEL_DIR.')
  return None
