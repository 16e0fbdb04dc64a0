"""Learning-rate schedules of the built-in runner, as t5x writes them.

`create_learning_rate_scheduler` takes t5x's arguments
(`t5x.utils.create_learning_rate_scheduler`) and multiplies the same
factors, so a t5x gin schedule ports by renaming its prefix:

  utils.create_learning_rate_scheduler.factors = 'constant * rsqrt_decay'
  ->
  schedules.create_learning_rate_scheduler.factors = 'constant * rsqrt_decay'

The default is the papers' constant rate. The schedule reads the optimizer's
update count, saved in the optimizer state, so a resumed run continues it;
the run record keeps its settings (`Schedule.record`) and a resume with
another schedule is refused.
"""

import dataclasses
from typing import Any, Union

import gin
import jax.numpy as jnp

# t5x's factors, and the arguments each reads (besides the step).
FACTORS = {
    'constant': ('base_learning_rate',),
    'linear_warmup': ('warmup_steps',),
    'linear_decay': ('base_learning_rate', 'warmup_steps', 'decay_factor'),
    'rsqrt_decay': ('warmup_steps',),
    'rsqrt_normalized_decay': ('warmup_steps',),
    'decay_every': ('decay_factor', 'steps_per_decay'),
    'cosine_decay': ('warmup_steps', 'steps_per_cycle'),
}


@dataclasses.dataclass(frozen=True)
class Schedule:
  """`step -> learning rate`, the product of `factors` (t5x's arithmetic).

  Its fields are `create_learning_rate_scheduler`'s arguments.
  """
  factors: str = 'constant'
  base_learning_rate: float = 1e-3
  warmup_steps: int = 1000
  decay_factor: float = 0.5
  steps_per_decay: int = 20000
  steps_per_cycle: int = 100000
  step_offset: int = 0
  min_learning_rate: float = 1e-8

  @property
  def names(self) -> list[str]:
    """The factors' names."""
    return [n.strip() for n in self.factors.split('*')]

  def __call__(self, step: Union[int, jnp.ndarray]) -> jnp.ndarray:
    """The float32 learning rate at `step`."""
    step = jnp.maximum(0, jnp.asarray(step, jnp.float32) - self.step_offset)
    warmup = float(self.warmup_steps)
    rate = jnp.float32(1.0)
    for name in self.names:
      if name == 'constant':
        rate *= self.base_learning_rate
      elif name == 'linear_warmup':
        rate *= jnp.minimum(1.0, step / warmup)
      elif name == 'linear_decay':  # implies constant * linear_warmup
        rate *= self.base_learning_rate * jnp.minimum(
            step / warmup, 1.0 + self.decay_factor * (warmup - step))
      elif name == 'rsqrt_decay':
        rate /= jnp.sqrt(jnp.maximum(step, warmup))
      elif name == 'rsqrt_normalized_decay':
        rate *= jnp.sqrt(warmup) / jnp.sqrt(jnp.maximum(step, warmup))
      elif name == 'decay_every':
        rate *= self.decay_factor ** (step // self.steps_per_decay)
      elif name == 'cosine_decay':
        progress = jnp.maximum(0.0, (step - warmup) / self.steps_per_cycle)
        rate *= jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(jnp.pi *
                                                      (progress % 1.0))))
    return jnp.maximum(rate, self.min_learning_rate).astype(jnp.float32)

  def record(self) -> dict[str, Any]:
    """The settings the rates depend on, for the run record."""
    used = {'factors': ' * '.join(self.names)}
    for name in self.names:
      for arg in FACTORS[name]:
        used[arg] = getattr(self, arg)
    used.update(step_offset=self.step_offset,
                min_learning_rate=self.min_learning_rate)
    return used


@gin.configurable
def create_learning_rate_scheduler(
    factors: str = 'constant',
    base_learning_rate: float = 1e-3,
    warmup_steps: int = 1000,
    decay_factor: float = 0.5,
    steps_per_decay: int = 20000,
    steps_per_cycle: int = 100000,
    step_offset: int = 0,
    min_learning_rate: float = 1e-8,
) -> Schedule:
  """t5x's `utils.create_learning_rate_scheduler`.

  The rate is the product of `factors` (separated by '*'), each one of

    constant                base_learning_rate
    linear_warmup           min(1, step / warmup_steps)
    linear_decay            base_learning_rate * min(step / warmup_steps,
                            1 + decay_factor * (warmup_steps - step)) (it
                            implies constant * linear_warmup: use it alone)
    rsqrt_decay             1 / sqrt(max(step, warmup_steps))
    rsqrt_normalized_decay  sqrt(warmup_steps) / sqrt(max(step, warmup_steps))
    decay_every             decay_factor ** (step // steps_per_decay)
    cosine_decay            0.5 (1 + cos(pi (progress % 1))), progress =
                            max(0, (step - warmup_steps) / steps_per_cycle)

  with step = max(0, step - step_offset), floored at `min_learning_rate`.
  The default, 'constant' (gin: base_learning_rate = %LEARNING_RATE), is
  the papers' rate; t5x's default is 'constant * linear_warmup *
  rsqrt_decay'.

  Args:
    factors: the factors' names joined by '*'.
    base_learning_rate: read by 'constant' and 'linear_decay'.
    warmup_steps: read by the warmup and decay factors.
    decay_factor: read by 'linear_decay' and 'decay_every'.
    steps_per_decay: read by 'decay_every'.
    steps_per_cycle: read by 'cosine_decay'.
    step_offset: steps before the schedule starts.
    min_learning_rate: the floor.

  Returns:
    The `Schedule`.

  Raises:
    ValueError: an unknown factor or a setting a factor cannot use, naming
      it and the fix.
  """
  if not isinstance(factors, str) or not factors.strip():
    raise ValueError(f'create_learning_rate_scheduler.factors={factors!r}: '
                     "give factors joined by '*', e.g. 'constant * "
                     "linear_warmup * rsqrt_decay'.")
  schedule = Schedule(factors, base_learning_rate, warmup_steps, decay_factor,
                      steps_per_decay, steps_per_cycle, step_offset,
                      min_learning_rate)
  unknown = [n for n in schedule.names if n not in FACTORS]
  if unknown:
    raise ValueError(
        f'Unknown learning-rate factor(s) {unknown} in {factors!r}: '
        f'create_learning_rate_scheduler.factors takes {sorted(FACTORS)} '
        "joined by '*' (t5x's names).")
  used = {arg for n in schedule.names for arg in FACTORS[n]}
  for arg in sorted(used | {'min_learning_rate'}):
    value = getattr(schedule, arg)
    positive = arg in ('warmup_steps', 'steps_per_decay', 'steps_per_cycle',
                       'base_learning_rate')
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        value <= 0 if positive else value < 0):
      raise ValueError(
          f'create_learning_rate_scheduler.{arg}={value!r}: factors '
          f'{factors!r} need a number {"> 0" if positive else ">= 0"} '
          '(unquoted in gin).')
  if (isinstance(step_offset, bool) or not isinstance(step_offset, int)
      or step_offset < 0):
    raise ValueError(f'create_learning_rate_scheduler.step_offset='
                     f'{step_offset!r}: an integer >= 0.')
  return schedule
