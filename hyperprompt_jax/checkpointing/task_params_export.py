"""Writes a checkpoint's task parameters as a `task_params` artifact.

Its command: `python -m hyperprompt_jax.export_task_params`.
"""

import argparse
import logging
from typing import Any, Optional, Sequence

from etils import epath
from flax import traverse_util
import gin
import jax

from hyperprompt_jax import task_params
from hyperprompt_jax.checkpointing import checkpoints
from hyperprompt_jax.checkpointing import run_record
from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.model import network
from hyperprompt_jax.tasks import task_ids
from hyperprompt_jax.training import optimizers

log = logging.getLogger('hyperprompt_jax.export_task_params')


def directory_bytes(path: str) -> int:
  """The bytes of every file under `path`."""
  return sum((epath.Path(root) / name).stat().length
             for root, _, files in epath.Path(path).walk() for name in files)


def export(model: network.Transformer, checkpoint_path: str, output: str,
           task_list: Optional[Sequence[str]] = None) -> dict[str, Any]:
  """Writes the task parameters of `checkpoint_path` to `output`.

  Args:
    model: the network the checkpoint was trained as.
    checkpoint_path: a `checkpoint_<step>` folder (either runner / layout).
    output: the artifact's path.
    task_list: the run's task list (default: gin's `run_task_list()`).

  Returns:
    The artifact's header, with 'bytes' (its size) and 'checkpoint_bytes'.

  Raises:
    checkpoints.CheckpointMismatchError: the checkpoint is of another model.
    ValueError: a model without task-conditioned parameters.
  """
  task_list = list(task_ids.run_task_list() if task_list is None
                   else task_list)
  task_ids.check_num_tasks(model.config.num_tasks, task_list)
  run_record.check_checkpoint(checkpoint_path, model.config, task_list)
  loaded = checkpoints.load_t5x_params(checkpoint_path)
  # Every parameter of the model, of the model's shape: or a clear error.
  checkpoints.match_params(
      loaded, network.abstract_variables(model)['params'], checkpoint_path)
  arrays = task_params.task_conditioned(loaded)
  if not arrays:
    raise ValueError(f'{checkpoint_path} has no task-conditioned parameters '
                     'to export (an MTL model has only the backbone).')
  header = task_params.make_header(model, loaded, task_list, checkpoint_path)
  size = task_params.write(output, arrays, header)
  return {**header, 'bytes': size,
          'checkpoint_bytes': directory_bytes(checkpoint_path)}


def sizes(model: network.Transformer) -> dict[str, int]:
  """Bytes from the shapes alone: the artifact's arrays and a checkpoint's.

  A built-in checkpoint's parameters and Adafactor state; t5x's are the same.
  """
  params = network.abstract_variables(model)['params']
  opt_state = jax.eval_shape(optimizers.make_optimizer().init, params)
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize
                            for x in jax.tree.leaves(tree))
  return {'artifact': nbytes(task_params.task_conditioned(
              traverse_util.flatten_dict(params, sep='/'))),
          'params': nbytes(params), 'optimizer_state': nbytes(opt_state)}


def run(args: argparse.Namespace) -> int:
  """`python -m hyperprompt_jax.export_task_params` with its parsed flags."""
  gin_utils.log_to_stdout(log)
  gin_utils.parse_gin_flags(args)
  model = gin.get_configurable(network.Transformer)()
  if args.sizes:
    out = sizes(model)
    checkpoint = out['params'] + out['optimizer_state']
    print(f"artifact {out['artifact'] / 1e6:.2f} MB, checkpoint "
          f'{checkpoint / 1e6:.1f} MB (parameters {out["params"] / 1e6:.1f} '
          f'MB + Adafactor state {out["optimizer_state"] / 1e6:.1f} MB): '
          f'{out["artifact"] / checkpoint:.2%}')
    return 0
  if not (args.checkpoint_path and args.output):
    raise ValueError('Give --checkpoint_path and --output (or --sizes).')
  out = export(model, args.checkpoint_path, args.output)
  log.info('Wrote %s: %d arrays of %s for tasks %s, %.1f KB (the checkpoint: '
           '%.1f MB).', args.output, len(out['shapes']),
           '+'.join(out['methods']), ', '.join(out['task_list']),
           out['bytes'] / 1e3, out['checkpoint_bytes'] / 1e6)
  return 0

