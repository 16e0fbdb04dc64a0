#!/usr/bin/env python3
r"""Runs a train / eval / infer job on one GPU host, here or over ssh.

  python launch/gpu.py [--host=USER@MACHINE] [--install [--package=SPEC]] \
    [--runner={builtin,t5x}] [--mode={train,eval,infer}] \
    --gin_file=FILE [--gin_file=...] [--gin KEY=VALUE ...] \
    [--model_dir=DIR] [--checkpoint_path=DIR --output_dir=DIR] \
    [--tfds_data_dir=DIR] [--mem_fraction=0.9] [--python=python3] [--dry-run]

For example, HyperPrompt-Global on GLUE with the built-in runner:

  python launch/gpu.py --host=me@gpu-box --install \
    --gin_file=runs/hyperprompt_glue.gin --model_dir=/data/hyperprompt/glue \
    --gin TFDS_DATA_DIR="'/data/tfds'" --dry-run

Steps: `--install` pip-installs the package (`--package`, default
'hyperprompt_jax[gpu]', CUDA 12; for --runner=t5x also t5x, airio and
jestimator cloned beside it, installed with --no-deps), then the job runs:
python3 -m hyperprompt_jax.MODE (default) or python3 -m t5x.MODE with the gin
flags. With --host each step is one `ssh HOST LINE` (relative paths are then
the remote home's). `--mem_fraction` sets XLA_PYTHON_CLIENT_MEM_FRACTION, the
share of GPU memory JAX preallocates (JAX's default: 0.75). `--dry-run` prints
the commands, one per line, and runs nothing; otherwise they run in order and
the script exits with the first failure's code.
"""

import argparse
import os
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # pylint: disable=g-import-not-at-top


def commands(args: argparse.Namespace) -> list[common.Command]:
  """The commands, in order: install, run (each wrapped in ssh with --host)."""
  steps = []
  if args.install:
    steps.append(common.install_commands(args.package, args.runner,
                                         args.python))
  run = common.run_command(args, args.python)
  if args.mem_fraction is not None:
    run = ['env', f'XLA_PYTHON_CLIENT_MEM_FRACTION={args.mem_fraction}'] + run
  steps.append([run])
  if args.host:
    return [['ssh', args.host, common.remote_script(step)] for step in steps]
  return [command for step in steps for command in step]


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog='python launch/gpu.py', description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
  parser.add_argument('--host', help='USER@MACHINE to run on over ssh '
                      '(default: this machine)')
  parser.add_argument('--install', action='store_true',
                      help='install the package (and t5x for --runner=t5x) '
                      'first')
  parser.add_argument('--package', default='hyperprompt_jax[gpu]',
                      help="pip requirement for --install; default: "
                      "'%(default)s'")
  parser.add_argument('--python', default='python3',
                      help="the GPU host's interpreter (Python >= 3.11), e.g. "
                      "'~/venv/bin/python'; default: %(default)s")
  parser.add_argument('--mem_fraction', type=float,
                      help='XLA_PYTHON_CLIENT_MEM_FRACTION, e.g. 0.9 (default: '
                      "unset, JAX's 0.75)")
  common.add_run_flags(parser, default_runner='builtin')
  args = common.parse_args(parser, argv)

  if args.mem_fraction is not None and not 0 < args.mem_fraction <= 1:
    parser.error(f'--mem_fraction={args.mem_fraction} must be in (0, 1], '
                 'e.g. 0.9')
  common.check_run_args(parser, args, require_dirs=True, gcs_only=False,
                        remote=bool(args.host))
  return common.execute(commands(args), args.dry_run)


if __name__ == '__main__':
  sys.exit(main())
