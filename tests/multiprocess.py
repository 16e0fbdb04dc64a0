"""Real JAX processes on localhost for the multi-host tests.

Each process is a command-line tool started as a host of a cluster would
start it (`--coordinator_address`, `--num_processes`, `--process_id`), with
its own CPU devices (`--xla_force_host_platform_device_count`); JAX's CPU
collectives between them go over gloo on loopback.
"""

import dataclasses
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def env(devices: int) -> dict[str, str]:
  return dict(os.environ, JAX_PLATFORMS='cpu',
              XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}')


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
