"""The parameters a run starts from (INITIAL_CHECKPOINT_PATH).

A t5x or built-in checkpoint's, with the run's new tasks' parameters added
and an exported task-parameter artifact placed on its backbone; how many
tasks it trained; the optimizer that trains only the new tasks'
(TRAIN_ONLY_NEW_TASKS). Apart from `trainer`, which imports no checkpoint
library.
"""

from typing import Any, Optional, Sequence

from flax import traverse_util
import gin
import jax
import numpy as np

import hyperprompt_jax
from hyperprompt_jax import task_params
from hyperprompt_jax.checkpointing import checkpoints
from hyperprompt_jax.checkpointing import run_record
from hyperprompt_jax.common import multihost
from hyperprompt_jax.methods import param_groups
from hyperprompt_jax.model import network
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import trainer as trainer_lib


def params_from_t5x(
    trainer: trainer_lib.Trainer, path: str,
    task_params_path: Optional[str] = None,
    growth: Optional[task_params.Growth] = None,
    task_list: Sequence[str] = ()) -> tuple[Any, list[str], int]:
  """A checkpoint's parameters for `trainer`'s model, placed by its shardings.

  A pretrained checkpoint gives the backbone, the task-conditioned parameters
  it lacks freshly initialised. A trained multi-task one gives its task
  parameters too; task ids it was not trained on follow `growth`
  (`task_params.grow`). An artifact at `task_params_path` replaces the
  checkpoint's task parameters.

  Args:
    trainer: the run's `trainer.Trainer` (its model, abstract parameters and
      their shardings).
    path: a `checkpoint_<step>` folder (either runner, either layout).
    task_params_path: a `task_params` artifact to place on its backbone.
    growth: how the new tasks' parameters start (default: the mean of the
      trained tasks').
    task_list: the run's task list (`task_ids.run_task_list()`).

  Returns:
    `(params, fresh, trained)`: the placed parameters, the '/'-paths freshly
    initialised, and how many tasks the checkpoint (or artifact) trained
    (`trained_tasks`).

  Raises:
    ValueError: a shape mismatch, a missing backbone parameter (another
      architecture), or task parameters that do not fit
      (`task_params.TaskParamsError`).
  """
  loaded = checkpoints.load_t5x_params(path)
  if task_params_path:
    arrays, header = task_params.read(task_params_path)
    task_params.check(header, trainer.model, task_list, loaded, path)
    loaded = {k: v for k, v in loaded.items()
              if not param_groups.is_task_conditioned(k)} | arrays
  trained = trained_tasks(trainer.model, path, task_params_path)
  axes = task_params.task_axes(trainer.model)
  record = run_record.read(path)
  if record and axes and task_list and not task_params_path:
    moved = run_record.task_list_change(record.get('task_list') or [],
                                        task_list)
    if moved:
      raise task_params.TaskParamsError(
          f'INITIAL_CHECKPOINT_PATH {path}: {moved}. Its tasks\' parameters '
          'would be read as other tasks\': keep the trained tasks\' ids '
          '(append new tasks after them; tasks.add_task does).')
  abstract = traverse_util.flatten_dict(trainer.abstract_params, sep='/')
  growth = growth or task_params.Growth()
  # A fresh initialisation only where one is needed (parameters the
  # checkpoint lacks, 'fresh' new tasks): loading a whole checkpoint then
  # allocates the model once, not twice.
  fresh = None
  model_tasks = max((abstract[k].shape[a] for k, a in axes.items()),
                    default=0)
  if growth.rule == 'fresh' and trained < model_tasks:
    fresh = traverse_util.flatten_dict(trainer.fresh_params(), sep='/')
  loaded = task_params.grow(
      loaded, abstract, axes, growth, trained, list(task_list),
      fresh=None if fresh is None else multihost.host_value(
          {k: fresh[k] for k in axes}))
  loaded, missing = checkpoints.match_params(
      loaded, trainer.abstract_params, path, allow_missing=True)
  backbone_missing = [k for k in missing
                      if not param_groups.is_task_conditioned(k)]
  if backbone_missing:
    raise ValueError(
        f'INITIAL_CHECKPOINT_PATH {path} lacks backbone parameters '
        f'{backbone_missing[:5]}{" ..." if len(backbone_missing) > 5 else ""}'
        ': it is not a checkpoint of this model\'s backbone (check the '
        'model gin file).')
  if missing and fresh is None:
    fresh = traverse_util.flatten_dict(trainer.fresh_params(), sep='/')
  flat_loaded = traverse_util.flatten_dict(loaded, sep='/')
  shardings = traverse_util.flatten_dict(trainer.param_shardings, sep='/')
  params = {}
  for k, v in abstract.items():
    value = flat_loaded.get(k)
    params[k] = fresh[k] if value is None else jax.device_put(
        np.asarray(value, v.dtype), shardings[k])
  return traverse_util.unflatten_dict(params, sep='/'), missing, trained


def trained_tasks(model: network.Transformer, checkpoint_path: str,
                  artifact_path: Optional[str] = None) -> int:
  """How many tasks of a starting point were trained.

  Its task list's length (an artifact's header, a built-in run record), else,
  for t5x's checkpoints, every task its task-indexed arrays hold.
  """
  if artifact_path:
    return len(task_params.read(artifact_path)[1]['task_list'])
  record = run_record.read(checkpoint_path)
  if record and record.get('task_list'):
    return len(record['task_list'])
  shapes = checkpoints.param_shapes(checkpoint_path)
  tasks = [shapes[k][a] for k, a in task_params.task_axes(model).items()
           if k in shapes]
  return max(tasks, default=0)


def only_new_task_params(optimizer,
                         model: Optional[network.Transformer] = None,
                         first_new_task: int = 0):
  """`optimizer` on the parameters of tasks `first_new_task:` only.

  For t5x's gin (gin/t5x/add_task.gin, `OptaxWrapper.optax_optimizer`), where
  `model` defaults to the gin-configured network.
  """
  if model is None:
    model = gin.get_configurable(network.Transformer)()
  if (isinstance(first_new_task, bool)
      or not isinstance(first_new_task, int)
      or not 0 <= first_new_task < model.config.num_tasks):
    raise ValueError(
        f'The first new task must be an integer in [0, NUM_TASKS='
        f'{model.config.num_tasks}), got {first_new_task!r}: it is the '
        'number of tasks the starting checkpoint was trained on.')
  return optimizers.only_task_params(
      optimizer, {k: (axis, first_new_task)
                  for k, axis in task_params.task_axes(model).items()})


def only_new_task_rows(optimizer, model: Optional[network.Transformer] = None,
                       first_new_row: int = 0):
  """Deprecated (goes in the next release): `only_new_task_params`."""
  hyperprompt_jax.warn_renamed(
      'initial_checkpoint.only_new_task_rows(first_new_row=...) is now '
      'initial_checkpoint.only_new_task_params(first_new_task=...)')
  return only_new_task_params(optimizer, model, first_new_row)
