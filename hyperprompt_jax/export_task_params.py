r"""Exporting a checkpoint's task parameters: `python -m
hyperprompt_jax.export_task_params`.

Writes the task-conditioned parameters of one `checkpoint_<step>` (the
built-in runner's, or t5x's in either layout) as one small self-describing
file (`task_params`: the arrays, the methods, the model settings, the task
list in id order, the number of task rows, and a fingerprint of the backbone
they were trained with). The model comes from gin, as for evaluation: the
run's model, variant and task files (a run file that includes them):

  python -m hyperprompt_jax.export_task_params \
    --gin_file=runs/quickstart_model.gin \
    --checkpoint_path=/tmp/hyperprompt_quickstart/checkpoint_1500 \
    --output=/tmp/quickstart_task_params.npz

Import it by starting a run from the same backbone checkpoint with
`--gin.INITIAL_CHECKPOINT_PATH=... --gin.TASK_PARAMS_PATH=...`
(`runs/train.gin`); the method, the model settings, the task ids and the
backbone are checked, each difference named.
"""

import logging
import os
from typing import Any, Optional, Sequence

from hyperprompt_jax import gin_utils

_PROG = 'python -m hyperprompt_jax.export_task_params'


def _add_flags(parser) -> None:
  parser.add_argument('--checkpoint_path',
                      help='the checkpoint_<step> folder to export from')
  parser.add_argument('--output',
                      help='the artifact to write (.npz; local or gs://)')
  parser.add_argument('--sizes', action='store_true',
                      help="print the gin model's artifact and checkpoint "
                      'sizes (float32, from shapes; nothing is read or '
                      'written) instead of exporting')


gin_utils.cli_preamble(__name__, _PROG, __doc__, _add_flags, tensorflow=True)

# pylint: disable=g-import-not-at-top,g-bad-import-order
from flax import traverse_util
import gin
import jax
import tensorflow as tf

from hyperprompt_jax import checkpoints
from hyperprompt_jax import network
from hyperprompt_jax import optimizers
from hyperprompt_jax import run_record
from hyperprompt_jax import task_params
from hyperprompt_jax.tasks import task_ids
# pylint: enable=g-import-not-at-top,g-bad-import-order

log = logging.getLogger('hyperprompt_jax.export_task_params')


def directory_bytes(path: str) -> int:
  """The bytes of every file under `path`."""
  return sum(tf.io.gfile.stat(os.path.join(root, name)).length
             for root, _, files in tf.io.gfile.walk(path) for name in files)


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
  """Bytes, from the shapes alone: the artifact's arrays (float32; the
  header adds a few KB) and a built-in checkpoint's parameters and
  Adafactor state (`optimizers.make_optimizer`; t5x's holds the same)."""
  params = network.abstract_variables(model)['params']
  opt_state = jax.eval_shape(optimizers.make_optimizer().init, params)
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize
                            for x in jax.tree.leaves(tree))
  return {'artifact': nbytes(task_params.task_conditioned(
              traverse_util.flatten_dict(params, sep='/'))),
          'params': nbytes(params), 'optimizer_state': nbytes(opt_state)}


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = gin_utils.parse_command_line(_PROG, __doc__, argv, logger=log,
                                      add_flags=_add_flags)
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


if __name__ == '__main__':
  gin_utils.run(main)
