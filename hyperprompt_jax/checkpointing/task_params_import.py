"""Places a task-parameter artifact on a backbone, as a checkpoint.

Its command: `python -m hyperprompt_jax.import_task_params`.
"""

import argparse
import logging
import os
from typing import Optional

from etils import epath
import gin
import jax

from hyperprompt_jax import task_params
from hyperprompt_jax.checkpointing import checkpoints
from hyperprompt_jax.checkpointing import initial_checkpoint
from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.model import network
from hyperprompt_jax.tasks import task_ids
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import trainer as trainer_lib

log = logging.getLogger('hyperprompt_jax.import_task_params')


def import_task_params(model: network.Transformer, checkpoint_path: str,
                       output_dir: str, task_params_path: Optional[str] = None,
                       growth: Optional[task_params.Growth] = None,
                       seed: int = 0) -> str:
  """Writes `output_dir/checkpoint_0`: the backbone with the task parameters.

  The artifact's (`task_params_path`), else the checkpoint's own; tasks they
  did not train start by `growth`. Returns the checkpoint's path.

  Raises:
    task_params.TaskParamsError: an artifact that does not fit.
    ValueError: an output that exists, a checkpoint of another model.
  """
  target = os.path.join(output_dir, 'checkpoint_0')
  if epath.Path(target).exists():
    raise ValueError(f'{target} exists: choose a new --output_dir.')
  task_list = task_ids.run_task_list()
  task_ids.check_num_tasks(model.config.num_tasks, task_list)
  # The trainer's restore: one code path with INITIAL_CHECKPOINT_PATH.
  trainer = trainer_lib.Trainer(
      model, optimizers.make_optimizer(), partitioning.create_mesh(),
      {'inputs': 8, 'targets': 4}, seed=seed)
  params, fresh, trained = initial_checkpoint.params_from_t5x(
      trainer, checkpoint_path, task_params_path, growth, task_list)
  if fresh:
    raise ValueError(
        f'{checkpoint_path} lacks {len(fresh)} task-conditioned parameters '
        f'({fresh[:3]} ...): give --task_params, or a checkpoint of this '
        'method.')
  checkpoints.save_t5x_params(jax.device_get(params), output_dir, step=0)
  log.info('Wrote %s: the backbone of %s, the task parameters of %s, %d '
           'tasks (%s trained%s).', target, checkpoint_path,
           task_params_path or checkpoint_path, model.config.num_tasks,
           trained, f', {model.config.num_tasks - trained} set by '
           f'{(growth or task_params.Growth()).rule!r}'
           if trained < model.config.num_tasks else '')
  return target


def run(args: argparse.Namespace) -> int:
  """`python -m hyperprompt_jax.import_task_params` with its parsed flags."""
  gin_utils.log_to_stdout(log)
  gin_utils.parse_gin_flags(args)
  model = gin.get_configurable(network.Transformer)()
  import_task_params(
      model, args.checkpoint_path, args.output_dir, args.task_params,
      task_params.Growth(args.new_task_init, args.new_task_source), args.seed)
  return 0

