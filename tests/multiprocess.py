"""Real JAX processes on localhost for the multi-host tests.

Each process is a command-line tool started as a host of a cluster would
start it (`--coordinator_address`, `--num_processes`, `--process_id`), with
its own CPU devices (`--xla_force_host_platform_device_count`); JAX's CPU
collectives between them go over gloo on loopback.
"""

import dataclasses
import fcntl
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence


def made_once(basetemp: pathlib.Path, name: str,
              make: Callable[[pathlib.Path], None]) -> pathlib.Path:
  """A folder `name` made by `make` once for the whole test session: under
  pytest-xdist in `basetemp`'s parent, which the workers of one session
  share; the first to get here makes it while the others wait (the file
  lock), then reuse it."""
  shared = (basetemp.parent if os.environ.get('PYTEST_XDIST_WORKER')
            else basetemp)
  root = shared / name
  with open(shared / f'{name}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    done = root / '.made'
    if not done.exists():
      shutil.rmtree(root, ignore_errors=True)
      root.mkdir(parents=True)
      make(root)
      done.touch()
  return root


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def env(devices: int) -> dict[str, str]:
  return dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=xla_flags(devices))


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for `devices` CPU devices, with the test session's other
  flags (conftest.FAST_COMPILE)."""
  others = [f for f in os.environ.get('XLA_FLAGS', '').split()
            if not f.startswith('--xla_force_host_platform_device_count')]
  return ' '.join([f'--xla_force_host_platform_device_count={devices}',
                   *others])


@dataclasses.dataclass
class Process:
  """One started process; its output goes to `log` (a file: a pipe nobody
  reads would block it)."""
  popen: subprocess.Popen
  log: pathlib.Path

  def output(self) -> str:
    return self.log.read_text(errors='replace')


def start(module: str, args: Sequence[str], log_dir: pathlib.Path,
          num_processes: int = 2, devices: int = 2, name: str = 'run',
          ) -> list[Process]:
  """Starts `python -m module args` as `num_processes` processes with
  `devices` CPU devices each (one process: no distributed flags)."""
  port = free_port()
  log_dir.mkdir(parents=True, exist_ok=True)
  procs = []
  for i in range(num_processes):
    flags = [] if num_processes == 1 else [
        f'--coordinator_address=127.0.0.1:{port}',
        f'--num_processes={num_processes}', f'--process_id={i}']
    log = log_dir / f'{name}-{i}.log'
    with open(log, 'w') as out:
      popen = subprocess.Popen(
          [sys.executable, '-m', module, *args, *flags], env=env(devices),
          stdout=out, stderr=subprocess.STDOUT, text=True)
    procs.append(Process(popen, log))
  return procs


def wait(procs: Sequence[Process], timeout: float) -> list[int]:
  """Every process's exit status; kills them all past `timeout` seconds and
  fails, showing their output."""
  deadline = time.time() + timeout
  for p in procs:
    try:
      p.popen.wait(max(deadline - time.time(), 0.1))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.popen.kill()
      raise AssertionError(
          f'still running after {timeout} s:\n' + outputs(procs)) from None
  return [p.popen.returncode for p in procs]


def run(module: str, args: Sequence[str], log_dir: pathlib.Path,
        timeout: float = 240, expect: Optional[int] = 0,
        **kwargs) -> list[Process]:
  """`start`, then `wait`; with `expect`, every process must exit with it."""
  procs = start(module, args, log_dir, **kwargs)
  codes = wait(procs, timeout)
  if expect is not None and any(c != expect for c in codes):
    raise AssertionError(f'exit statuses {codes}, expected {expect}:\n'
                         + outputs(procs))
  return procs


def outputs(procs: Sequence[Process], tail: int = 4000) -> str:
  return '\n'.join(f'--- process {i} ---\n{p.output()[-tail:]}'
                   for i, p in enumerate(procs))


# -- the reference: one process fed the global batches of several ------------

REFERENCE_USAGE = """python tests/multiprocess.py OUT.npz SHARDS STEPS [gin flags]

Trains the gin-configured model (runs/train.gin's network, optimizer, seed)
in ONE process on all its devices, each step fed the global batch a run of
SHARDS data shards would assemble (shard 0's rows, then shard 1's, ...),
and writes the parameters after STEPS steps to OUT.npz."""


def reference(out: str, shards: int, steps: int, gin_args: Sequence[str]
              ) -> None:
  # pylint: disable=g-import-not-at-top
  import gin
  import numpy as np
  from flax import traverse_util
  from hyperprompt_jax.common import gin_utils
  from hyperprompt_jax.common import batches
  from hyperprompt_jax.common import input_pipeline
  from hyperprompt_jax.model import network
  from hyperprompt_jax.training import optimizers
  from hyperprompt_jax.common import partitioning
  from hyperprompt_jax.training import trainer as trainer_lib
  from hyperprompt_jax.runner import training_loop  # pylint: disable=unused-import
  # pylint: enable=g-import-not-at-top
  gin_utils.parse_command_line('reference', REFERENCE_USAGE, gin_args)
  macro = lambda name: gin.query_parameter(f'{name}/macro.value')  # pylint: disable=unnecessary-lambda-assignment
  model = gin.get_configurable(network.Transformer)()
  optimizer = gin.get_configurable(optimizers.make_optimizer)()
  lengths = macro('TASK_FEATURE_LENGTHS')
  batch_size, seed = macro('BATCH_SIZE'), macro('SEED')
  mesh = partitioning.create_mesh(-1, macro('MESH_MODEL'))
  trainer = trainer_lib.Trainer(model, optimizer, mesh, lengths, seed=seed)
  state = trainer.new_state(trainer.fresh_params())
  iterators = [iter(input_pipeline.train_dataset(
      macro('MIXTURE_OR_TASK_NAME'), lengths, batch_size, seed=seed,
      rows=batches.RowFormat(packed=macro('PACK')), shard_index=i,
      num_shards=shards))
               for i in range(shards)]
  for _ in range(steps):
    parts = [input_pipeline.as_numpy(next(it)) for it in iterators]
    batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    state, _ = trainer.step(state, trainer.global_batch(batch))
  flat = traverse_util.flatten_dict(state['params'], sep='/')
  np.savez(out, **{k: np.asarray(v) for k, v in flat.items()})


if __name__ == '__main__':
  if len(sys.argv) < 4:
    sys.exit(REFERENCE_USAGE)
  reference(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
