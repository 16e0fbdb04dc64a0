#!/usr/bin/env python3
r"""Runs a train / eval / infer job on GPU hosts: here, over ssh, or on
several hosts at once (one process per host), without a scheduler.

  python launch/gpu.py [--host=USER@MACHINE ...] \
    [--install [--source=checkout|git+URL@COMMIT | --package=SPEC]] \
    [--runner={builtin,t5x}] [--mode={train,eval,infer}] \
    --gin_file=FILE [--gin_file=...] [--gin KEY=VALUE ...] \
    [--model_dir=DIR] [--checkpoint_path=DIR --output_dir=DIR] \
    [--tfds_data_dir=DIR] [--mem_fraction=0.9] [--python=PYTHON] \
    [--num_microbatches=N] [--remat_policy={none,minimal,full}] \
    [--coordinator_address=HOST:PORT] [--dry-run]

For example, HyperPrompt-Global on GLUE with the built-in runner:

  python launch/gpu.py --host=me@gpu-box --install \
    --gin_file=runs/hyperprompt_glue.gin --model_dir=/data/hyperprompt/glue \
    --gin TFDS_DATA_DIR="'/data/tfds'" --dry-run

Steps: the host scripts are written into a folder here and, with --host,
copied to each host's ~/hyperprompt_launch (`scp -r`). `--install` runs
install.sh, the same as launch/tpu_pod.py's: a Python 3.11 venv
(~/hyperprompt_venv, made with uv, unless --python), this checkout's
committed HEAD (`git archive`; or --source=git+URL@COMMIT, or --package=SPEC)
pip-installed with its [gpu] extra (CUDA 12), and for --runner=t5x t5x,
airio and jestimator at the commits the project tests, with --no-deps. Then
the job runs, MODE-STAMP.sh: PYTHON -m hyperprompt_jax.MODE (default) or
PYTHON -m t5x.MODE with the gin flags, its output shown here and written to
~/hyperprompt_logs/MODE-STAMP.log, copied to <model_dir or output_dir>/logs/
when it ends. With --host each step is one `ssh HOST LINE` (relative paths
are then the remote home's). With several --host, the job runs as one
process per host, all started at once: the first host is process 0 and the
coordinator (`--coordinator_address`, default its machine name, port 12345),
each command gets `--coordinator_address`, `--num_processes`, `--process_id`
(t5x: `--multiprocess_gpu`, `--process_count`, `--process_index`), each log
is MODE-STAMP-processI.log, and --model_dir / --output_dir must be storage
every host sees (NFS, gs://). For example, 2 hosts:

  python launch/gpu.py --host=me@gpu-0 --host=me@gpu-1 \
    --gin_file=runs/hyperprompt_glue.gin --model_dir=/nfs/hyperprompt/glue

`--num_microbatches` / `--remat_policy` set NUM_MICROBATCHES /
REMAT_POLICY (training, either runner): the papers' batch of 128 on GPUs
whose memory does not hold its activations (docs/operations.md, Training).
`--mem_fraction` sets XLA_PYTHON_CLIENT_MEM_FRACTION, the
share of GPU memory JAX preallocates (JAX's default: 0.75). `--dry-run` prints
the commands and every line of the host scripts (as heredocs), and runs
nothing; otherwise they run in order and the script exits with the first
failure's code.
"""

import argparse
import os
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # pylint: disable=g-import-not-at-top


COORDINATOR_PORT = 12345
REMAT_POLICIES = ('none', 'minimal', 'full')  # network.REMAT_POLICIES


def process_flags(runner: str, coordinator: str, count: int,
                  index: int) -> list[str]:
  """The flags that make a command process `index` of `count`."""
  if runner == 't5x':
    return ['--multiprocess_gpu', f'--coordinator_address={coordinator}',
            f'--process_count={count}', f'--process_index={index}']
  return [f'--coordinator_address={coordinator}', f'--num_processes={count}',
          f'--process_id={index}']


def commands(args: argparse.Namespace, source: Optional[common.Source],
             stamp: str) -> list:
  """In order: write the host scripts here (and archive the checkout); per
  host (here without --host), copy them there and install; run (on several
  hosts, one process each, started together)."""
  hosts = args.host or []
  stage = common.stage_dir('gpu')
  # Here the scripts run from the stage; on a host, from HOST_DIR.
  shipped = common.HOST_DIR if hosts else stage
  result = common.stage_commands(stage, source)
  if source is not None:
    result.append(common.File(
        os.path.join(stage, 'install.sh'), common.install_script(
            source, args.runner, args.python, 'gpu',
            f'{shipped}/{common.ARCHIVE}')))
  job = common.run_command(args, args.python or common.VENV_PYTHON)
  if args.num_microbatches is not None:
    job.append(f'--gin.NUM_MICROBATCHES={args.num_microbatches}')
  if args.remat_policy is not None:
    job.append(common.gin_string('REMAT_POLICY', args.remat_policy))
  if args.mem_fraction is not None:
    job = ['env', f'XLA_PYTHON_CLIENT_MEM_FRACTION={args.mem_fraction}'] + job
  runs = []  # (script name, job): one per process
  if len(hosts) < 2:
    runs.append((job_name(args, stamp, None), job))
  else:
    coordinator = (args.coordinator_address or
                   f'{hosts[0].split("@")[-1]}:{COORDINATOR_PORT}')
    runs += [(job_name(args, stamp, i), job + process_flags(
        args.runner, coordinator, len(hosts), i)) for i in range(len(hosts))]
  for name, words in runs:
    result.append(common.File(os.path.join(stage, f'{name}.sh'),
                              common.job_script(
                                  words, log=f'{common.LOG_DIR}/{name}.log',
                                  copy_to=logs_dir(args), env=args.env)))
  if not hosts:
    if source is not None:
      result.append(['bash', f'{stage}/install.sh'])
    return result + [['bash', f'{stage}/{runs[0][0]}.sh']]
  for host in hosts:
    # Lands as HOST_DIR (scp -r into the home folder).
    result.append(['scp', '-r', stage, f'{host}:'])
    if source is not None:
      result.append(['ssh', host, f'bash {common.HOST_DIR}/install.sh'])
  ssh = [['ssh', host, f'bash {common.HOST_DIR}/{name}.sh']
         for host, (name, _) in zip(hosts, runs)]
  return result + (ssh if len(hosts) == 1 else [common.Together(ssh)])


def job_name(args: argparse.Namespace, stamp: str,
             process: Optional[int]) -> str:
  """MODE-STAMP[-processI]: the name of a run script and of its log."""
  suffix = '' if process is None else f'-process{process}'
  return f'{args.mode}-{stamp}{suffix}'


def logs_dir(args: argparse.Namespace) -> str:
  """Where each host's log is copied: under the run's output folder."""
  return (args.model_dir or args.output_dir).rstrip('/') + '/logs'


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = common.make_parser('gpu.py', __doc__)
  parser.add_argument('--host', action='append',
                      help='USER@MACHINE to run on over ssh (default: this '
                      'machine); repeat it to run one process on each host')
  parser.add_argument('--coordinator_address',
                      help='with several --host: HOST:PORT of process 0, '
                      'reachable from every host (default: the first '
                      f'host\'s machine, port {COORDINATOR_PORT})')
  common.add_install_flags(parser, 'gpu', 'each GPU host')
  parser.add_argument('--mem_fraction', type=float,
                      help='XLA_PYTHON_CLIENT_MEM_FRACTION, e.g. 0.9 (default: '
                      "unset, JAX's 0.75)")
  parser.add_argument('--num_microbatches', type=int,
                      help='training: take each batch in N parts, one '
                      'update (gin NUM_MICROBATCHES, both runners)')
  parser.add_argument('--remat_policy', choices=REMAT_POLICIES,
                      help='training: recompute layer activations in the '
                      'backward pass (gin REMAT_POLICY)')
  common.add_run_flags(parser, default_runner='builtin')
  args = common.parse_args(parser, argv)

  if args.mem_fraction is not None and not 0 < args.mem_fraction <= 1:
    parser.error(f'--mem_fraction={args.mem_fraction} must be in (0, 1], '
                 'e.g. 0.9')
  if args.mode != 'train' and (args.num_microbatches is not None or
                               args.remat_policy is not None):
    parser.error('--num_microbatches and --remat_policy are training '
                 f'settings (--mode={args.mode})')
  if args.num_microbatches is not None and args.num_microbatches < 1:
    parser.error(f'--num_microbatches={args.num_microbatches} must be >= 1')
  hosts = args.host or []
  if len(set(hosts)) < len(hosts):
    parser.error(f'--host names a host twice ({hosts}): one process per host')
  if args.coordinator_address and len(hosts) < 2:
    parser.error('--coordinator_address is for a job on several hosts: '
                 'repeat --host')
  common.check_run_args(parser, args, require_dirs=True, gcs_only=False,
                        remote=bool(args.host))
  source = common.resolve_source(parser, args)
  stamp = common.stamp()
  print(f'# The job\'s output: here, and in {common.LOG_DIR}/'
        f'{job_name(args, stamp, None)}'
        f'{"-processI" if len(args.host or []) > 1 else ""}.log on '
        f'{"each host" if args.host else "this machine"}, copied to '
        f'{logs_dir(args)}/ when the job ends.', file=sys.stderr)
  return common.execute(commands(args, source, stamp), args.dry_run)


if __name__ == '__main__':
  sys.exit(main())
