#!/usr/bin/env python3
r"""Runs a train / eval / infer job on this machine.

  python launch/local.py [--runner={builtin,t5x}] [--mode={train,eval,infer}] \
    [--gin_file=FILE ...] [--gin KEY=VALUE ...] [--model_dir=DIR] \
    [--checkpoint_path=DIR] [--output_dir=DIR] [--tfds_data_dir=DIR] \
    [--python=PYTHON] [--dry-run]

With no --gin_file the built-in runner runs the offline quickstart:
runs/quickstart.gin (train), runs/quickstart_eval.gin (eval) or
runs/quickstart_infer.gin (infer), whose paths default to
/tmp/hyperprompt_quickstart:

  python launch/local.py                  # train the quickstart
  python launch/local.py --mode=eval      # evaluate its checkpoints

The job is `PYTHON -m hyperprompt_jax.MODE` (or `-m t5x.MODE`), PYTHON being
the interpreter running this script unless --python says otherwise; its output
streams here and the script exits with its exit code. `--dry-run` prints the
command and runs nothing.
"""

import os
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # pylint: disable=g-import-not-at-top

QUICKSTART_GIN = {
    'train': 'runs/quickstart.gin',
    'eval': 'runs/quickstart_eval.gin',
    'infer': 'runs/quickstart_infer.gin',
    'leaderboard': 'runs/quickstart_leaderboard.gin',
    'probe': 'runs/quickstart_probe.gin',
}


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = common.make_parser('local.py', __doc__)
  parser.add_argument('--python', default=sys.executable,
                      help='the interpreter with the package installed '
                      '(default: this one, %(default)s)')
  common.add_run_flags(parser, default_runner='builtin')
  args = common.parse_args(parser, argv)

  if not args.gin_file:
    if args.runner == 't5x':
      # The quickstart files configure the built-in runner's loop.
      parser.error('--runner=t5x needs --gin_file, a t5x run file (e.g. '
                   '--gin_file=t5x/hyperprompt_global_glue.gin); the '
                   'quickstart files are for the built-in runner')
    args.gin_file = [QUICKSTART_GIN[args.mode]]
  # The quickstart files set every path; other run files fail in gin when one
  # is missing.
  common.check_run_args(parser, args, require_dirs=False, gcs_only=False)
  return common.execute([common.run_command(args, args.python)], args.dry_run)


if __name__ == '__main__':
  sys.exit(main())
