"""One trainer per MODEL_DIR: the `MODEL_DIR/train.lock` file.

Two trainers writing one directory would interleave their checkpoints, so a
run takes the lock before it writes anything and refuses a directory another
live run holds, naming it. A run killed with SIGKILL cannot remove its lock,
so a lock is stale, and taken over, when its holder is gone:

  - same host: its process no longer runs (pid and start time, so a reused
    pid does not count). A live holder is never stale, however old its
    heartbeat: a stopped or debugged trainer resumes later and would
    overwrite a new run's checkpoints;
  - another host: its heartbeat (the file's mtime, touched every
    `HEARTBEAT_S`) is older than `STALE_AFTER_S`.

A holder checks that the lock is still its own before every save
(`check_held`) and stops, without saving, if not. The lock is a plain file
created with `O_CREAT | O_EXCL`, atomic on local and NFS-style file
systems: `fcntl` locks are not honoured across NFS clients, where several
hosts meet.
"""

import datetime
import getpass
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any, Optional

LOCK_FILE = 'train.lock'
HEARTBEAT_S = 10.0
STALE_AFTER_S = 120.0

log = logging.getLogger('hyperprompt_jax.train')


class DirectoryInUseError(ValueError):
  """Another live trainer holds the MODEL_DIR."""


class LockLostError(DirectoryInUseError):
  """This run's lock was taken over: it must not write the directory again."""


def _process_start(pid: int) -> Optional[str]:
  """When process `pid` started (ticks since boot), None without /proc."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      stat = f.read()
  except OSError:
    return None
  # The command name (field 2) may hold spaces; fields after it are plain.
  return stat.rsplit(')', 1)[-1].split()[19]


def _pid_alive(pid: int, start: Optional[str] = None) -> bool:
  """Whether process `pid` runs and, `start` given, is the one started then."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # alive, another user's
    pass
  now = _process_start(pid)
  return start is None or now is None or now == start


def _read(path: str) -> Optional[dict[str, Any]]:
  """The holder's record; None if the lock vanished, `{}` if unreadable."""
  try:
    with open(path) as f:
      text = f.read()
  except FileNotFoundError:
    return None
  try:
    return json.loads(text)
  except ValueError:
    return {}


class RunLock:
  """Holds `model_dir/train.lock` while a run writes the directory.

  Usage: `with RunLock(model_dir): ...`, or `acquire()` / `release()`.

  Args:
    model_dir: the run's directory (must exist).
    stale_after_s: a heartbeat older than this frees the lock.
    heartbeat_s: how often the holder touches the lock.
  """

  def __init__(self, model_dir: str, stale_after_s: float = STALE_AFTER_S,
               heartbeat_s: float = HEARTBEAT_S):
    self.path = os.path.join(model_dir, LOCK_FILE)
    self.stale_after_s = stale_after_s
    self.heartbeat_s = heartbeat_s
    self._record = {
        'host': socket.gethostname(),
        'pid': os.getpid(),
        'user': getpass.getuser(),
        'started': datetime.datetime.now().isoformat(timespec='seconds'),
        'command': ' '.join(sys.argv),
        'token': uuid.uuid4().hex,
        'pid_start': _process_start(os.getpid()),
    }
    self._stop = threading.Event()
    self._thread = None

  def __enter__(self) -> 'RunLock':
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()

  def _create(self) -> bool:
    try:
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, 'w') as f:
      json.dump(self._record, f)
    return True

  def stale_reason(self, holder: dict[str, Any], age_s: float
                   ) -> Optional[str]:
    """Why `holder`'s lock, touched `age_s` ago, is stale; None: it is live.

    On this host the process decides; elsewhere the heartbeat.
    """
    if (holder.get('host') == self._record['host']
        and isinstance(holder.get('pid'), int)):
      if _pid_alive(holder['pid'], holder.get('pid_start')):
        return None
      return f'process {holder["pid"]} no longer runs'
    if age_s > self.stale_after_s:
      return f'no heartbeat for {age_s:.0f} s'
    return None

  def check_held(self) -> None:
    """Raises LockLostError, naming the new holder, if the lock is not ours."""
    holder = _read(self.path)
    if holder and holder.get('token') == self._record['token']:
      return
    raise LockLostError(
        f'This run no longer holds {self.path}: '
        + (f'pid {holder.get("pid")} on {holder.get("host")} (started '
           f'{holder.get("started")}) took it over'
           if holder else 'the lock file is gone')
        + ', presuming this run gone (was it stopped or suspended for '
        f'longer than {self.stale_after_s:.0f} s?). This run stops without '
        'saving, so that it does not overwrite the other run\'s '
        'checkpoints. Resume it in another MODEL_DIR, or stop the other run '
        'and run again.')

  def acquire(self) -> None:
    """Takes the lock, or raises DirectoryInUseError naming the holder."""
    for _ in range(3):  # a lock can vanish or be replaced between checks
      if self._create():
        break
      holder = _read(self.path)
      if holder is None:
        continue
      try:
        age = time.time() - os.path.getmtime(self.path)
      except FileNotFoundError:
        continue
      reason = self.stale_reason(holder, age)
      if reason is None:
        raise DirectoryInUseError(
            f'MODEL_DIR {os.path.dirname(self.path)} is in use by another '
            f'trainer: pid {holder.get("pid")} on {holder.get("host")} '
            f'(user {holder.get("user")}, started {holder.get("started")}, '
            f'heartbeat {age:.0f} s ago): {holder.get("command")}. Wait for '
            'it, stop it, or use another MODEL_DIR. If that run is surely '
            f'gone, delete {self.path}.')
      # Move the stale lock aside under a name only this run uses: of two
      # runs taking over at once, one renames it and the other finds it
      # gone and retries.
      aside = f'{self.path}.stale-{self._record["token"]}'
      try:
        os.rename(self.path, aside)
      except FileNotFoundError:
        continue
      if _read(aside) != holder:  # renamed a fresh lock by mistake: undo
        os.rename(aside, self.path)
        continue
      os.remove(aside)
      log.warning('Took over a stale lock on %s (%s; it was held by pid %s '
                  'on %s since %s).', os.path.dirname(self.path), reason,
                  holder.get('pid'), holder.get('host'), holder.get('started'))
    else:
      raise DirectoryInUseError(
          f'Could not take {self.path}: other runs keep taking it.')
    self._thread = threading.Thread(target=self._beat, daemon=True,
                                    name='run-lock-heartbeat')
    self._thread.start()

  def _beat(self) -> None:
    while not self._stop.wait(self.heartbeat_s):
      holder = _read(self.path)
      if not holder or holder.get('token') != self._record['token']:
        continue  # taken over: never refresh another run's lock
      try:
        os.utime(self.path)
      except OSError:
        pass  # the directory vanished: nothing left to protect

  def release(self) -> None:
    """Stops the heartbeat and removes the lock if it is still this run's."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    holder = _read(self.path)
    if holder and holder.get('token') == self._record['token']:
      os.remove(self.path)
