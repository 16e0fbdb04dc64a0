"""Which parameters are task-conditioned, and which are the backbone.

One rule for parameter tables, the optimizer's freeze switch and checkpoint
restore: a parameter is task-conditioned when a component of its path is in
`TASK_CONDITIONED_SCOPES`, the scopes of `methods.REGISTRY`'s methods;
everything else is the T5 backbone that a t5x checkpoint provides.
"""

from typing import Iterable, Optional

from hyperprompt_jax import methods

TASK_CONDITIONED_SCOPES = frozenset(methods.scopes())


def split_path(path: str | Iterable[str]) -> tuple[str, ...]:
  """A '/'-joined or tuple path as a tuple."""
  return tuple(path.split('/')) if isinstance(path, str) else tuple(path)


def scope_of(path: str | Iterable[str]) -> Optional[str]:
  """The first task-conditioning scope on `path`; None for the backbone."""
  return next((part for part in split_path(path)
               if part in TASK_CONDITIONED_SCOPES), None)


def is_task_conditioned(path: str | Iterable[str]) -> bool:
  """True for '/'-joined (or tuple) paths inside a task-conditioning scope."""
  return scope_of(path) is not None
