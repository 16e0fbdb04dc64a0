#!/usr/bin/env python3
r"""Runs a train / eval / infer job on every worker of a TPU VM pod.

  python launch/tpu_pod.py --tpu=NAME --zone=ZONE [--project=PROJECT] \
    [--accelerator=v4-32 --create [--runtime_version=VERSION]] \
    [--install [--package=SPEC]] [--runner={t5x,builtin}] \
    [--mode={train,eval,infer}] --gin_file=FILE [--gin_file=...] \
    [--gin KEY=VALUE ...] [--model_dir=gs://...] \
    [--checkpoint_path=gs://... --output_dir=gs://...] \
    [--tfds_data_dir=DIR] [--python=python3] [--dry-run]

For example, HyperPrompt-Global on GLUE with t5x on a v4-32:

  python launch/tpu_pod.py --tpu=hp-v4-32 --zone=us-central2-b \
    --accelerator=v4-32 --create --install \
    --gin_file=t5x/hyperprompt_global_glue.gin \
    --model_dir=gs://my-bucket/hyperprompt/glue --dry-run

Each step is one gcloud command, run from this machine:
  --create   gcloud compute tpus tpu-vm create NAME --accelerator-type=...
  --install  on all workers: pip install the package (`--package`, default
             'hyperprompt_jax[tpu]'); for --runner=t5x also t5x, airio and
             jestimator cloned beside it and installed with --no-deps
  (always)   on all workers: python3 -m t5x.MODE (default) or
             python3 -m hyperprompt_jax.MODE --multiprocess with the gin
             flags (every worker joins one job).
Paths must be gs:// (the workers do not share a disk). `--dry-run` prints the
commands, one per line, and runs nothing; otherwise they run in order and the
script exits with the first failure's code.
"""

import argparse
import os
import re
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # pylint: disable=g-import-not-at-top

# gcloud's accelerator types: generation, optional variant, TensorCore or chip
# count (v4-32, v5litepod-16, v5p-128, v6e-8).
_ACCELERATOR = re.compile(r'v(\d+)([a-z]*)-(\d+)')

# Google's recommended TPU VM software version per generation, for --create.
_RUNTIME_VERSIONS = {
    'v6e': 'v2-alpha-tpuv6e',
    'v5p': 'v2-alpha-tpuv5',
    'v5litepod': 'v2-alpha-tpuv5-lite',
    'v5e': 'v2-alpha-tpuv5-lite',
}
_DEFAULT_RUNTIME_VERSION = 'tpu-ubuntu2204-base'  # v4 and older


def runtime_version(accelerator: str) -> str:
  generation = accelerator.rsplit('-', 1)[0]
  return _RUNTIME_VERSIONS.get(generation, _DEFAULT_RUNTIME_VERSION)


def commands(args: argparse.Namespace) -> list[common.Command]:
  """The gcloud commands, in order: create, install, run."""
  where = [f'--zone={args.zone}']
  if args.project:
    where.append(f'--project={args.project}')
  result = []
  if args.create:
    version = args.runtime_version or runtime_version(args.accelerator)
    result.append(
        ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', args.tpu] + where +
        [f'--accelerator-type={args.accelerator}', f'--version={version}'])
  # One ssh per step: every worker runs the same line at the same time.
  ssh = ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', args.tpu] + where + [
      '--worker=all']
  if args.install:
    script = common.remote_script(
        common.install_commands(args.package, args.runner, args.python))
    result.append(ssh + [f'--command={script}'])
  run = common.run_command(args, args.python)
  if args.runner == 'builtin':
    # Every worker joins the others (JAX finds them from the TPU metadata):
    # one job, the data laid out by the mesh, process 0 writing.
    run.append('--multiprocess')
  run = common.render(run)
  result.append(ssh + [f'--command={run}'])
  return result


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = common.make_parser('tpu_pod.py', __doc__)
  parser.add_argument('--tpu', required=True, help='the TPU VM (pod) name')
  parser.add_argument('--zone', required=True, help='e.g. us-central2-b')
  parser.add_argument('--project', help='Google Cloud project (default: '
                      "gcloud's)")
  parser.add_argument('--accelerator',
                      help='accelerator type, e.g. v4-32, v5litepod-16, '
                      'v5p-128, v6e-8 (needed by --create)')
  parser.add_argument('--create', action='store_true',
                      help='create the TPU VM first')
  parser.add_argument('--runtime_version',
                      help='TPU software version for --create (default: '
                      "Google's choice for the generation: "
                      f'{_DEFAULT_RUNTIME_VERSION} for v4, '
                      'v2-alpha-tpuv5-lite, v2-alpha-tpuv5, v2-alpha-tpuv6e)')
  common.add_install_flags(parser, 'hyperprompt_jax[tpu]', 'every worker',
                           ' (a git+https URL, a wheel on gs://...)')
  common.add_run_flags(parser, default_runner='t5x')
  args = common.parse_args(parser, argv)

  if args.accelerator and not _ACCELERATOR.fullmatch(args.accelerator):
    parser.error(f'--accelerator={args.accelerator} is not a TPU accelerator '
                 'type: write it as gcloud does, GENERATION-CORES, e.g. v4-32, '
                 'v5litepod-16, v5p-128, v6e-8')
  if args.create and not args.accelerator:
    parser.error('--create needs --accelerator, e.g. --accelerator=v4-32')
  if args.runtime_version and not args.create:
    parser.error('--runtime_version is used by --create only')
  common.check_run_args(parser, args, require_dirs=True, gcs_only=True,
                        remote=True)
  if args.accelerator:
    # On stderr: stdout holds only the commands.
    print(f'# {args.tpu}: {args.accelerator} in {args.zone}', file=sys.stderr)
  return common.execute(commands(args), args.dry_run)


if __name__ == '__main__':
  sys.exit(main())
