"""The optimizer both runners use: optax Adafactor (the papers: a constant
rate; the built-in runner takes a schedule, `schedules`).

The papers fine-tune with Adafactor at a constant learning rate of 1e-3 and
update every parameter ("All" in HyperPrompt's Table 1). `make_optimizer`
adds what the papers leave open: per-group learning-rate multipliers (the
HyperPrompt paper suspects new prompt parameters may want another rate), a
switch that trains only the task-conditioned parameters (Table 1's "Task"),
the backbone then getting neither updates nor optimizer state, and Adafactor's
parameter scaling per group or task-conditioning scope.

Parameter scaling. T5's Adafactor takes relative steps: each
update is multiplied by max(1e-3, RMS(theta)), so a parameter moves in
proportion to its own scale. That is right for every parameter initialised
at its working scale: the backbone, HyperPrompt's prompts, embeddings and
(hyper)networks (fan-in scaled, its Global generators deliberately small as
they generate fan-in-scaled matrices), HyperGrid's grids, the soft prompts,
HyperFormer++'s generators. It starves the Vanilla Adapter (Houlsby et al.,
2019): its near-identity start, weights N(0, 0.01^2) and zero biases, lies
one to three orders below the scale the adapter must reach, and relative
steps grow it by at most a factor (1 + rate) a step. Measured on the
task-separation problem (tests/test_task_separation.py; docs/methods.md,
Optimizer):
on a frozen MTL backbone at the papers' rate 1e-3, the adapter stays at
chance (0.25) under relative steps. So the default, `PARAMETER_SCALE`, gives
the 'adapter' scope absolute steps of the learning rate (no parameter
scaling, as prompt-tuning does for its prompts), keeping Houlsby's start; it
then separates the tasks. The scope is the adapter's alone: the other
task-conditioned parameters (HyperPrompt-Global's small generators) fail
under absolute steps or a larger floor (docs/methods.md, Optimizer). Every
other variant keeps T5's relative steps, and its training is bit-identical
to optax's Adafactor.

The built-in runner calls it directly; t5x runs wrap it in
`t5x.optimizers.OptaxWrapper`, so both optimise identically.
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


# Adafactor's parameter-scaled (relative) steps, per group (module
# docstring): T5's for every parameter except the Vanilla Adapter's, whose
# near-identity start is far below its working scale.
PARAMETER_SCALE = types.MappingProxyType({BACKBONE: True,
                                          TASK_CONDITIONED: True,
                                          'adapter': False})
T5_MIN_SCALE = 1e-3  # Adafactor's eps2: the floor of the parameter scale

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


def scale_by_parameter_scale(
    floor: Callable[[tuple[str, ...]], Optional[float]]
) -> optax.GradientTransformation:
  """Adafactor's relative step, with the floor chosen per parameter.

  `optax.scale_by_param_block_rms` multiplies every update by
  max(floor, RMS(parameter)) with one floor for all; here `floor(path)` gives
  each parameter's (its path: a tuple of names), None meaning no scaling
  (steps of the learning rate). Same arithmetic and (empty) state.
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

  The same transformations in the same order as `optax.adafactor` with
  `multiply_by_parameter_scale=True` (same state tree, same arithmetic where
  `floor` gives 1e-3), which takes one floor for every parameter.
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
  """Adafactor (T5's settings) at a constant or scheduled rate, with
  parameter groups.

  The groups are 'backbone' and 'task_conditioned' (`param_groups`). The
  parameter-scale settings take one value for every parameter or a mapping
  whose keys are groups or task-conditioning scopes
  (`param_groups.TASK_CONDITIONED_SCOPES`, e.g. 'adapter'); a scope's entry
  overrides 'task_conditioned' for the parameters under it.

  Args:
    learning_rate: the constant rate (papers: 1e-3), or a schedule of the
      update count (`schedules.create_learning_rate_scheduler`; the count
      is saved in the optimizer state, so a resumed run continues it).
    train_only_task_conditioned: freeze the backbone; only parameters under a
      task-conditioning scope (`param_groups`) are updated.
    freeze_embeddings: keep the token embedding fixed (the HyperGrid paper's
      fine-tuning).
    learning_rate_multipliers: `{'backbone': x, 'task_conditioned': y}`
      scaling the rate per group (missing groups: 1.0).
    decay_rate: Adafactor's second-moment decay exponent (T5: 0.8).
    clipping_threshold: Adafactor's update clipping (T5: 1.0).
    multiply_by_parameter_scale: relative steps, scaled by max(floor,
      RMS(parameter)) (T5: True); False: steps of the learning rate. Missing
      keys: True. Default: `PARAMETER_SCALE` (module docstring).
    min_parameter_scale: the floor, Adafactor's eps2 (T5: 1e-3; missing
      keys: 1e-3).
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
  """A positive real number, or a ValueError before any step is compiled
  (a quoted gin value, `'1e-3'`, would otherwise fail in the first step)."""
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
  """A setting for every parameter, or a mapping from groups (and, with
  `scopes`, task-conditioning scopes) to settings -> `{key: setting}` for
  'backbone', 'task_conditioned' (and every scope: its own entry, else
  'task_conditioned''s)."""
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
  """Trains only some tasks' parameters (slices of the task-indexed
  arrays, along their task axis); everything else gets zero updates and
  no optimizer state.

  Adding a task to a trained model (`task_params`): the new tasks'
  parameters learn, the backbone, the shared hypernetworks and the trained
  tasks' parameters stay bit-identical. optax's `masked` /
  `multi_transform` freeze whole arrays; here the frozen part is a slice of
  one, so `inner` runs on the trainable slices alone (its state, e.g.
  Adafactor's moments and its relative step's RMS, is over those slices
  only).

  Args:
    inner: the optimizer of the trainable slices (`make_optimizer`'s).
    tasks: `{'/'-path: (axis, first)}`: of the task-indexed parameter at
      path, the tasks `first:` along its task axis `axis` train.
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
