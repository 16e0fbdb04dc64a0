"""t5x's partitioner taught the project's optax optimizer's state.

Adafactor's `FactoredState` and `TaskParamsState`, registered on import,
which `t5x_model` does, so every gin/t5x file has it.
"""

import functools
from typing import Any

import jax
import optax
from t5x import optimizers

from hyperprompt_jax.training import optimizers as hp_optimizers

PyTree = Any


def _factored_state_axes(state: optax.FactoredState,
                         params_axes: PyTree) -> optax.FactoredState:
  """Logical axes of optax Adafactor's state, for t5x's partitioner.

  An unfactored parameter's `v` has its axes; the factored moments (and a
  factored parameter's `(1,)` `v`) are small and replicated.
  `optax.MaskedNode`s of other groups stay so.
  """

  def leaf_axes(axes, value, keep_axes):
    if isinstance(value, optax.MaskedNode):
      return value
    if keep_axes and axes is not None and value.ndim == len(axes):
      return axes
    return None

  def tree_axes(values, keep_axes=False):
    return jax.tree.map(
        functools.partial(leaf_axes, keep_axes=keep_axes), params_axes,
        values)

  return optax.FactoredState(
      count=None,
      v_row=tree_axes(state.v_row),
      v_col=tree_axes(state.v_col),
      v=tree_axes(state.v, keep_axes=True))


def register_optax_partition_rules() -> None:
  """Teaches t5x's `OptaxStatePartitionRules` optax Adafactor's state.

  t5x has no rule for `FactoredState` (it uses its own Adafactor), so an
  `OptaxWrapper(make_optimizer())` state would raise 'unregistered optax
  state type FactoredState'. Idempotent.
  """
  # pylint: disable-next=protected-access
  rules = optimizers.OptaxStatePartitionRules._RULES
  rules.setdefault(optax.FactoredState, _factored_state_axes)
  # Training only the new tasks' parameters: the state is over slices of
  # task-indexed parameters, which the project's rules replicate anyway.
  rules.setdefault(hp_optimizers.TaskParamsState,
                   lambda state, params_axes: hp_optimizers.TaskParamsState(
                       jax.tree.map(lambda _: None, state.inner)))


register_optax_partition_rules()
