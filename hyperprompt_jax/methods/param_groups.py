"""Which parameters are task-conditioned, and which are the backbone.

One rule for the whole project (parameter tables, the freeze switch of the
optimizer, checkpoint restore): a parameter is task-conditioned when any
component of its path is one of `TASK_CONDITIONED_SCOPES`, the scopes of the
methods in `methods.REGISTRY` (HyperPrompt, HyperGrid and Output Gating, the
Vanilla Adapter, HyperFormer++, Prompt-Tuning); everything else is the T5
backbone that a public t5x checkpoint provides.
"""

from typing import Iterable, Optional

from hyperprompt_jax import methods

TASK_CONDITIONED_SCOPES = frozenset(methods.scopes())


def split_path(path: str | Iterable[str]) -> tuple[str, ...]:
  return tuple(path.split('/')) if isinstance(path, str) else tuple(path)


def scope_of(path: str | Iterable[str]) -> Optional[str]:
  """The task-conditioning scope a '/'-joined (or tuple) path lives under
  (the first one on it), or None for the backbone."""
  return next((part for part in split_path(path)
               if part in TASK_CONDITIONED_SCOPES), None)


def is_task_conditioned(path: str | Iterable[str]) -> bool:
  """True for '/'-joined (or tuple) paths inside a task-conditioning scope."""
  return scope_of(path) is not None
