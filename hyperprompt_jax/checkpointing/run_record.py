"""What each checkpoint records of the run that wrote it, and resume checks.

Saved with every checkpoint (`checkpoint_manager`, item `run`): the model's
settings, the data settings the iterator's position depends on, the data
layout (`multihost.DataLayout`) and the gin configs. A resuming run refuses
any difference, naming each setting: orbax would otherwise fail on shapes
(advising `strict=False`, which loads the wrong model) or, for the data,
restore an iterator of another mixture.

`MODEL_DIR/config.gin` and `operative_config.gin` are written with the first
checkpoint, not at start, so a run that fails before saving leaves the
record of the run that wrote the checkpoints intact.
"""

import logging
import os
from typing import Any, Mapping, Optional, Sequence

from etils import epath
import gin
import orbax.checkpoint as ocp

from hyperprompt_jax import files
from hyperprompt_jax.checkpointing.checkpoint_manager import ResumeMismatchError
from hyperprompt_jax.model import network
from hyperprompt_jax.tasks import packing

VERSION = 1

log = logging.getLogger('hyperprompt_jax.train')


def data_settings(mixture_or_task_name: str,
                  task_feature_lengths: Mapping[str, int], batch_size: int,
                  pack: bool, seed: int,
                  max_examples_per_row: Optional[int] = None
                  ) -> dict[str, Any]:
  """The settings the saved data position belongs to, by macro name.

  PACKER names the packer whose buffer and open row the position holds.
  """
  return {'MIXTURE_OR_TASK_NAME': mixture_or_task_name,
          'TASK_FEATURE_LENGTHS': dict(task_feature_lengths),
          'BATCH_SIZE': batch_size, 'PACK': pack, 'SEED': seed,
          'PACKER': packing.name(max_examples_per_row) if pack else None}


# The data record's learning-rate schedule (`schedules.Schedule.record`).
# Records written before it was recorded trained at a constant rate (whose
# value they did not record): read as that, a resume compares the factors.
SCHEDULE = 'LEARNING_RATE_SCHEDULE'
UNRECORDED_SCHEDULE = {'factors': 'constant'}


def _saved_packer(saved_data: Mapping[str, Any]) -> Optional[str]:
  """A record's packer; records from before PACKER packed with seqio's."""
  if 'PACKER' in saved_data:
    return saved_data['PACKER']
  return 'seqio' if saved_data.get('PACK') else None


def make(model_config: Any, data: Mapping[str, Any], start_step: int,
         task_list: Sequence[str] = (),
         processes: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
  """The record saved with each checkpoint of a run started at `start_step`.

  Args:
    model_config: the `T5Config`.
    data: `data_settings`, plus what else the data position depends on
      (the schedule, the balancing, the new tasks).
    start_step: the step the run started at.
    task_list: the run's, in id order (which tasks' parameters trained).
    processes: the data layout (`multihost.DataLayout.record`).

  Returns:
    The record, JSON-serialisable.
  """
  return {'version': VERSION, 'start_step': start_step,
          'model': network.model_settings(model_config), 'data': dict(data),
          'task_list': list(task_list),
          'processes': dict(processes or {}),
          'config_gin': gin.config_str(),
          'operative_config_gin': gin.operative_config_str()}


# MetaBalance settings that bound a run without changing its step (records
# of earlier versions hold them; a resume ignores them).
_BALANCING_GUARDS = ('METABALANCE_MAX_AUXILIARIES',)


def balancing_record(settings: Mapping[str, Any]) -> dict[str, Any]:
  """MetaBalance's step-changing settings as `METABALANCE_<NAME>` macros."""
  out = {'METABALANCE_' + k.upper(): v for k, v in settings.items()}
  return {k: v for k, v in out.items() if k not in _BALANCING_GUARDS}


def check_resume(record: Mapping[str, Any], model_config: Any,
                 data: Mapping[str, Any], checkpoint: str,
                 task_list: Sequence[str]) -> None:
  """Raises ResumeMismatchError naming each setting or task id that differs."""
  changes = []
  now = network.model_settings(model_config)
  saved = record.get('model', {})
  for name in sorted(set(now) | set(saved)):
    if name not in network.MEMORY_CHOICES and now.get(name) != saved.get(name):
      changes.append(f'{name}: {saved.get(name, "(unset)")} -> '
                     f'{now.get(name, "(unset)")}')
  moved = task_list_change(record.get('task_list') or [], task_list)
  if moved:
    changes.append(moved)
  saved_data = dict(record.get('data', {}))
  saved_data['PACKER'] = _saved_packer(saved_data)
  if isinstance(saved_data.get('GRADIENT_BALANCING'), Mapping):
    saved_data['GRADIENT_BALANCING'] = {
        k: v for k, v in saved_data['GRADIENT_BALANCING'].items()
        if k not in _BALANCING_GUARDS}
  saved_data.setdefault(SCHEDULE, UNRECORDED_SCHEDULE)
  for name in data:
    now_value = data[name]
    if name == SCHEDULE and isinstance(now_value, Mapping):
      # Only the settings the saved record holds.
      now_value = {k: now_value.get(k) for k in saved_data[name]}
    if name in saved_data and _plain(saved_data[name]) != _plain(now_value):
      changes.append(f'{name}: {saved_data[name]!r} -> {data[name]!r}')
  if changes:
    raise ResumeMismatchError(
        f'MODEL_DIR holds {checkpoint}, written with other settings than '
        f'this run\'s: {"; ".join(changes)}. Resume with the settings that '
        'wrote it (its record: MODEL_DIR/config.gin), '
        'or train this configuration in a new MODEL_DIR.')


# T5Config fields a reader of a checkpoint may set as it likes: they do not
# change what the parameters mean.
_READER_CHOICES = ('T5Config.dtype', 'T5Config.dropout_rate',
                   'T5Config.check_traced_task_ids')


class RecordMismatchError(ValueError):
  """A checkpoint read with other settings or task ids than it trained with."""


def task_list_change(saved: Sequence[str], now: Sequence[str]
                     ) -> Optional[str]:
  """How `now` (a run's task list) moves the ids of `saved`'s tasks, or None.

  The saved tasks must keep their ids: be the first entries of `now`.
  """
  for i, name in enumerate(saved):
    if i >= len(now) or now[i] != name:
      where = (f'id {list(now).index(name)}' if name in now
               else 'no id (it is not in the task list)')
      return (f'task {name!r} has id {i} in the checkpoint but {where} in '
              f'this run (checkpoint: {list(saved)}; this run: {list(now)})')
  return None


def record_changes(record: Mapping[str, Any], model_config: Any,
                   task_list: Sequence[str],
                   ignore: Sequence[str] = _READER_CHOICES) -> list[str]:
  """Each model setting (but `ignore`) and task id a reader changes."""
  now = network.model_settings(model_config)
  saved = record.get('model', {})
  changes = [f'{name}: {saved.get(name, "(unset)")} -> '
             f'{now.get(name, "(unset)")}'
             for name in sorted(set(now) | set(saved))
             if name not in (*ignore, *network.MEMORY_CHOICES)
             and now.get(name) != saved.get(name)]
  moved = task_list_change(record.get('task_list') or [], task_list)
  if moved:
    changes.append(moved)
  return changes


@gin.configurable
def check_checkpoint(checkpoint_path: str, model_config: Any,
                     task_list: Sequence[str], allow_mismatch: bool = False
                     ) -> None:
  """Refuses a built-in checkpoint read as anything but what it trained as.

  Its run record's model settings and task ids: a task's parameters read as
  another's give wrong predictions with no error. t5x's checkpoints record
  neither: nothing to compare.

  Args:
    checkpoint_path: a `checkpoint_<step>` folder.
    model_config: the reader's `T5Config`.
    task_list: the reader's task list (`task_ids.run_task_list()`).
    allow_mismatch: read it anyway, warning of each difference (gin:
      `run_record.check_checkpoint.allow_mismatch = True`).

  Raises:
    RecordMismatchError: naming each difference and the override.
  """
  record = read(checkpoint_path)
  if record is None:
    return
  changes = record_changes(record, model_config, task_list)
  if not changes:
    return
  if allow_mismatch:
    log.warning('Reading %s despite its record: %s.', checkpoint_path,
                '; '.join(changes))
    return
  raise RecordMismatchError(
      f'{checkpoint_path} was trained with other settings than this '
      f'command\'s: {"; ".join(changes)}. Use the gin files that trained it '
      '(its MODEL_DIR/config.gin) and the same task list (tasks registered in '
      'the same order); to read it anyway, add '
      '--gin.run_record.check_checkpoint.allow_mismatch=True.')


def data_source(record: Optional[Mapping[str, Any]], layout: Any,
                restart_data: bool, checkpoint: str) -> Optional[int]:
  """The saving run's process whose data position this process restores.

  One that read the same data shard: a shard's position carries over to any
  number of processes as long as the data is cut into the same shards.

  Args:
    record: the checkpoint's run record (None, or without 'processes':
      older; each process takes its own).
    layout: this run's `multihost.DataLayout`.
    restart_data: RESTART_DATA_ON_LAYOUT_CHANGE.
    checkpoint: its name, for messages.

  Returns:
    The process index, or None: the layout changed and `restart_data` starts
    the data stream afresh.

  Raises:
    ResumeMismatchError: the number of data shards changed and
      `restart_data` is off.
  """
  saved = (record or {}).get('processes') or {}
  if 'DATA_SHARDS' not in saved:
    return layout.process_index
  if saved['DATA_SHARDS'] == layout.num_shards:
    return list(saved['SHARD_OF_PROCESS']).index(layout.shard_index)
  change = (f"{checkpoint} was written with the data in "
            f"{saved['DATA_SHARDS']} shard(s) over {saved['PROCESS_COUNT']} "
            f'process(es); this run cuts it into {layout.num_shards} '
            f'over {layout.process_count}')
  if restart_data:
    log.warning('%s. RESTART_DATA_ON_LAYOUT_CHANGE: the parameters and '
                'optimizer state resume; the data stream starts afresh '
                '(from its beginning, under the new layout), so the data '
                'order is not that of an uninterrupted run.', change)
    return None
  raise ResumeMismatchError(
      f'{change}, so no saved data position applies. Resume with '
      f"{saved['PROCESS_COUNT']} process(es) and the same MESH_MODEL, or set "
      '--gin.RESTART_DATA_ON_LAYOUT_CHANGE=True to resume the parameters and '
      'optimizer state and restart the data stream (the data order is then '
      'not reproducible).')


def _plain(value: Any) -> Any:
  """JSON round-trips tuples as lists and keys as strings."""
  if isinstance(value, Mapping):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


def write_gin_files(model_dir: str, record: Mapping[str, Any]) -> None:
  """Writes `model_dir`'s config.gin and operative_config.gin, atomically."""
  for name, key in (('config.gin', 'config_gin'),
                    ('operative_config.gin', 'operative_config_gin')):
    files.write_atomically(os.path.join(model_dir, name), record[key])


def read(checkpoint_path: str) -> Optional[dict[str, Any]]:
  """The record of a built-in `checkpoint_<step>`; None for t5x's and older."""
  directory = epath.Path(checkpoint_path) / 'run'
  if not directory.exists():
    return None
  return ocp.JsonCheckpointHandler().restore(directory)
