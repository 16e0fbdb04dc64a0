"""Logical axis rules: how parameters and activations map onto a device mesh.

As in t5x, every parameter and activation carries logical axis names
(`embed`, `mlp`, `heads`, ...) that these rules map to the mesh axes
`('data', 'model')`: t5x's `standard_logical_axis_rules()` plus the
methods' names, replicated, so t5x's partitioner and the built-in runner
shard the network identically.
"""

from typing import Optional, Sequence

import flax
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning
import jax
from jax.experimental import mesh_utils
import numpy as np

from hyperprompt_jax import methods
from hyperprompt_jax.common import multihost

AxisRules = Sequence[tuple[str, str | None]]

# t5x's standard rules for 1-D parameter partitioning (model parallelism over
# 'model', data parallelism over 'data').
T5X_STANDARD_RULES: AxisRules = (
    ('batch', 'data'),
    ('vocab', 'model'),
    ('embed', None),
    ('mlp', 'model'),
    ('heads', 'model'),
    ('kv', None),
    ('joined_kv', 'model'),
    ('relpos_buckets', None),
    ('abspos_buckets', None),
    ('length', None),
    ('layers', None),
    ('stack', None),
    ('mlp_activations', None),
)

# The methods' new axis names (each method module's AXIS_NAMES); their
# parameters are small, so replicated.
TASK_CONDITIONING_RULES: AxisRules = tuple(
    (name, None) for name in methods.axis_names())


def logical_axis_rules(additional_rules: AxisRules = ()) -> AxisRules:
  """The project's logical axis rules.

  Args:
    additional_rules: rules that take precedence, as in t5x.

  Returns:
    `additional_rules`, t5x's standard rules, then the methods' names.
  """
  return tuple(additional_rules) + T5X_STANDARD_RULES + TASK_CONDITIONING_RULES


def parameter_shardings(params_axes, mesh: jax.sharding.Mesh,
                        rules: AxisRules | None = None):
  """The `NamedSharding` of every parameter.

  Args:
    params_axes: the init's `params_axes` collection.
    mesh: the device mesh.
    rules: logical axis rules; None: `logical_axis_rules()`.

  Returns:
    A tree of `NamedSharding`s shaped as the parameters.
  """
  logical = flax.core.unfreeze(nn_partitioning.get_axis_names(params_axes))
  return nn.logical_to_mesh_sharding(logical, mesh,
                                     rules or logical_axis_rules())


def create_mesh(data: int = -1, model: int = 1,
                devices: Optional[Sequence[jax.Device]] = None
                ) -> jax.sharding.Mesh:
  """A `('data', 'model')` device mesh.

  Axes are `Auto` (GSPMD propagation, as t5x's partitioner): JAX's explicit
  mode would demand an output sharding for every product whose contracted
  dimension is sharded. Each host's devices hold whole, contiguous rows.

  Args:
    data: data-parallel size; -1: the devices `model` leaves.
    model: model-parallel size.
    devices: the devices, default all; may be a TPU slice's from
      `jax.experimental.topologies`, to compile for it.

  Returns:
    The mesh.

  Raises:
    ValueError: sizes that do not divide the devices.
  """
  n = jax.device_count() if devices is None else len(devices)
  if data == -1:
    if n % model:
      raise ValueError(
          f'{n} devices do not divide into MESH_MODEL={model} parts: set '
          f'--gin.MESH_MODEL to a divisor of {n} (1 for data parallelism '
          'alone).')
    data = n // model
  if data * model != n:
    raise ValueError(f'Mesh MESH_DATA={data} x MESH_MODEL={model} needs '
                     f'{data * model} devices, found {n}: set MESH_DATA=-1 '
                     '(the devices MESH_MODEL leaves), or a MESH_DATA x '
                     f'MESH_MODEL of {n}.')
  auto = jax.sharding.AxisType.Auto
  try:
    mesh = jax.sharding.Mesh(_torus_order(data, model, devices),
                             ('data', 'model'), axis_types=(auto, auto))
    if _rows_by_host(mesh):
      return mesh
    # Else the torus order interleaves hosts along 'data' (v5e:4x4).
  except AssertionError:
    pass  # a TPU v4+ slice described a core a device: JAX orders only chips
  # Each host's devices together, in a contiguous run of 'data' (as t5x's
  # `get_mesh` keeps them): what every process's data shard needs.
  ordered = sorted(jax.devices() if devices is None else devices,
                   key=lambda d: (d.process_index, d.id))
  return jax.sharding.Mesh(np.asarray(ordered).reshape(data, model),
                           ('data', 'model'), axis_types=(auto, auto))


def _torus_order(data: int, model: int,
                 devices: Optional[Sequence[jax.Device]]) -> np.ndarray:
  """The devices as `[data, model]` in the torus order of `jax.make_mesh`.

  Each 'model' group lies on neighbouring chips; where no product of whole
  physical axes is `model`, a physical axis is split between the two.
  """
  try:
    return jax.make_mesh((data, model), ('data', 'model'),
                         devices=devices).devices
  except NotImplementedError:
    return mesh_utils.create_device_mesh((data, model), devices,
                                         allow_split_physical_axes=True)


def _rows_by_host(mesh: jax.sharding.Mesh) -> bool:
  """Whether every process's devices hold whole, contiguous batch rows."""
  try:
    multihost.data_layout(mesh)
  except ValueError:
    return False
  return True
