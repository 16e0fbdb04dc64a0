"""What each checkpoint records of the run that wrote it, and resume checks.

Saved with every checkpoint (`checkpoint_manager`, item `run`): the model's
settings (`T5Config`, flattened), the data settings the iterator's position
depends on, and the gin configs. A run that resumes compares its own with
the newest checkpoint's and refuses a difference, naming each setting:
orbax would otherwise fail on shapes (advising `strict=False`, which would
load the wrong model) or, for the data, restore an iterator of another
mixture.

The same configs are written to `MODEL_DIR/config.gin` and
`operative_config.gin` when a run saves its first checkpoint, not at start,
so a run that fails before saving leaves the record of the run that wrote
the checkpoints intact.
"""

import dataclasses
import os
from typing import Any, Mapping, Optional, Sequence

import gin

from hyperprompt_jax.checkpoint_manager import ResumeMismatchError

VERSION = 1


def model_settings(config: Any, prefix: str = 'T5Config') -> dict[str, str]:
  """`{'T5Config.num_tasks': '8', 'T5Config.hyperprompt.prompt_length':
  '16', ...}`: a dataclass config flattened, values as `repr`."""
  out = {}
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    name = f'{prefix}.{field.name}'
    if dataclasses.is_dataclass(value):
      out.update(model_settings(value, name))
    else:
      out[name] = repr(value)
  return out


def data_settings(mixture_or_task_name: str,
                  task_feature_lengths: Mapping[str, int], batch_size: int,
                  pack: bool, seed: int) -> dict[str, Any]:
  """The settings the saved data position belongs to, by macro name."""
  return {'MIXTURE_OR_TASK_NAME': mixture_or_task_name,
          'TASK_FEATURE_LENGTHS': dict(task_feature_lengths),
          'BATCH_SIZE': batch_size, 'PACK': pack, 'SEED': seed}


def make(model_config: Any, data: Mapping[str, Any], start_step: int,
         task_list: Sequence[str] = ()) -> dict[str, Any]:
  """The record saved with each checkpoint of a run started at
  `start_step`; `task_list` is the run's (id order: which task rows were
  trained, `task_params`)."""
  return {'version': VERSION, 'start_step': start_step,
          'model': model_settings(model_config), 'data': dict(data),
          'task_list': list(task_list),
          'config_gin': gin.config_str(),
          'operative_config_gin': gin.operative_config_str()}


def check_resume(record: Mapping[str, Any], model_config: Any,
                 data: Mapping[str, Any], checkpoint: str) -> None:
  """Raises ResumeMismatchError naming each model or data setting in which
  this run differs from the checkpoint's `record`."""
  changes = []
  now = model_settings(model_config)
  saved = record.get('model', {})
  for name in sorted(set(now) | set(saved)):
    if now.get(name) != saved.get(name):
      changes.append(f'{name}: {saved.get(name, "(unset)")} -> '
                     f'{now.get(name, "(unset)")}')
  saved_data = record.get('data', {})
  for name in data:
    if name in saved_data and _plain(saved_data[name]) != _plain(data[name]):
      changes.append(f'{name}: {saved_data[name]!r} -> {data[name]!r}')
  if changes:
    raise ResumeMismatchError(
        f'MODEL_DIR holds {checkpoint}, written with other settings than '
        f'this run\'s: {"; ".join(changes)}. Resume with the settings that '
        'wrote it (its record: MODEL_DIR/config.gin), '
        'or train this configuration in a new MODEL_DIR.')


def _plain(value: Any) -> Any:
  """JSON round-trips tuples as lists and keys as strings."""
  if isinstance(value, Mapping):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


def write_gin_files(model_dir: str, record: Mapping[str, Any]) -> None:
  """`MODEL_DIR/config.gin` and `operative_config.gin` from `record`, each
  replaced atomically (a reader never sees half a file)."""
  for name, key in (('config.gin', 'config_gin'),
                    ('operative_config.gin', 'operative_config_gin')):
    path = os.path.join(model_dir, name)
    with open(path + '.tmp', 'w') as f:
      f.write(record[key])
    os.replace(path + '.tmp', path)


def read(checkpoint_path: str) -> Optional[dict[str, Any]]:
  """The record of a built-in runner's `checkpoint_<step>` (None for t5x's
  checkpoints and older ones)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top

  directory = epath.Path(checkpoint_path) / 'run'
  if not directory.exists():
    return None
  return ocp.JsonCheckpointHandler().restore(directory)
