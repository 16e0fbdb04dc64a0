"""TPU slices as users name them and as libtpu compiles for them (no TPU).

`--topology` is a gcloud accelerator type (`v3-32`, `v4-16`, `v5p-64`,
`v5litepod-16` / `v5e-16`, `v6e-64`: `parse_slice` maps it to its chips'
layout, `v3-32` -> `v3:4x4`) or a `jax.experimental.topologies` name;
`topology_devices` gives the slice's devices from libtpu (the `[tpu]` extra).

A TPU v3 chip shows its two TensorCores as two devices, each with half the
chip's HBM: `v3:4x4` (`v3-32`) is 16 chips, 32 devices of 16 GiB. A v4 or
v5p chip is one device of two cores (megacore), as JAX sees it on a pod:
a v4 slice is compiled for so (libtpu's default v4 description is two
devices a chip, which no v4 pod runs).
"""

import dataclasses
import importlib.util
import math
import os
import re
from typing import Any, Optional, Sequence

import jax

GIB = 2**30
# HBM of one chip in GiB by a lower-case piece of `jax.Device.device_kind`
# (the first that matches; Google Cloud's TPU pages). A device is a
# TensorCore where a chip shows two (TPU v3): it has its share.
HBM_GIB = (
    ('tpu v2', 16),
    ('tpu v3', 32),
    ('tpu v4', 32),
    ('tpu v5 lite', 16),  # v5e
    ('tpu v5', 95),       # v5p
    ('tpu v6 lite', 32),  # v6e
)


@dataclasses.dataclass(frozen=True)
class Slice:
  """A TPU slice as the user wrote it and as `jax.experimental.topologies`
  names it (`topology`, with the topology options it needs: a one-chip
  host's bounds, v4's megacore)."""
  given: str      # 'v3-32', 'v5litepod-4', or a topology name: 'v3:4x4'
  topology: str   # 'v3:4x4'
  chips: int
  options: tuple[tuple[str, Any], ...] = ()


# gcloud accelerator types (`gcloud compute tpus accelerator-types list`):
# v2, v3, v4 and v5p count TensorCores, two a chip; v5e (v5litepod) and
# v6e count chips. The chips of each count, as laid out in the slice.
_PLANE = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8),
          64: (8, 8), 128: (8, 16), 256: (16, 16), 512: (16, 32),
          1024: (32, 32)}
# v4 and v5p slices grow one axis at a time, z first.
_CUBE = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4),
         64: (4, 4, 4), 128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8),
         1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16)}
# generation -> (topology prefix, TensorCores counted a chip, the counts
# gcloud offers, the chip layouts).
_ACCELERATOR_TYPES = {
    'v2': ('v2', 2, (8, 32, 128, 256, 512), _PLANE),
    'v3': ('v3', 2, (8, 32, 64, 128, 256, 512, 1024, 2048), _PLANE),
    'v4': ('v4', 2, tuple(2 * c for c in _CUBE), _CUBE),
    'v5p': ('v5p', 2, tuple(2 * c for c in _CUBE), _CUBE),
    'v5litepod': ('v5e', 1, (1, 4, 8, 16, 32, 64, 128, 256), _PLANE),
    'v5e': ('v5e', 1, (1, 4, 8, 16, 32, 64, 128, 256), _PLANE),
    'v6e': ('v6e', 1, (1, 4, 8, 16, 32, 64, 128, 256), _PLANE),
}
# A v4 chip's two TensorCores as one device, as a v4 pod runs (v5p's
# default already is).
_MEGACORE = (('chip_config_name', 'megacore'),)
_TOPOLOGY_NAME = re.compile(r'^(v2|v3|v4|v5p|v5e|v6e):(\d+(?:x\d+){1,2})$')
_ACCELERATOR_TYPE = re.compile(r'^(v2|v3|v4|v5p|v5litepod|v5e|v6e)-(\d+)$')
SLICE_FORMS = ('a gcloud accelerator type (v2-8, v3-32, v4-16, v5p-64, '
               'v5litepod-16 or v5e-16, v6e-64: v2 / v3 / v4 / v5p count '
               'TensorCores, two a chip; v5e / v6e count chips) or a '
               'jax.experimental.topologies name (v3:4x4, v4:2x2x4, v5e:4x4, '
               'v5p:4x4x4, v6e:8x8)')


def parse_slice(name: str) -> Slice:
  """The slice of a gcloud accelerator type (`v3-32` -> `v3:4x4`, 16
  chips) or of a topology name (kept as given); a pure function.

  Raises:
    ValueError: a name of neither form, or a count gcloud does not offer.
  """
  name = name.strip()
  m = _TOPOLOGY_NAME.match(name)
  if m:
    return Slice(name, name, math.prod(int(n) for n in m.group(2).split('x')),
                 _MEGACORE if m.group(1) == 'v4' else ())
  m = _ACCELERATOR_TYPE.match(name)
  if not m:
    raise ValueError(f'--topology={name}: not a TPU slice; give '
                     f'{SLICE_FORMS}.')
  prefix, per_chip, counts, layouts = _ACCELERATOR_TYPES[m.group(1)]
  count = int(m.group(2))
  if count not in counts:
    raise ValueError(
        f'--topology={name}: gcloud offers {m.group(1)}-N for N in '
        f'{list(counts)}; or give the slice as a topology name '
        f'({prefix}:AxB{"xC" if layouts is _CUBE else ""}).')
  shape = layouts[count // per_chip]
  # A one-chip host (v5litepod-1, v6e-1): libtpu's default host is 2x2.
  options = ((('chips_per_host_bounds', (1, 1, 1)),)
             if count // per_chip == 1 else ())
  if prefix == 'v4':
    options += _MEGACORE
  return Slice(name, f'{prefix}:{"x".join(map(str, shape))}',
               count // per_chip, options)


def topology_devices(topology: str) -> list[jax.Device]:
  """The devices of a TPU slice (`'v3:4x4'`, `'v3-32'`: `parse_slice`),
  compiled for, not opened."""
  tpu_slice = parse_slice(topology)
  os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')  # no TPU host metadata
  # No TPU is opened, so libtpu's one-process lock (/tmp/libtpu_lockfile)
  # need not keep another compiling process out.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  if importlib.util.find_spec('libtpu') is None:
    raise ValueError(f'--topology={topology}: the TPU compiler is not '
                     "installed: pip install -e '.[tpu]' (it brings libtpu).")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    return list(topologies.get_topology_desc(
        platform='tpu', topology_name=tpu_slice.topology,
        **dict(tpu_slice.options)).devices)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(
        f'--topology={topology}: libtpu gives no devices for '
        f'{tpu_slice.topology} ({e}); give {SLICE_FORMS}.') from e


def devices_per_chip(devices: Sequence[jax.Device]) -> int:
  """Devices a chip shows: 2 on TPU v2 / v3 (a device is a TensorCore),
  else 1 (v4 and v5p: one megacore device a chip)."""
  return len(devices) // len({tuple(d.coords) for d in devices})


def slice_header(topology: str, devices: Sequence[jax.Device]
                 ) -> dict[str, Any]:
  """The slice as given and as mapped: chips, devices, HBM a device and a
  chip."""
  tpu_slice = parse_slice(topology)
  per_chip = devices_per_chip(devices)
  hbm = device_hbm_bytes(devices)
  return {'given': tpu_slice.given, 'topology': tpu_slice.topology,
          'chips': len(devices) // per_chip, 'devices': len(devices),
          'devices_per_chip': per_chip, 'device_kind': devices[0].device_kind,
          'hbm_bytes_per_device': hbm,
          'hbm_bytes_per_chip': None if hbm is None else hbm * per_chip}


def device_hbm_bytes(devices: Sequence[jax.Device]) -> Optional[int]:
  """HBM of one device of the slice: the chip's (`HBM_GIB`) over the
  devices a chip shows (those at the same coordinates); None for an
  unknown kind."""
  kind = devices[0].device_kind.lower()
  chip = next((gib for piece, gib in HBM_GIB if piece in kind), None)
  if chip is None:
    return None
  coords = {tuple(d.coords) for d in devices}  # a chip's place in the torus
  return chip * GIB * len(coords) // len(devices)
