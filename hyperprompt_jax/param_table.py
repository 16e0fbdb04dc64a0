r"""Parameter table of a gin-configured network, without allocating it.

    python -m hyperprompt_jax.param_table \
        --gin_file=models/t5_1_1_base.gin [--gin_file=variants/...gin] \
        [--gin_file=tasks/glue_super_glue.gin] [--json] \
        [--flops [--input_length=512] [--target_length=32] [--batch_size=1]]

Shapes come from `jax.eval_shape` of the network's `init`, so XXL costs
nothing. Task-conditioned parameters are those under a scope listed in
`hyperprompt_jax.methods.param_groups.TASK_CONDITIONED_SCOPES`; the ratio is
total / backbone, as the papers' "#Params" column. T, the task-id space, is
the task file's `NUM_TASKS` (8 without one; `tasks/glue_super_glue.gin` gives
HyperGrid's 16).

`--flops` adds the forward FLOPs of one example (teacher-forced, at the given
feature lengths) from XLA's cost analysis of the lowered forward pass, again
on abstract shapes. The task-conditioned modules compute their per-task
parts (hyper-prompts, generated adapters) once per forward for all T tasks,
so the count is taken over `--batch_size` examples and divided: at batch 1
that one-off cost lands on one example, at the papers' batch of 128 it is
spread as in training.
"""

import argparse
from typing import Optional, Sequence

from hyperprompt_jax.common import gin_utils


def _positive(flag: str):
  def parse(value: str) -> int:
    if not value.lstrip('-').isdigit() or int(value) <= 0:
      raise argparse.ArgumentTypeError(
          f'--{flag} must be a positive integer, got {value!r}')
    return int(value)
  return parse


def add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('--json', action='store_true',
                      help='print one JSON object instead of the table')
  parser.add_argument('--flops', action='store_true',
                      help='add the forward FLOPs of one example (XLA cost '
                      'analysis of the teacher-forced forward)')
  for flag, default, help_ in (
      ('input_length', 512, 'encoder tokens per example'),
      ('target_length', 32, 'decoder tokens per example'),
      ('batch_size', 1, 'examples per forward: the per-task work of '
       'task-conditioned modules is done once per forward and shared by '
       'the batch (the papers train at 128)')):
    parser.add_argument(f'--{flag}', type=_positive(flag), default=default,
                        help=f'with --flops: {help_} (default {default})')


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = gin_utils.command_flags(
      'python -m hyperprompt_jax.param_table', __doc__, argv,
      add_flags=add_flags)
  from hyperprompt_jax.benchmarks import param_counts  # pylint: disable=g-import-not-at-top
  return param_counts.run(args)


if __name__ == '__main__':
  gin_utils.run(main)
