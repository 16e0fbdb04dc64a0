r"""Exporting a checkpoint's task parameters: `python -m
hyperprompt_jax.export_task_params`.

Writes the task-conditioned parameters of one `checkpoint_<step>` (the
built-in runner's, or t5x's in either layout) as one small self-describing
file (`task_params`: the arrays, the methods, the model settings, the task
list in id order, the number of tasks, and a fingerprint of the backbone
they were trained with). The model comes from gin, as for evaluation: the
run's model, variant and task files (a run file that includes them):

  python -m hyperprompt_jax.export_task_params \
    --gin_file=runs/quickstart_model.gin \
    --checkpoint_path=/tmp/hyperprompt_quickstart/checkpoint_1300 \
    --output=/tmp/quickstart_task_params.npz

Import it by starting a run from the same backbone checkpoint with
`--gin.INITIAL_CHECKPOINT_PATH=... --gin.TASK_PARAMS_PATH=...`
(`runs/train.gin`); the method, the model settings, the task ids and the
backbone are checked, each difference named.
"""

from typing import Optional, Sequence

from hyperprompt_jax.common import gin_utils


def add_flags(parser) -> None:
  parser.add_argument('--checkpoint_path',
                      help='the checkpoint_<step> folder to export from')
  parser.add_argument('--output',
                      help='the artifact to write (.npz; local or gs://)')
  parser.add_argument('--sizes', action='store_true',
                      help="print the gin model's artifact and checkpoint "
                      'sizes (float32, from shapes; nothing is read or '
                      'written) instead of exporting')


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = gin_utils.command_flags(
      'python -m hyperprompt_jax.export_task_params', __doc__, argv,
      add_flags=add_flags, tensorflow=True)
  from hyperprompt_jax.checkpointing import task_params_export  # pylint: disable=g-import-not-at-top
  return task_params_export.run(args)


if __name__ == '__main__':
  gin_utils.run(main)
