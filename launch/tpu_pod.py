#!/usr/bin/env python3
r"""Runs a train / eval / infer / leaderboard / probe job on every worker of a
TPU VM pod.

  python launch/tpu_pod.py --tpu=NAME --zone=ZONE [--project=PROJECT] \
    [--accelerator=v4-32 --create [--runtime_version=VERSION]] \
    [--install [--source=checkout|git+URL@COMMIT | --package=SPEC]] \
    [--runner={t5x,builtin}] \
    [--mode={train,eval,infer,leaderboard,probe}] \
    --gin_file=FILE [--gin_file=...] [--gin KEY=VALUE ...] \
    [--model_dir=gs://...] [--checkpoint_path=gs://... --output_dir=gs://...] \
    [--tfds_data_dir=gs://...] [--python=PYTHON] [--foreground] [--dry-run]

For example, HyperPrompt-Global on GLUE with t5x on a v4-32:

  python launch/tpu_pod.py --tpu=hp-v4-32 --zone=us-central2-b \
    --accelerator=v4-32 --create --install \
    --gin_file=t5x/hyperprompt_global_glue.gin \
    --model_dir=gs://my-bucket/hyperprompt/glue \
    --tfds_data_dir=gs://my-bucket/tfds --dry-run

The steps, run from this machine:
  --create   gcloud compute tpus tpu-vm create NAME --accelerator-type=...
  (always)   write the worker scripts into a folder here; with --install
             (default --source=checkout) also `git archive` this checkout's
             committed HEAD there (uncommitted changes are not included);
             gcloud compute tpus tpu-vm scp that folder to every worker's
             ~/hyperprompt_launch
  --install  on all workers, install.sh: a Python 3.11 venv
             (~/hyperprompt_venv, made with uv, unless --python), the source
             unpacked (or, --source=git+URL@COMMIT, cloned) in
             ~/hyperprompt_launch/hyperprompt_jax and pip-installed with its
             [tpu] extra (or --package=SPEC instead); for --runner=t5x also
             t5x, airio and jestimator at the commits the project tests
             (common.T5X_REPOS), with --no-deps
  (always)   on all workers, MODE-STAMP.sh: PYTHON -m t5x.MODE (default) or
             PYTHON -m hyperprompt_jax.MODE --multiprocess with the gin flags
             (every worker joins one job), started under nohup in the
             background (--foreground: in the ssh session); its output goes
             to ~/hyperprompt_logs/MODE-STAMP-workerN.log, copied to
             <model_dir or output_dir>/logs/ when the job ends.
Paths must be gs:// (the workers do not share a disk). A run file must be the
runner's: t5x/*.gin for t5x, runs/*.gin for the built-in runner. `--dry-run`
prints the commands and every line of the worker scripts (as heredocs), and
runs nothing; otherwise they run in order and the script exits with the first
failure's code.
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
# gcloud's TPU names (this script also names a local folder after one).
_TPU_NAME = re.compile(r'[a-z]([-a-z0-9]*[a-z0-9])?')

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


# The worker's index, from the TPU metadata (as JAX reads it); the host name
# where the metadata server does not answer.
_WORKER = ('W=$(curl -sf -H Metadata-Flavor:Google http://metadata.google.'
           'internal/computeMetadata/v1/instance/attributes/agent-worker-number'
           ' || hostname)')


def job_name(args: argparse.Namespace, stamp: str) -> str:
  """The name of this launch's run script and logs: MODE-STAMP."""
  return f'{args.mode}-{stamp}'


def log_path(args: argparse.Namespace, stamp: str, worker: str) -> str:
  return f'{common.LOG_DIR}/{job_name(args, stamp)}-worker{worker}.log'


def logs_dir(args: argparse.Namespace) -> str:
  """Where each worker's log is copied: under the run's output folder."""
  return (args.model_dir or args.output_dir).rstrip('/') + '/logs'


def commands(args: argparse.Namespace, source: Optional[common.Source],
             stamp: str) -> list:
  """In order: create, write the worker scripts here (and archive the
  checkout), copy them to every worker, install, run."""
  where = [f'--zone={args.zone}']
  if args.project:
    where.append(f'--project={args.project}')
  result = []
  if args.create:
    version = args.runtime_version or runtime_version(args.accelerator)
    result.append(
        ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', args.tpu] + where +
        [f'--accelerator-type={args.accelerator}', f'--version={version}'])
  stage = common.stage_dir(args.tpu)
  result += common.stage_commands(stage, source)
  # One ssh per step: every worker runs the same script at the same time.
  ssh = ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', args.tpu] + where + [
      '--worker=all']
  steps = []
  if source is not None:
    result.append(common.File(
        os.path.join(stage, 'install.sh'), common.install_script(
            source, args.runner, args.python, 'tpu',
            f'{common.HOST_DIR}/{common.ARCHIVE}')))
    steps.append(ssh + [f'--command=bash {common.HOST_DIR}/install.sh'])
  python = args.python or common.VENV_PYTHON
  job = common.run_command(args, python)
  if args.runner == 'builtin':
    # Every worker joins the others (JAX finds them from the TPU metadata):
    # one job, the data laid out by the mesh, process 0 writing.
    job.append('--multiprocess')
  script = f'{job_name(args, stamp)}.sh'
  result.append(common.File(os.path.join(stage, script), common.job_script(
      job, log=log_path(args, stamp, '$W'), copy_to=logs_dir(args),
      worker=[_WORKER], env=args.env)))
  run = f'bash {common.HOST_DIR}/{script}'
  if not args.foreground:
    # Its own session, hangups ignored: the job outlives the ssh connection.
    run = f'setsid nohup {run} > /dev/null 2>&1 < /dev/null &'
  steps.append(ssh + [f'--command={run}'])
  result.append(['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', '--recurse',
                 stage, f'{args.tpu}:'] + where + ['--worker=all'])
  return result + steps


def follow_hint(args: argparse.Namespace, stamp: str) -> str:
  """How to read the job's output, printed after the commands."""
  where = [f'--zone={args.zone}'] + (
      [f'--project={args.project}'] if args.project else [])
  tail = common.render(
      ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', args.tpu] + where + [
          '--worker=0', f'--command=tail -f {log_path(args, stamp, "0")}'])
  started = ('' if args.foreground else
             'The job runs in the background on every worker. ')
  return (f'# {started}Follow worker 0\'s log (worker N writes '
          '...-workerN.log):\n'
          f'#   {tail}\n'
          f'# Each worker\'s log is copied to {logs_dir(args)}/ when its job '
          'ends.')


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
                      f'{_DEFAULT_RUNTIME_VERSION} for v2 / v3 / v4, '
                      'v2-alpha-tpuv5-lite, v2-alpha-tpuv5, v2-alpha-tpuv6e)')
  common.add_install_flags(parser, 'tpu', 'every worker')
  parser.add_argument('--foreground', action='store_true',
                      help='run the job in the ssh session, its output shown '
                      'here (and logged); it then stops when the session '
                      'does. Default: in the background, under nohup')
  common.add_run_flags(parser, default_runner='t5x')
  args = common.parse_args(parser, argv)

  if not _TPU_NAME.fullmatch(args.tpu):
    parser.error(f'--tpu={args.tpu} is not a TPU name: lower-case letters, '
                 'digits and dashes, starting with a letter, e.g. '
                 '--tpu=hp-v4-32')
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
  if not args.tfds_data_dir and common.reads_prepared_data(args.gin_file):
    parser.error(
        'the run reads the GLUE / SuperGLUE TFDS data, and no '
        '--tfds_data_dir says where: each worker would look in its own empty '
        '~/tensorflow_datasets. Prepare the data once in Cloud Storage '
        '(python -m hyperprompt_jax.prepare_data --gin_file=<the run file> '
        '--data_dir=gs://my-bucket/tfds --prepare) and pass '
        '--tfds_data_dir=gs://my-bucket/tfds')
  source = common.resolve_source(parser, args)
  if args.accelerator:
    # On stderr: stdout holds only the commands.
    print(f'# {args.tpu}: {args.accelerator} in {args.zone}', file=sys.stderr)
  stamp = common.stamp()
  code = common.execute(commands(args, source, stamp), args.dry_run)
  if not code:
    print(follow_hint(args, stamp), file=sys.stderr)
  return code


if __name__ == '__main__':
  sys.exit(main())
