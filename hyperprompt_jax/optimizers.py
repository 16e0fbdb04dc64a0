"""The optimizer both runners use: optax Adafactor with a constant rate.

The papers fine-tune with Adafactor at a constant learning rate of 1e-3 and
update every parameter ("All" in HyperPrompt's Table 1). `make_optimizer`
adds what the papers leave open: per-group learning-rate multipliers (the
HyperPrompt paper suspects new prompt parameters may want another rate) and a
switch that trains only the task-conditioned parameters (Table 1's "Task"),
the backbone then getting neither updates nor optimizer state.

The built-in runner calls it directly; t5x runs wrap it in
`t5x.optimizers.OptaxWrapper`, so both optimise identically.
"""

from typing import Any, Mapping, Optional

import flax
from flax import traverse_util
import optax

from hyperprompt_jax import param_groups

BACKBONE = 'backbone'
TASK_CONDITIONED = 'task_conditioned'
FROZEN = 'frozen'


# The shared token embedding (t5x's name); HyperGrid froze it.
EMBEDDING_SCOPE = 'token_embedder'


def parameter_labels(params: Any, train_only_task_conditioned: bool,
                     freeze_embeddings: bool = False) -> Any:
  """The tree of `params` with each leaf replaced by its group label, in the
  same container type (t5x passes `FrozenDict`s; optax needs the label tree
  to match the parameter tree exactly)."""
  flat = traverse_util.flatten_dict(flax.core.unfreeze(params))
  labels = {}
  for path, _ in flat.items():
    if param_groups.is_task_conditioned(path):
      labels[path] = TASK_CONDITIONED
    elif train_only_task_conditioned or (freeze_embeddings and
                                         EMBEDDING_SCOPE in path):
      labels[path] = FROZEN
    else:
      labels[path] = BACKBONE
  labels = traverse_util.unflatten_dict(labels)
  if isinstance(params, flax.core.FrozenDict):
    return flax.core.freeze(labels)
  return labels


def make_optimizer(
    learning_rate: float = 1e-3,
    train_only_task_conditioned: bool = False,
    freeze_embeddings: bool = False,
    learning_rate_multipliers: Optional[Mapping[str, float]] = None,
    decay_rate: float = 0.8,
    clipping_threshold: Optional[float] = 1.0,
    multiply_by_parameter_scale: bool = True,
    min_dim_size_to_factor: int = 128,
) -> optax.GradientTransformation:
  """Adafactor (T5's settings) at a constant rate, with parameter groups.

  Args:
    learning_rate: the constant rate (papers: 1e-3).
    train_only_task_conditioned: freeze the backbone; only parameters under a
      task-conditioning scope (`param_groups`) are updated.
    freeze_embeddings: keep the token embedding fixed (the HyperGrid paper's
      fine-tuning).
    learning_rate_multipliers: `{'backbone': x, 'task_conditioned': y}`
      scaling the rate per group (missing groups: 1.0).
    decay_rate: Adafactor's second-moment decay exponent (T5: 0.8).
    clipping_threshold: Adafactor's update clipping (T5: 1.0).
    multiply_by_parameter_scale: scale updates by parameter RMS (T5: True).
    min_dim_size_to_factor: factor second moments of larger dimensions.

  Returns:
    An optax transformation over the model's parameter tree.
  """
  multipliers = dict(learning_rate_multipliers or {})
  unknown = set(multipliers) - {BACKBONE, TASK_CONDITIONED}
  if unknown:
    raise ValueError(
        f'Unknown learning_rate_multipliers groups {sorted(unknown)}: use '
        f"'{BACKBONE}' and '{TASK_CONDITIONED}'."
    )
  if learning_rate <= 0:
    raise ValueError(f'learning_rate must be positive, got {learning_rate}.')

  def adafactor(group):
    return optax.adafactor(
        learning_rate=learning_rate * multipliers.get(group, 1.0),
        decay_rate=decay_rate,
        clipping_threshold=clipping_threshold,
        multiply_by_parameter_scale=multiply_by_parameter_scale,
        min_dim_size_to_factor=min_dim_size_to_factor,
    )

  return optax.multi_transform(
      {
          BACKBONE: adafactor(BACKBONE),
          TASK_CONDITIONED: adafactor(TASK_CONDITIONED),
          FROZEN: optax.set_to_zero(),
      },
      lambda params: parameter_labels(params, train_only_task_conditioned,
                                      freeze_embeddings),
  )
