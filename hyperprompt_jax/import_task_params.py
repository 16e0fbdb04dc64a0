r"""Placing task parameters into a model: `python -m
hyperprompt_jax.import_task_params`.

Writes one checkpoint with the parameters of a model whose task axis may be
larger than the source's (`NUM_TASKS` raised for tasks added with
`tasks.add_task`):

- the backbone of `--checkpoint_path` (either runner, either layout);
- the task parameters of `--task_params` (an `export_task_params`
  artifact; its method, model settings, task ids and backbone are checked),
  or else the checkpoint's own;
- rows for the task ids the source was not trained on, by `--new_task_init`
  ('mean', 'copy' with `--new_task_source`, 'fresh'; `task_params.grow`).

The output is `<output_dir>/checkpoint_0/` in t5x's orbax layout
(`state/` = `{target: params, state: {step: 0}}`, no optimizer state), so
both runners start from it as INITIAL_CHECKPOINT_PATH: t5x through
`t5x/add_task.gin` (its restore keeps the task parameters), the built-in
runner directly (which can also grow and import by itself: runs/train.gin's
TASK_PARAMS_PATH, NEW_TASK_INIT); `eval` and `infer` read it too.

  python -m hyperprompt_jax.import_task_params \
    --gin_file=runs/quickstart_model.gin --gin.NUM_TASKS=17 \
    --checkpoint_path=/tmp/hyperprompt_quickstart/checkpoint_1500 \
    --output_dir=/tmp/quickstart_17_tasks
"""

import logging
import os
from typing import Optional, Sequence

from hyperprompt_jax import gin_utils

_PROG = 'python -m hyperprompt_jax.import_task_params'


def _add_flags(parser) -> None:
  parser.add_argument('--checkpoint_path', required=True,
                      help='the backbone checkpoint_<step> (and, without '
                      '--task_params, the task parameters)')
  parser.add_argument('--task_params', help='an export_task_params artifact')
  parser.add_argument('--output_dir', required=True,
                      help='where checkpoint_0 is written')
  parser.add_argument('--new_task_init', default='mean',
                      help="rows of new task ids: 'mean' (default), 'copy' "
                      "or 'fresh'")
  parser.add_argument('--new_task_source',
                      help="the task whose row 'copy' copies")
  parser.add_argument('--seed', type=int, default=0,
                      help="the initialisation of 'fresh' rows")


gin_utils.cli_preamble(__name__, _PROG, __doc__, _add_flags, tensorflow=True)

# pylint: disable=g-import-not-at-top,g-bad-import-order
import gin
import jax
import numpy as np
import orbax.checkpoint as ocp

from hyperprompt_jax import network
from hyperprompt_jax import optimizers
from hyperprompt_jax import partitioning
from hyperprompt_jax import task_params
from hyperprompt_jax import trainer as trainer_lib
from hyperprompt_jax.tasks import task_ids
# pylint: enable=g-import-not-at-top,g-bad-import-order

log = logging.getLogger('hyperprompt_jax.import_task_params')


def import_task_params(model: network.Transformer, checkpoint_path: str,
                       output_dir: str, task_params_path: Optional[str] = None,
                       growth: Optional[task_params.Growth] = None,
                       seed: int = 0) -> str:
  """Writes `output_dir/checkpoint_0` (module docstring); returns its path.

  Raises:
    task_params.TaskParamsError: an artifact that does not fit.
    ValueError: an output that exists, a checkpoint of another model.
  """
  target = os.path.join(output_dir, 'checkpoint_0')
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if tf.io.gfile.exists(target):
    raise ValueError(f'{target} exists: choose a new --output_dir.')
  task_list = task_ids.run_task_list()
  task_ids.check_num_tasks(model.config.num_tasks, task_list)
  # The trainer's restore: one code path with INITIAL_CHECKPOINT_PATH.
  trainer = trainer_lib.Trainer(
      model, optimizers.make_optimizer(), partitioning.create_mesh(),
      {'inputs': 8, 'targets': 4}, seed=seed)
  params, fresh, rows = trainer.params_from_t5x(
      checkpoint_path, task_params_path, growth, task_list)
  if fresh:
    raise ValueError(
        f'{checkpoint_path} lacks {len(fresh)} task-conditioned parameters '
        f'({fresh[:3]} ...): give --task_params, or a checkpoint of this '
        'method.')
  manager = ocp.CheckpointManager(
      os.path.abspath(output_dir) if '://' not in output_dir else output_dir,
      options=ocp.CheckpointManagerOptions(step_prefix='checkpoint'),
      item_names=('state',))
  # t5x's layout: the parameters under 'target', the step under 'state'.
  manager.save(0, args=ocp.args.Composite(state=ocp.args.PyTreeSave(
      {'target': jax.device_get(params),
       'state': {'step': np.int32(0)}})))
  manager.wait_until_finished()
  manager.close()
  log.info('Wrote %s: the backbone of %s, the task parameters of %s, %d task '
           'rows (%s trained%s).', target, checkpoint_path,
           task_params_path or checkpoint_path, model.config.num_tasks, rows,
           f', {model.config.num_tasks - rows} set by '
           f'{(growth or task_params.Growth()).rule!r}'
           if rows < model.config.num_tasks else '')
  return target


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = gin_utils.parse_command_line(_PROG, __doc__, argv, logger=log,
                                      add_flags=_add_flags)
  model = gin.get_configurable(network.Transformer)()
  import_task_params(
      model, args.checkpoint_path, args.output_dir, args.task_params,
      task_params.Growth(args.new_task_init, args.new_task_source), args.seed)
  return 0


if __name__ == '__main__':
  gin_utils.run(main)
