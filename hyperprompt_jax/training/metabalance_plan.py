"""A run's MetaBalance plan from GRADIENT_BALANCING and METABALANCE_*.

The runner's side of `metabalance`, whose core imports no task or data
library: the settings checked against the run's tasks.
"""

import dataclasses
from typing import Optional

from hyperprompt_jax import task_params
from hyperprompt_jax.common import input_pipeline
from hyperprompt_jax.model import network
from hyperprompt_jax.tasks import task_ids
from hyperprompt_jax.training import metabalance
from hyperprompt_jax.training import run_settings


def run_plan(gradient_balancing: Optional[str],
             settings: Optional[metabalance.Settings],
             model: network.Transformer,
             mixture_or_task_name: str) -> Optional[metabalance.Plan]:
  """The plan of a run from its gin settings.

  Args:
    gradient_balancing: GRADIENT_BALANCING, None or 'metabalance'.
    settings: the METABALANCE_* settings (default: `metabalance.Settings()`).
    model: the network (its task-indexed parameters take the plain sum).
    mixture_or_task_name: what the run trains.

  Returns:
    The plan; None for the plain gradient.

  Raises:
    ValueError: naming the setting that does not fit the run's tasks.
  """
  if gradient_balancing not in metabalance.GRADIENT_BALANCINGS:
    raise ValueError(f'GRADIENT_BALANCING={gradient_balancing!r}; expected '
                     f'one of {list(metabalance.GRADIENT_BALANCINGS)}.')
  if gradient_balancing is None:
    return None
  settings = settings or metabalance.Settings()
  if settings.target_task:
    settings = dataclasses.replace(
        settings, target_task=task_ids.canonical_task(settings.target_task))
  return metabalance.make_plan(
      settings, task_ids.run_task_list(),
      [task_ids.canonical_task(t)
       for t in input_pipeline.sampled_tasks(mixture_or_task_name)],
      task_params.task_axes(model))


def settings_plan(settings: run_settings.RunSettings,
                  model: network.Transformer) -> Optional[metabalance.Plan]:
  """`run_plan` of a built-in run's settings (the loop's and its compile's)."""
  return run_plan(settings.gradient_balancing, settings.metabalance_settings,
                  model, settings.mixture_or_task_name)
