"""t5x's partitioner taught the state of the project's optax optimizer
(Adafactor's `FactoredState`, `TaskParamsState`): registered on import, which
`t5x_model` does, so every gin/t5x file has it."""

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

  An unfactored parameter's second moment `v` has the parameter's shape and
  axes. The factored moments `v_row` / `v_col` are vectors, and `v` of a
  factored parameter a `(1,)` placeholder: small, so replicated (None).
  Parameters another group of `optax.multi_transform` owns are
  `optax.MaskedNode`s and stay so.
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

  t5x keeps its rules in a class-level table and has none for
  `FactoredState` (it uses its own Adafactor); without one, partitioning an
  `OptaxWrapper(make_optimizer())` state raises 'unregistered optax state
  type FactoredState'. Idempotent.
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
