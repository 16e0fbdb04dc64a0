"""The optimizer of both runners: optax Adafactor with parameter groups.

The papers fine-tune every parameter with Adafactor at a constant rate of
1e-3 ("All" in HyperPrompt's Table 1). `make_optimizer` adds what they leave
open: per-group learning-rate multipliers, training only the task-conditioned
parameters (Table 1's "Task": the backbone gets neither updates nor state),
and Adafactor's parameter scaling per group or scope. The built-in runner
calls it (with a schedule, `schedules`); t5x runs wrap it in
`t5x.optimizers.OptaxWrapper`.

Parameter scaling: T5's Adafactor multiplies each update by max(1e-3,
RMS(theta)), right for every parameter initialised at its working scale.
The Vanilla Adapter's near-identity start lies far below it and, growing by
at most a factor (1 + rate) a step, stays there at the papers' rate; so
`PARAMETER_SCALE` gives the 'adapter' scope absolute steps of the rate (as
prompt-tuning does for its prompts). The other task-conditioned parameters
fail under absolute steps or a larger floor; every other variant trains
bit-identically to optax's Adafactor (docs/methods.md, "Optimizer").
"""

import types
from typing import Any, Callable, Mapping, NamedTuple, Optional

import flax
from flax import traverse_util
import jax
import jax.numpy as jnp
import optax

import hyperprompt_jax
from hyperprompt_jax.methods import param_groups

BACKBONE = 'backbone'
TASK_CONDITIONED = 'task_conditioned'
FROZEN = 'frozen'


# Adafactor's relative steps per group: T5's, except for the Vanilla
# Adapter's near-identity start, far below its working scale.
PARAMETER_SCALE = types.MappingProxyType({BACKBONE: True,
                                          TASK_CONDITIONED: True,
                                          'adapter': False})
T5_MIN_SCALE = 1e-3  # Adafactor's eps2: the floor of the parameter scale

# The shared token embedding (t5x's name); HyperGrid froze it.
EMBEDDING_SCOPE = 'token_embedder'


def parameter_labels(params: Any, train_only_task_conditioned: bool,
                     freeze_embeddings: bool = False) -> Any:
  """`params` with each leaf replaced by its group label, same container type.

  t5x passes `FrozenDict`s, and optax needs the label tree to match exactly.
  """
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


def scale_by_parameter_scale(
    floor: Callable[[tuple[str, ...]], Optional[float]]
) -> optax.GradientTransformation:
  """Adafactor's relative step, with the floor chosen per parameter.

  As `optax.scale_by_param_block_rms` (same arithmetic, empty state), but
  `floor(path)` gives each parameter's floor, None for steps of the rate.
  """

  def update_fn(updates, state, params):
    if params is None:
      raise ValueError('scale_by_parameter_scale needs the parameters.')

    def scale(path, update, param):
      min_scale = floor(_names(path))
      if min_scale is None:
        return update
      return update * optax.safe_root_mean_squares(param, min_scale)

    return jax.tree_util.tree_map_with_path(scale, updates, params), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def adafactor(learning_rate: float | optax.Schedule,
              floor: Callable[[tuple[str, ...]], Optional[float]],
              decay_rate: float = 0.8,
              clipping_threshold: Optional[float] = 1.0,
              min_dim_size_to_factor: int = 128
              ) -> optax.GradientTransformation:
  """`optax.adafactor`'s chain with a per-parameter scale floor.

  Its transformations in its order, with `multiply_by_parameter_scale=True`:
  the same state tree, and the same arithmetic where `floor` gives 1e-3.
  """
  chain = [optax.scale_by_factored_rms(
      decay_rate=decay_rate, min_dim_size_to_factor=min_dim_size_to_factor)]
  if clipping_threshold is not None:
    chain.append(optax.clip_by_block_rms(clipping_threshold))
  chain.append(optax.scale_by_learning_rate(learning_rate, flip_sign=False))
  chain.append(scale_by_parameter_scale(floor))
  chain.append(optax.scale(-1))
  return optax.chain(*chain)


def make_optimizer(
    learning_rate: float | optax.Schedule = 1e-3,
    train_only_task_conditioned: bool = False,
    freeze_embeddings: bool = False,
    learning_rate_multipliers: Optional[Mapping[str, float]] = None,
    decay_rate: float = 0.8,
    clipping_threshold: Optional[float] = 1.0,
    # A plain dict (never mutated), so that gin's operative config records it.
    multiply_by_parameter_scale: bool | Mapping[str, bool] = dict(  # pylint: disable=dangerous-default-value
        PARAMETER_SCALE),
    min_parameter_scale: float | Mapping[str, float] = T5_MIN_SCALE,
    min_dim_size_to_factor: int = 128,
) -> optax.GradientTransformation:
  """Adafactor (T5's settings) at a constant or scheduled rate, with groups.

  The groups are 'backbone' and 'task_conditioned' (`param_groups`). The
  parameter-scale settings take one value or a mapping keyed by groups or
  task-conditioning scopes (e.g. 'adapter'); a scope's entry overrides
  'task_conditioned' for the parameters under it.

  Args:
    learning_rate: the constant rate (papers: 1e-3), or a schedule of the
      update count, which the optimizer state keeps across a resume.
    train_only_task_conditioned: freeze the backbone; only parameters under a
      task-conditioning scope are updated.
    freeze_embeddings: keep the token embedding fixed (the HyperGrid paper).
    learning_rate_multipliers: `{'backbone': x, 'task_conditioned': y}`
      scaling the rate per group (missing groups: 1.0).
    decay_rate: Adafactor's second-moment decay exponent (T5: 0.8).
    clipping_threshold: Adafactor's update clipping (T5: 1.0).
    multiply_by_parameter_scale: relative steps, scaled by max(floor,
      RMS(parameter)) (T5: True); False: steps of the rate. Missing keys:
      True. Default: `PARAMETER_SCALE`.
    min_parameter_scale: the floor, Adafactor's eps2 (missing keys: 1e-3).
    min_dim_size_to_factor: factor second moments of larger dimensions.

  Returns:
    An optax transformation over the model's parameter tree.
  """
  multipliers = _per_group(learning_rate_multipliers or {}, 1.0,
                           'learning_rate_multipliers', scopes=False)
  scaled = _per_group(multiply_by_parameter_scale, True,
                      'multiply_by_parameter_scale')
  floors = _per_group(min_parameter_scale, T5_MIN_SCALE,
                      'min_parameter_scale')
  if not callable(learning_rate):
    _check_number('learning_rate', learning_rate, 'LEARNING_RATE')
  _check_number('decay_rate', decay_rate)
  if clipping_threshold is not None:
    _check_number('clipping_threshold', clipping_threshold)
  for key, value in floors.items():
    if not value > 0:
      raise ValueError(f'min_parameter_scale of {key!r} must be positive, '
                       f'got {value}.')

  def floor(path: tuple[str, ...]) -> Optional[float]:
    scope = param_groups.scope_of(path)
    key = BACKBONE if scope is None else scope
    return floors[key] if scaled[key] else None

  def group_rate(group):
    if not callable(learning_rate):
      return learning_rate * multipliers[group]
    if multipliers[group] == 1.0:
      return learning_rate
    return lambda count: learning_rate(count) * multipliers[group]

  def group_adafactor(group):
    return adafactor(
        learning_rate=group_rate(group),
        floor=floor,
        decay_rate=decay_rate,
        clipping_threshold=clipping_threshold,
        min_dim_size_to_factor=min_dim_size_to_factor,
    )

  return optax.multi_transform(
      {
          BACKBONE: group_adafactor(BACKBONE),
          TASK_CONDITIONED: group_adafactor(TASK_CONDITIONED),
          FROZEN: optax.set_to_zero(),
      },
      lambda params: parameter_labels(params, train_only_task_conditioned,
                                      freeze_embeddings),
  )


def _check_number(name: str, value: Any, macro: Optional[str] = None
                  ) -> None:
  """A positive real number, or a ValueError before any step compiles."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      0 < value < float('inf')):
    hint = f' (--gin.{macro}=1e-3, unquoted)' if macro else ''
    raise ValueError(f'make_optimizer.{name} must be a positive number, got '
                     f'{value!r} ({type(value).__name__}){hint}.')


def _names(path) -> tuple[str, ...]:
  """A jax key path -> its names ('encoder', 'layers_0', ...)."""
  return tuple(str(getattr(k, 'key', getattr(k, 'name', k))) for k in path)


def _per_group(value: Any, missing: Any, name: str,
               scopes: bool = True) -> dict[str, Any]:
  """A setting, or a mapping by group and scope -> `{group or scope: value}`."""
  groups = (BACKBONE, TASK_CONDITIONED)
  all_scopes = sorted(param_groups.TASK_CONDITIONED_SCOPES) if scopes else []
  if not isinstance(value, Mapping):
    return {key: value for key in (*groups, *all_scopes)}
  unknown = set(value) - set(groups) - set(all_scopes)
  if unknown:
    raise ValueError(
        f'Unknown {name} groups {sorted(unknown)}: use '
        f"'{BACKBONE}', '{TASK_CONDITIONED}'"
        + (f' or a task-conditioning scope {all_scopes}.' if scopes else '.'))
  out = {group: value.get(group, missing) for group in groups}
  out.update({scope: value.get(scope, out[TASK_CONDITIONED])
              for scope in all_scopes})
  return out


class TaskParamsState(NamedTuple):
  """`only_task_params`' state: `inner`'s, over the trainable slices only."""
  inner: Any


def only_task_params(inner: optax.GradientTransformation,
                     tasks: Mapping[str, tuple[int, int]]
                     ) -> optax.GradientTransformation:
  """Trains only some tasks' slices of the task-indexed arrays.

  Everything else gets zero updates and no optimizer state: adding a task to
  a trained model leaves the backbone, the shared hypernetworks and the
  trained tasks' parameters bit-identical. optax's `masked` freezes whole
  arrays; here `inner` runs on the trainable slices alone, its state (e.g.
  the RMS of the relative step) over them only.

  Args:
    inner: the optimizer of the trainable slices (`make_optimizer`'s).
    tasks: `{'/'-path: (axis, first)}`: the tasks `first:` along axis `axis`
      of that parameter train.

  Returns:
    The optax transformation.
  """
  if not tasks:
    raise ValueError('only_task_params needs at least one trainable slice: '
                     'the model has no task-indexed parameters to train.')

  def trainable(tree):
    flat = traverse_util.flatten_dict(flax.core.unfreeze(tree), sep='/')
    missing = sorted(set(tasks) - set(flat))
    if missing:
      raise ValueError(f'only_task_params: the parameters lack {missing}.')
    return traverse_util.unflatten_dict(
        {k: jax.lax.slice_in_dim(flat[k], first, None, axis=axis)
         for k, (axis, first) in tasks.items()}, sep='/')

  def init_fn(params):
    return TaskParamsState(inner.init(trainable(params)))

  def update_fn(updates, state, params=None):
    sliced, inner_state = inner.update(
        trainable(updates), state.inner,
        None if params is None else trainable(params))
    state = TaskParamsState(inner_state)
    sliced = traverse_util.flatten_dict(sliced, sep='/')
    flat = traverse_util.flatten_dict(flax.core.unfreeze(updates), sep='/')
    out = {}
    for path, grad in flat.items():
      zeros = jnp.zeros_like(grad)
      if path in tasks:
        axis, first = tasks[path]
        out[path] = jax.lax.dynamic_update_slice_in_dim(
            zeros, sliced[path].astype(grad.dtype), first, axis)
      else:
        out[path] = zeros
    out = traverse_util.unflatten_dict(out, sep='/')
    if isinstance(updates, flax.core.FrozenDict):
      out = flax.core.freeze(out)
    return out, state

  return optax.GradientTransformation(init_fn, update_fn)


def only_task_rows(inner: optax.GradientTransformation,
                   rows: Mapping[str, tuple[int, int]]
                   ) -> optax.GradientTransformation:
  """Deprecated (goes in the next release): `only_task_params`."""
  hyperprompt_jax.warn_renamed(
      'optimizers.only_task_rows is now optimizers.only_task_params')
  return only_task_params(inner, rows)
