"""Where the model runs: the mesh of the program being traced, the platform
it is compiled for and how the batch is split over it.

The model's 'auto' forms (`T5Config.gradient_form`, the relative position
bias's, HyperPrompt's and HyperGrid's packed forms) follow the platform the
program is compiled for: the devices of its mesh, which a CPU host compiling for a TPU slice
(`benchmarks/tpu_compile.py`) sets to the slice's, not JAX's default
backend. Layers that lay tokens out per data shard (`task_blocks`,
HyperGrid's grouped matmul) read the batch's split here.
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
  """The mesh where the model runs: that of `jax.set_mesh`, or of t5x's
  partitioner (`with mesh:`); None outside a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  resources = getattr(pxla, 'thread_resources', None)
  if mesh.empty and resources is not None:
    mesh = resources.env.physical_mesh  # t5x's `with mesh:`
  return None if mesh.empty else mesh


def _target_device() -> Optional[Any]:
  mesh = current_mesh()
  return None if mesh is None else getattr(
      mesh, 'abstract_mesh', mesh).abstract_device


def target_platform() -> str:
  """The platform the model is compiled for, which picks its 'auto' forms:
  the devices' of the mesh it runs on (a TPU slice's when a CPU host
  compiles for one: `benchmarks/tpu_compile.py`), else JAX's default
  backend."""
  device = _target_device()
  return jax.default_backend() if device is None else device.platform


def target_device_kind() -> str:
  """The kind of device the model is compiled for ('TPU v3', 'TPU v5
  lite', ...), as `target_platform` finds it."""
  device = _target_device()
  return (jax.devices()[0].device_kind if device is None
          else device.device_kind)


def batch_split() -> Optional[tuple[Any, tuple[str, ...]]]:
  """`(mesh, axes)`: the mesh where the model runs (`current_mesh`) and its
  axes the logical axis 'batch' maps to under the current axis rules
  (`flax.linen.partitioning.axis_rules`); None outside a mesh or where
  'batch' is not split."""
  mesh = current_mesh()
  if mesh is None:
    return None
  axes = nn_partitioning.logical_to_mesh_axes(('batch',))[0]
  if axes is None:
    return None
  return mesh, ((axes,) if isinstance(axes, str) else tuple(axes))


def batch_shards(rows: int) -> int:
  """The data shards a batch of `rows` is split into where the model runs
  (`batch_split`); 1 outside a mesh, or where they do not divide `rows`."""
  split = batch_split()
  if split is None:
    return 1
  mesh, axes = split
  shards = math.prod(mesh.shape[a] for a in axes)
  return shards if rows % shards == 0 else 1


def batch_axes(rows: int) -> Optional[tuple[str, ...]]:
  """The mesh axes a batch of `rows` is split over (`batch_split`), for a
  `shard_map`'s specs; None where `batch_shards` is 1."""
  return batch_split()[1] if batch_shards(rows) > 1 else None
