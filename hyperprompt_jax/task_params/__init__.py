"""Task parameters after training: their axes, the artifact, a grown task axis.

- The task-conditioned parameters are those under a method's scope
  (`param_groups`); the task-indexed ones among them carry the logical axis
  'tasks', one entry per task id, on the axis `task_axes` reads from the
  model's `params_axes` (the adapters' is second).
- An artifact (`write`, `read`) is one `.npz`: the task-conditioned arrays
  and a JSON header (methods, model settings, task list, task axes, a
  fingerprint of the backbone). npz, not an orbax checkpoint: one
  self-describing file to ship; not safetensors: not a dependency.
- `grow` appends new task ids' parameters by `NEW_TASK_INIT` ('mean',
  'copy' or 'fresh'), keeping every trained task's and the backbone.

Reading checkpoints and training only new tasks live in
`checkpointing/initial_checkpoint.py`; the artifact's use and sizes:
docs/task_params.md.
"""

import dataclasses
import hashlib
import io
import json
import zipfile
from typing import Any, Mapping, Optional, Sequence

from etils import epath
from flax import traverse_util
from flax.linen import partitioning as nn_partitioning
import numpy as np

from hyperprompt_jax import files
from hyperprompt_jax import methods
from hyperprompt_jax.methods import param_groups
from hyperprompt_jax.model import network

FORMAT = 'hyperprompt_jax.task_params/1'
TASK_AXIS = 'tasks'
NEW_TASK_INITS = ('mean', 'copy', 'fresh')
_HEADER = '__header__'
# T5Config fields that do not change what the parameters mean.
_RUNTIME_FIELDS = ('T5Config.num_tasks', 'T5Config.dtype',
                   'T5Config.dropout_rate', 'T5Config.check_traced_task_ids')

Flat = dict[str, np.ndarray]


class TaskParamsError(ValueError):
  """Task parameters that do not fit the model or the run."""


def task_axes(model: network.Transformer) -> dict[str, int]:
  """`{'/'-path: axis}` of every task-indexed parameter of `model`."""
  abstract = network.abstract_variables(model)
  names = traverse_util.flatten_dict(
      nn_partitioning.get_axis_names(abstract['params_axes']), sep='/')
  return {path: tuple(axes).index(TASK_AXIS)
          for path, axes in names.items() if TASK_AXIS in tuple(axes)}


def task_conditioned(flat: Mapping[str, Any]) -> dict[str, Any]:
  return {k: v for k, v in flat.items() if param_groups.is_task_conditioned(k)}


def backbone_fingerprint(flat: Mapping[str, np.ndarray]) -> str:
  """A sha256 of the backbone's names, shapes and a strided sample of values.

  At most 4096 values a parameter: equal backbones match, another or a
  further-trained one does not, and 11B parameters hash quickly.
  """
  digest = hashlib.sha256()
  for path in sorted(flat):
    if param_groups.is_task_conditioned(path):
      continue
    value = np.asarray(flat[path])
    sample = value.reshape(-1)[::max(1, value.size // 4096)]
    digest.update(f'{path}{value.shape}{value.dtype}'.encode())
    digest.update(np.ascontiguousarray(sample).tobytes())
  return digest.hexdigest()


def model_settings(model: network.Transformer) -> dict[str, str]:
  """The T5Config fields that fix what the task parameters mean."""
  return {k: v for k, v in network.model_settings(model.config).items()
          if k not in _RUNTIME_FIELDS}


def method_names(model: network.Transformer) -> list[str]:
  return [m.__name__.rsplit('.', 1)[-1]
          for m, _ in methods.configured(model.config)]


# -- the artifact --------------------------------------------------------------


def make_header(model: network.Transformer, flat: Mapping[str, np.ndarray],
                task_list: Sequence[str], source: str) -> dict[str, Any]:
  """The artifact's header for the task-conditioned arrays of `flat`.

  Args:
    model: the model the parameters are of.
    flat: the checkpoint `source`'s parameters by '/'-path, backbone
      included (for its fingerprint).
    task_list: the run's task list, in id order.
    source: the checkpoint's path.

  Returns:
    The header, JSON-serialisable.
  """
  axes = task_axes(model)
  return {
      'format': FORMAT,
      'methods': method_names(model),
      'model': model_settings(model),
      'task_list': list(task_list),
      'num_tasks': model.config.num_tasks,
      'task_axes': {k: axes[k] for k in sorted(task_conditioned(flat))
                    if k in axes},
      'shapes': {k: list(np.shape(v)) for k, v in
                 sorted(task_conditioned(flat).items())},
      'source_checkpoint': source,
      'backbone_fingerprint': backbone_fingerprint(flat),
  }


def check_finite(arrays: Mapping[str, np.ndarray], where: str) -> None:
  """Raises TaskParamsError naming every array of `where` with NaN or Inf.

  Such values would load silently, and the run later stop on a non-finite
  loss blamed on the learning rate.
  """
  bad = [f'{k} ({int(np.size(v) - np.isfinite(v).sum())} of {np.size(v)} '
         'values)' for k, v in sorted(arrays.items())
         if np.issubdtype(np.asarray(v).dtype, np.floating)
         and not np.isfinite(v).all()]
  if bad:
    raise TaskParamsError(
        f'{where} holds NaN or Inf in {", ".join(bad)}: the task parameters '
        'are damaged (a diverged run, a bad copy). Export them from an '
        'earlier checkpoint of the run.')


def write(path: str, arrays: Mapping[str, np.ndarray],
          header: Mapping[str, Any]) -> int:
  """Writes the artifact atomically; returns its size in bytes.

  Raises:
    TaskParamsError: an array holds NaN or Inf.
  """

  check_finite(arrays, f'The task parameters for {path}')

  buffer = io.BytesIO()
  np.savez(buffer, **{_HEADER: np.frombuffer(
      json.dumps(header, sort_keys=True).encode(), np.uint8)},
           **{k: np.asarray(v) for k, v in arrays.items()})
  data = buffer.getvalue()
  files.write_atomically(path, data)
  return len(data)


def read(path: str) -> tuple[Flat, dict[str, Any]]:
  """`(arrays, header)` of an artifact.

  Raises:
    FileNotFoundError: no artifact at `path`.
    TaskParamsError: not an artifact, cut short, of another format, arrays
      that differ from the header, or non-finite values.
  """

  if not epath.Path(path).exists():
    raise FileNotFoundError(
        f'No task-parameter artifact at {path!r} (TASK_PARAMS_PATH): write '
        'one with python -m hyperprompt_jax.export_task_params.')
  data = epath.Path(path).read_bytes()
  try:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
      arrays = {k: npz[k] for k in npz.files}
    header = json.loads(arrays.pop(_HEADER).tobytes().decode())
  except (ValueError, KeyError, OSError, zipfile.BadZipFile) as e:
    raise TaskParamsError(f'{path} is not a task-parameter artifact, or is '
                          f'cut short ({e}): export it again.') from None
  if header.get('format') != FORMAT:
    raise TaskParamsError(f'{path} has format {header.get("format")!r}; this '
                          f'version reads {FORMAT!r}.')
  # Arrays against their own header: an edited or mixed-up artifact would
  # otherwise fail later as a checkpoint whose shapes do not match.
  shapes = {k: list(np.shape(v)) for k, v in arrays.items()}
  declared = header.get('shapes', {})
  wrong = [f'{k} {shapes.get(k, "missing")} (header: '
           f'{declared.get(k, "none")})'
           for k in sorted(set(shapes) | set(declared))
           if shapes.get(k) != declared.get(k)]
  if wrong:
    raise TaskParamsError(
        f'{path} holds arrays that differ from its own header ('
        f'{"; ".join(wrong)}): the artifact was edited or mixed up; export '
        'it again.')
  check_finite(arrays, path)
  return arrays, header


def check(header: Mapping[str, Any], model: network.Transformer,
          task_list: Sequence[str],
          backbone: Optional[Mapping[str, np.ndarray]] = None,
          backbone_path: str = '') -> None:
  """Raises TaskParamsError naming every way the artifact does not fit.

  Args:
    header: the artifact's header (`read`).
    model: the model it is placed into.
    task_list: the run's task list (`task_ids.run_task_list()`); the
      artifact's tasks must keep their ids (be its first entries).
    backbone: the parameters of the backbone checkpoint it is placed on
      (None: not checked).
    backbone_path: that checkpoint, for the message.
  """
  problems = []
  ours = method_names(model)
  if header['methods'] != ours:
    problems.append(f"method: artifact {header['methods']}, model {ours}")
  settings = model_settings(model)
  for key in sorted(set(settings) | set(header['model'])):
    if settings.get(key) != header['model'].get(key):
      problems.append(f"{key}: artifact {header['model'].get(key)}, model "
                      f'{settings.get(key)}')
  if model.config.num_tasks < header['num_tasks']:
    problems.append(
        f"NUM_TASKS={model.config.num_tasks} is smaller than the artifact's "
        f"{header['num_tasks']} tasks; set --gin.NUM_TASKS="
        f"{header['num_tasks']} or more")
  for i, name in enumerate(header['task_list']):
    if i >= len(task_list) or task_list[i] != name:
      here = (f'has id {list(task_list).index(name)}' if name in task_list
              else 'is not in it')
      problems.append(
          f"task {name!r} has id {i} in the artifact but {here} in this run's "
          f'task list {list(task_list)} (ids must not move: append new tasks '
          'after the artifact\'s, tasks.add_task does)')
  if backbone is not None:
    fingerprint = backbone_fingerprint(backbone)
    if fingerprint != header['backbone_fingerprint']:
      problems.append(
          f"backbone: the artifact was trained with the backbone of "
          f"{header['source_checkpoint']}, not {backbone_path or 'this one'} "
          '(fingerprints differ); place it on that checkpoint')
  if problems:
    raise TaskParamsError('The task parameters do not fit this run:\n  '
                          + '\n  '.join(problems))


# -- growing the task axis -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Growth:
  """How the parameters of new task ids are initialised (`NEW_TASK_INIT`).

  Attributes:
    rule: 'mean' (of the trained tasks'), 'copy' (of `source`'s) or 'fresh'
      (the model's initialisation).
    source: the task 'copy' takes, a name of the run's task list.
  """
  rule: str = 'mean'
  source: Optional[str] = None

  def __post_init__(self):
    if self.rule not in NEW_TASK_INITS:
      raise ValueError(f'NEW_TASK_INIT={self.rule!r}; expected one of '
                       f'{list(NEW_TASK_INITS)}.')
    if (self.rule == 'copy') != (self.source is not None):
      raise ValueError("NEW_TASK_SOURCE names the task NEW_TASK_INIT='copy' "
                       'copies; set both or neither.')


def grow(flat: Mapping[str, np.ndarray], abstract: Mapping[str, Any],
         axes: Mapping[str, int], growth: Growth, trained: int,
         task_list: Sequence[str] = (),
         fresh: Optional[Mapping[str, np.ndarray]] = None) -> Flat:
  """Gives every task-indexed array of `flat` the model's tasks.

  The first `trained` tasks' parameters are kept, the others' (ids never
  trained, and those appended up to the model's T + k) set by `growth`.

  Args:
    flat: checkpoint (or artifact) arrays by '/'-path, T tasks each.
    abstract: the model's parameters by path (shapes), T + k tasks each.
    axes: `task_axes` of the model.
    growth: the rule.
    trained: the tasks that were trained (`trained_tasks`; at most T).
    task_list: the run's task list: 'copy' finds its source there.
    fresh: the model's freshly initialised parameters ('fresh' only).

  Returns:
    `flat` with the task-indexed arrays replaced.

  Raises:
    TaskParamsError: a checkpoint with more tasks than the model,
      task-indexed arrays that disagree on T, or a 'copy' source that was
      not trained.
  """
  counts = {k: np.shape(flat[k])[axes[k]] for k in axes if k in flat}
  if not counts:
    return dict(flat)
  if len(set(counts.values())) > 1:
    raise TaskParamsError(f'The task-indexed arrays disagree on the number '
                          f'of tasks: {counts}.')
  old = next(iter(counts.values()))
  new = abstract[next(iter(counts))].shape[axes[next(iter(counts))]]
  if old > new:
    raise TaskParamsError(
        f'The checkpoint has {old} tasks, the model {new}: set '
        f'--gin.NUM_TASKS={old} or more (a model can grow, not shrink).')
  trained = min(trained, old)
  if trained == new:
    return dict(flat)
  if growth.rule == 'copy':
    source = (list(task_list).index(growth.source)
              if growth.source in task_list else None)
    if source is None or source >= trained:
      raise TaskParamsError(
          f'NEW_TASK_SOURCE={growth.source!r} is not a trained task: the '
          f'trained tasks are {list(task_list)[:trained]}.')
  if growth.rule == 'mean' and not trained:
    raise TaskParamsError("NEW_TASK_INIT='mean' needs trained tasks; the "
                          "checkpoint has none: use 'fresh'.")
  if growth.rule == 'fresh' and fresh is None:
    raise ValueError("NEW_TASK_INIT='fresh' needs the model's fresh "
                     'parameters.')
  out = dict(flat)
  for path, axis in axes.items():
    if path not in flat:
      continue
    value = np.asarray(flat[path])
    if growth.rule == 'mean':
      mean = value.take(range(trained), axis).astype(np.float64).mean(
          axis, keepdims=True)
      added = np.repeat(mean, new - trained, axis)
    elif growth.rule == 'copy':
      added = value.take([source] * (new - trained), axis)
    else:
      added = np.asarray(fresh[path]).take(range(trained, new), axis)
    out[path] = np.concatenate(
        [value.take(range(trained), axis), added.astype(value.dtype)], axis)
  return out
