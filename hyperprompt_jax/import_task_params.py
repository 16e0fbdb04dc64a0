r"""Placing task parameters into a model: `python -m
hyperprompt_jax.import_task_params`.

Writes one checkpoint with the parameters of a model whose task axis may be
larger than the source's (`NUM_TASKS` raised for tasks added with
`tasks.add_task`):

- the backbone of `--checkpoint_path` (either runner, either layout);
- the task parameters of `--task_params` (an `export_task_params`
  artifact; its method, model settings, task ids and backbone are checked),
  or else the checkpoint's own;
- the parameters of the task ids the source was not trained on, by
  `--new_task_init` ('mean', 'copy' with `--new_task_source`, 'fresh';
  `task_params.grow`).

The output is `<output_dir>/checkpoint_0/` in t5x's orbax layout
(`state/` = `{target: params, state: {step: 0}}`, no optimizer state), so
both runners start from it as INITIAL_CHECKPOINT_PATH: t5x through
`t5x/add_task.gin` (its restore keeps the task parameters), the built-in
runner directly (which can also grow and import by itself: runs/train.gin's
TASK_PARAMS_PATH, NEW_TASK_INIT); `eval` and `infer` read it too.

  python -m hyperprompt_jax.import_task_params \
    --gin_file=runs/quickstart_model.gin --gin.NUM_TASKS=17 \
    --checkpoint_path=/tmp/hyperprompt_quickstart/checkpoint_1300 \
    --output_dir=/tmp/quickstart_17_tasks
"""

from typing import Optional, Sequence

from hyperprompt_jax.common import gin_utils


def add_flags(parser) -> None:
  parser.add_argument('--checkpoint_path', required=True,
                      help='the backbone checkpoint_<step> (and, without '
                      '--task_params, the task parameters)')
  parser.add_argument('--task_params', help='an export_task_params artifact')
  parser.add_argument('--output_dir', required=True,
                      help='where checkpoint_0 is written')
  parser.add_argument('--new_task_init', default='mean',
                      help="the parameters of new task ids: 'mean' "
                      "(default), 'copy' or 'fresh'")
  parser.add_argument('--new_task_source',
                      help="the task whose parameters 'copy' copies")
  parser.add_argument('--seed', type=int, default=0,
                      help="the initialisation of 'fresh' parameters")


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = gin_utils.command_flags(
      'python -m hyperprompt_jax.import_task_params', __doc__, argv,
      add_flags=add_flags, tensorflow=True)
  from hyperprompt_jax.checkpointing import task_params_import  # pylint: disable=g-import-not-at-top
  return task_params_import.run(args)


if __name__ == '__main__':
  gin_utils.run(main)
