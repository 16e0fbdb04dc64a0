#!/usr/bin/env python3
r"""Runs a train / eval / infer job on GPU hosts: here, over ssh, or on
several hosts at once (one process per host), without a scheduler.

  python launch/gpu.py [--host=USER@MACHINE ...] [--install [--package=SPEC]] \
    [--runner={builtin,t5x}] [--mode={train,eval,infer}] \
    --gin_file=FILE [--gin_file=...] [--gin KEY=VALUE ...] \
    [--model_dir=DIR] [--checkpoint_path=DIR --output_dir=DIR] \
    [--tfds_data_dir=DIR] [--mem_fraction=0.9] [--python=python3] \
    [--num_microbatches=N] [--remat_policy={none,minimal,full}] \
    [--coordinator_address=HOST:PORT] [--dry-run]

For example, HyperPrompt-Global on GLUE with the built-in runner:

  python launch/gpu.py --host=me@gpu-box --install \
    --gin_file=runs/hyperprompt_glue.gin --model_dir=/data/hyperprompt/glue \
    --gin TFDS_DATA_DIR="'/data/tfds'" --dry-run

Steps: `--install` pip-installs the package (`--package`, default
'hyperprompt_jax[gpu]', CUDA 12; for --runner=t5x also t5x, airio and
jestimator cloned beside it, installed with --no-deps), then the job runs:
python3 -m hyperprompt_jax.MODE (default) or python3 -m t5x.MODE with the gin
flags. With --host each step is one `ssh HOST LINE` (relative paths are then
the remote home's). With several --host, the job runs as one process per
host, all started at once: the first host is process 0 and the coordinator
(`--coordinator_address`, default its machine name, port 12345), each
command gets `--coordinator_address`, `--num_processes`, `--process_id`
(t5x: `--multiprocess_gpu`, `--process_count`, `--process_index`), and
--model_dir / --output_dir must be storage every host sees (NFS, gs://).
For example, 2 hosts:

  python launch/gpu.py --host=me@gpu-0 --host=me@gpu-1 \
    --gin_file=runs/hyperprompt_glue.gin --model_dir=/nfs/hyperprompt/glue

`--num_microbatches` / `--remat_policy` set NUM_MICROBATCHES /
REMAT_POLICY (training, either runner): the papers' batch of 128 on GPUs
whose memory does not hold its activations (docs/operations.md, Training).
`--mem_fraction` sets XLA_PYTHON_CLIENT_MEM_FRACTION, the
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


def commands(args: argparse.Namespace) -> list[common.Command]:
  """The commands, in order: install (on each host), run (wrapped in ssh
  with --host; on several hosts, one process each, started together)."""
  install = (common.install_commands(args.package, args.runner, args.python)
             if args.install else [])
  run = common.run_command(args, args.python)
  if args.num_microbatches is not None:
    run.append(f'--gin.NUM_MICROBATCHES={args.num_microbatches}')
  if args.remat_policy is not None:
    run.append(common.gin_string('REMAT_POLICY', args.remat_policy))
  if args.mem_fraction is not None:
    run = ['env', f'XLA_PYTHON_CLIENT_MEM_FRACTION={args.mem_fraction}'] + run
  hosts = args.host or []
  if not hosts:
    return install + [run]
  out = [['ssh', host, common.remote_script(install)] for host in hosts
         if install]
  if len(hosts) == 1:
    return out + [['ssh', hosts[0], common.remote_script([run])]]
  coordinator = (args.coordinator_address or
                 f'{hosts[0].split("@")[-1]}:{COORDINATOR_PORT}')
  return out + [common.Together(
      ['ssh', host, common.remote_script(
          [run + process_flags(args.runner, coordinator, len(hosts), i)])]
      for i, host in enumerate(hosts))]


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = common.make_parser('gpu.py', __doc__)
  parser.add_argument('--host', action='append',
                      help='USER@MACHINE to run on over ssh (default: this '
                      'machine); repeat it to run one process on each host')
  parser.add_argument('--coordinator_address',
                      help='with several --host: HOST:PORT of process 0, '
                      'reachable from every host (default: the first '
                      f'host\'s machine, port {COORDINATOR_PORT})')
  common.add_install_flags(parser, 'hyperprompt_jax[gpu]', 'each GPU host')
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
  return common.execute(commands(args), args.dry_run)


if __name__ == '__main__':
  sys.exit(main())
