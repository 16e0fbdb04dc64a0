"""Real JAX processes on localhost for the multi-host tests.

Each process is a command-line tool started as a host of a cluster would
start it (`--coordinator_address`, `--num_processes`, `--process_id`), with
its own CPU devices (`--xla_force_host_platform_device_count`); JAX's CPU
collectives between them go over gloo on loopback.

A process start costs seconds (TensorFlow's import, the input pipeline's
tracing), so a run that several tests read may be a chain (`start_chain`):
processes started as a cluster starts them for the first command, which
then run the next commands' `main` in the same processes, still joined.
"""

import dataclasses
import fcntl
import importlib
import json
import os
import pathlib
import re
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
          script: bool = False) -> list[Process]:
  """Starts `python -m module args` (with `script`: `python -u module
  args`, unbuffered) as `num_processes` processes with `devices` CPU
  devices each (one process: no distributed flags)."""
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
          [sys.executable, *(['-u'] if script else ['-m']), module, *args,
           *flags], env=env(devices),
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


# -- several commands in the same processes ---------------------------------

CHAIN_USAGE = """python tests/multiprocess.py chain PLAN.json [distributed flags]

Runs the plan's commands one after the other in this process: each a list
[module, args, expected exit status]; the distributed flags go to the first
command only, a command module's (it joins the cluster, as a host starts
it; the next ones run in the joined processes). Module 'reference' is
`reference` above; module 'wait' waits until the logs named by its args
hold their command's end (`PATH:INDEX`, exit 0). Command i's output lies
between the lines `[chain] i start MODULE` and `[chain] i end STATUS
SECONDSs`; a status other than the expected one ends the chain (exit 3)."""


def start_chain(commands: Sequence[tuple[str, Sequence[str], int]],
                log_dir: pathlib.Path, num_processes: int = 2,
                devices: int = 2, name: str = 'chain') -> list[Process]:
  """Starts `num_processes` processes (`start`) that each run `commands`,
  `(module, args, expected exit status)`, in order (CHAIN_USAGE)."""
  log_dir.mkdir(parents=True, exist_ok=True)
  plan = log_dir / f'{name}.plan.json'
  plan.write_text(json.dumps([[m, list(a), e] for m, a, e in commands]))
  return start(__file__, ['chain', str(plan)], log_dir, num_processes,
               devices, name, script=True)


def wait_for(procs: Sequence[Process], index: int
             ) -> tuple[str, list[str], int]:
  """The chain command that waits until every process of `procs` has ended
  its command `index` with exit status 0."""
  return ('wait', [f'{p.log}:{index}' for p in procs], 0)


def command_output(log_text: str, index: int) -> str:
  """The output of chain command `index` in a process's log."""
  start_line = re.search(rf'^\[chain\] {index} start .*$', log_text, re.M)
  assert start_line, f'command {index} did not start:\n{log_text[-3000:]}'
  end = re.compile(rf'^\[chain\] {index} end ', re.M).search(
      log_text, start_line.end())
  assert end, f'command {index} did not end:\n{log_text[-3000:]}'
  return log_text[start_line.end():end.start()]


def _wait_for_logs(logs_and_indices: list[str]) -> int:
  """0 once every `PATH:INDEX` log holds its command's end with exit 0; 1
  as soon as one ended otherwise or its chain stopped, or after 600 s."""
  deadline = time.time() + 600
  for log_and_index in logs_and_indices:
    log, index = log_and_index.rsplit(':', 1)
    ended = re.compile(rf'^\[chain\] {index} end (-?\d+) ', re.M)
    while not (end := ended.search(
        text := pathlib.Path(log).read_text(errors='replace'))):
      if re.search(r'^\[chain\] stop', text, re.M) or time.time() > deadline:
        return 1
      time.sleep(0.2)
    if int(end[1]) != 0:
      return 1
  return 0


def _run_command(module: str, argv: list[str]) -> int:
  """`python -m module argv`'s exit status, run in this process."""
  if module == 'reference':
    reference(argv[0], int(argv[1]), int(argv[2]), argv[3:])
    return 0
  if module == 'wait':
    return _wait_for_logs(argv)
  from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
  main = importlib.import_module(module).main
  saved, sys.argv = sys.argv, [module, *argv]  # what `gin_utils.run` reads
  try:
    gin_utils.run(lambda: main(argv))
  except SystemExit as e:
    return 0 if e.code is None else int(e.code)
  finally:
    sys.argv = saved
  return 0


def _chain(plan: str, flags: list[str]) -> int:
  commands = json.loads(pathlib.Path(plan).read_text())
  for i, (module, args, expected) in enumerate(commands):
    print(f'[chain] {i} start {module}', flush=True)
    began = time.time()
    try:
      status = _run_command(module, list(args) + (flags if i == 0 else []))
    except BaseException:
      print('[chain] stop: an exception (its traceback follows)', flush=True)
      raise
    sys.stdout.flush()
    sys.stderr.flush()
    print(f'[chain] {i} end {status} {time.time() - began:.1f}s', flush=True)
    if status != expected:
      print(f'[chain] stop: exit status {status}, expected {expected}',
            flush=True)
      return 3
  return 0


if __name__ == '__main__':
  if sys.argv[1:2] == ['chain']:
    if len(sys.argv) < 3:
      sys.exit(CHAIN_USAGE)
    sys.exit(_chain(sys.argv[2], sys.argv[3:]))
  if len(sys.argv) < 4:
    sys.exit(REFERENCE_USAGE)
  reference(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
