"""Where the model runs: the traced program's mesh, platform and batch split.

The model's 'auto' forms (`T5Config.gradient_form`, the relative position
bias's, HyperPrompt's and HyperGrid's packed forms) follow the platform the
program is compiled for: its mesh's devices (a TPU slice's when a CPU host
compiles for one, `benchmarks/tpu_compile.py`), not JAX's default backend.
Layers that lay tokens out per data shard (`task_blocks`, HyperGrid's
grouped matmul) read the batch's split here.
"""

import math
from typing import Any, Optional

from flax.linen import partitioning as nn_partitioning
import jax

try:  # t5x's `with mesh:` context; deprecated in JAX, absent from later ones
  from jax.interpreters import pxla  # pylint: disable=g-import-not-at-top
except ImportError:
  pxla = None


def current_mesh() -> Optional[Any]:
  """The mesh of `jax.set_mesh` or t5x's `with mesh:`; None outside one."""
  mesh = jax.sharding.get_abstract_mesh()
  resources = getattr(pxla, 'thread_resources', None)
  if mesh.empty and resources is not None:
    mesh = resources.env.physical_mesh  # t5x's `with mesh:`
  return None if mesh.empty else mesh


def _target_device() -> Optional[Any]:
  """A device of the mesh the model runs on; None outside one."""
  mesh = current_mesh()
  return None if mesh is None else getattr(
      mesh, 'abstract_mesh', mesh).abstract_device


def target_platform() -> str:
  """The platform compiled for: the mesh's devices', else JAX's default."""
  device = _target_device()
  return jax.default_backend() if device is None else device.platform


def target_device_kind() -> str:
  """The device kind compiled for ('TPU v3', ...), as `target_platform`."""
  device = _target_device()
  return (jax.devices()[0].device_kind if device is None
          else device.device_kind)


def batch_split() -> Optional[tuple[Any, tuple[str, ...]]]:
  """`(mesh, axes)`: the current mesh and the axes 'batch' maps to, or None.

  None outside a mesh or where the axis rules do not split 'batch'.
  """
  mesh = current_mesh()
  if mesh is None:
    return None
  axes = nn_partitioning.logical_to_mesh_axes(('batch',))[0]
  if axes is None:
    return None
  return mesh, ((axes,) if isinstance(axes, str) else tuple(axes))


def batch_shards(rows: int) -> int:
  """The data shards of a batch of `rows`; 1 where they do not divide it."""
  split = batch_split()
  if split is None:
    return 1
  mesh, axes = split
  shards = math.prod(mesh.shape[a] for a in axes)
  return shards if rows % shards == 0 else 1


def batch_axes(rows: int) -> Optional[tuple[str, ...]]:
  """The mesh axes of a batch of `rows`, for `shard_map`; None if unsplit."""
  return batch_split()[1] if batch_shards(rows) > 1 else None
