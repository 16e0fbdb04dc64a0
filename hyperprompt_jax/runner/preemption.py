"""Stopping a run at a step boundary on SIGTERM / SIGINT (and preemption).

TPU-pod preemptions and most schedulers send SIGTERM, then SIGKILL a while
later; Ctrl-C sends SIGINT. Either asks the runner to save a checkpoint at
the next step boundary and exit, so a restart loses no step.

Every host must stop at the same step (the save is collective). Where
`jax.distributed` runs, JAX's preemption service catches SIGTERM on any host
and agrees on the step; orbax's `CheckpointManager.reached_preemption(step)`
asks it, and the Python handler leaves SIGTERM to it. A single process
catches SIGTERM itself. SIGINT is always caught in Python (a terminal sends
it to one host only; on a pod, stop with SIGTERM).

A second signal of the same kind stops at once, as if no handler were set.
"""

import logging
import signal
import threading
from typing import Callable, Optional

log = logging.getLogger('hyperprompt_jax.train')


class StopRequest:
  """While active (`with`), records SIGTERM / SIGINT; `due(step)`: stop now?

  Args:
    reached_preemption: orbax's `CheckpointManager.reached_preemption`
      (False everywhere when JAX's preemption service is off).
    catch_sigterm: handle SIGTERM in Python (False where JAX's preemption
      service owns it: multi-process runs).
  """

  def __init__(self, reached_preemption: Callable[[int], bool],
               catch_sigterm: bool = True):
    self._reached_preemption = reached_preemption
    self._signals = [signal.SIGINT] + ([signal.SIGTERM] if catch_sigterm
                                       else [])
    self._previous = {}
    self.signal: Optional[int] = None

  def __enter__(self) -> 'StopRequest':
    # Signal handlers can only be set from the main thread (tests and
    # notebooks may train from another one: they keep the defaults).
    if threading.current_thread() is threading.main_thread():
      for sig in self._signals:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    del frame
    if self.signal == signum:  # asked twice: stop now
      signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
      signal.raise_signal(signum)
      return
    self.signal = signum
    log.warning('Received %s: saving a checkpoint at the next step, then '
                'stopping (send it again to stop at once, without saving).',
                signal.Signals(signum).name)

  @property
  def name(self) -> str:
    """The signal that asked to stop ('SIGTERM', 'SIGINT'), or 'preemption'."""
    return (signal.Signals(self.signal).name if self.signal is not None
            else 'preemption')

  def due(self, step: int) -> bool:
    """Whether to stop after `step`; call it at every step, on every host."""
    preempted = self._reached_preemption(step)
    return preempted or self.signal is not None


def exit_status(stopped_by: str) -> int:
  """128 + the number of the signal that stopped the run (preemption: SIGTERM).

  So schedulers and scripts see that it stopped before TRAIN_STEPS.
  """
  sig = signal.SIGINT if stopped_by == 'SIGINT' else signal.SIGTERM
  return 128 + sig
