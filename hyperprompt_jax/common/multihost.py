"""Several JAX processes (a TPU pod, GPU hosts): start, data layout, agreeing.

Every host runs the same command; this module holds what that needs:

  - `initialize`: `jax.distributed.initialize` from flags or environment
    variables, or from the cluster's detection (`--multiprocess`), with a
    heartbeat timeout that ends every process soon after a peer is lost.
  - `data_layout`: which data shard each process reads (t5x's
    `get_data_layout` meaning), so the model axis may span processes.
  - `all_true`, `broadcast_json`, `raise_everywhere`: one process's
    decisions taken by all at once, so none acts alone or waits forever.
  - `host_value`: arrays as host numpy on every process.

See docs/operations.md, "Multi-host".
"""

import dataclasses
import json
import logging
import os
from typing import Any, Callable, Optional, TypeVar

import jax
from jax.experimental import multihost_utils
import numpy as np

from hyperprompt_jax.common import host_memory

log = logging.getLogger('hyperprompt_jax')

# A process that sends no heartbeat for this long is lost, and JAX's
# distributed service then ends every process: how long the other hosts of
# a broken run wait before they exit (below JAX's default; docs/operations.md,
# "Faults and recovery").
HEARTBEAT_TIMEOUT_S = 30

ENV_COORDINATOR = 'JAX_COORDINATOR_ADDRESS'  # read by JAX itself too
ENV_NUM_PROCESSES = 'JAX_NUM_PROCESSES'
ENV_PROCESS_ID = 'JAX_PROCESS_ID'


def _env_int(name: str) -> Optional[int]:
  """The integer environment variable `name`, or None if unset."""
  value = os.environ.get(name)
  if value in (None, ''):
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f'{name}={value!r} must be an integer.') from None


def initialize(coordinator_address: Optional[str] = None,
               num_processes: Optional[int] = None,
               process_id: Optional[int] = None,
               multiprocess: bool = False,
               heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> bool:
  """Joins the processes of a multi-host run, if this is one.

  Given neither settings nor `multiprocess`, a single process: nothing to do.

  Args:
    coordinator_address: else JAX_COORDINATOR_ADDRESS.
    num_processes: else JAX_NUM_PROCESSES.
    process_id: else JAX_PROCESS_ID.
    multiprocess: leave what is not given to JAX's cluster detection (TPU
      metadata, SLURM, Open MPI, k8s).
    heartbeat_timeout_s: how long a silent process is waited for.

  Returns:
    Whether `jax.distributed` was initialised.

  Raises:
    ValueError: an incomplete explicit setting (naming what is missing).
  """
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
  if num_processes is None:
    num_processes = _env_int(ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _env_int(ENV_PROCESS_ID)
  explicit = {'--coordinator_address': coordinator_address,
              '--num_processes': num_processes, '--process_id': process_id}
  given = [k for k, v in explicit.items() if v is not None]
  if not given and not multiprocess:
    return False
  if given and len(given) < 3 and not multiprocess:
    missing = [k for k, v in explicit.items() if v is None]
    raise ValueError(
        f'A multi-process run needs {", ".join(explicit)}; {", ".join(given)} '
        f'given, {", ".join(missing)} missing (or the environment variables '
        f'{ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}). On a TPU '
        'pod or under SLURM / Open MPI / k8s, --multiprocess alone lets JAX '
        'find them.')
  if num_processes is not None and num_processes < 1:
    raise ValueError(f'--num_processes={num_processes} must be >= 1.')
  if process_id is not None and num_processes is not None and not (
      0 <= process_id < num_processes):
    raise ValueError(f'--process_id={process_id} must be in [0, '
                     f'{num_processes}) for --num_processes={num_processes}.')
  jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes,
      process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_s)
  log.info('Process %d of %d (%d local devices of %d).', jax.process_index(),
           jax.process_count(), jax.local_device_count(), jax.device_count())
  return True


def initialize_from_flags(args) -> bool:
  """`initialize` from `gin_utils.add_distributed_flags`'s flags.

  Then, on the CPU, `host_memory.reuse_freed_memory_on_cpu`. Every command
  that computes starts here: JAX may be asked for its backend only once the
  processes have joined.
  """
  joined = initialize(args.coordinator_address, args.num_processes,
                      args.process_id, args.multiprocess,
                      args.heartbeat_timeout_seconds)
  host_memory.reuse_freed_memory_on_cpu()
  return joined


# -- the data layout ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataLayout:
  """Which shard of the training data each process reads.

  Attributes:
    num_shards: distinct data shards (the 'data' axis spread over processes).
    shard_index: this process's shard.
    shard_of_process: every process's shard, by process index.
    process_index: this process.
  """
  num_shards: int
  shard_index: int
  shard_of_process: tuple[int, ...]
  process_index: int = 0

  @property
  def process_count(self) -> int:
    """The number of processes."""
    return len(self.shard_of_process)

  def record(self) -> dict[str, Any]:
    """As saved in the run record (`run_record`)."""
    return {'DATA_SHARDS': self.num_shards,
            'PROCESS_COUNT': self.process_count,
            'SHARD_OF_PROCESS': list(self.shard_of_process)}


def data_layout(mesh: jax.sharding.Mesh, data_axis: str = 'data'
                ) -> DataLayout:
  """The data layout of `mesh` (t5x's `get_data_layout` meaning).

  The batch rows a process's devices hold along `data_axis` are its rows;
  processes holding the same rows read the same shard, each distinct set of
  rows being one shard, numbered in row order.

  Args:
    mesh: the device mesh.
    data_axis: its data-parallel axis.

  Returns:
    This process's `DataLayout`.

  Raises:
    ValueError: processes hold overlapping but different rows, or unequal
      or non-contiguous numbers of them (a mesh no shard layout fits).
  """
  axis = mesh.axis_names.index(data_axis)
  rows: dict[int, set[int]] = {}
  for index, device in np.ndenumerate(mesh.devices):
    rows.setdefault(device.process_index, set()).add(index[axis])
  groups = sorted({frozenset(r) for r in rows.values()}, key=min)
  covered = set()
  for group in groups:
    if covered & group or len(group) != len(groups[0]) or (
        max(group) - min(group) + 1 != len(group)):
      raise ValueError(
          f'The mesh {dict(mesh.shape)} gives processes overlapping or uneven '
          f'slices of the {data_axis!r} axis ({sorted(map(sorted, groups))}): '
          'choose MESH_MODEL so that it divides the devices of a host, or '
          'spans whole hosts.')
    covered |= group
  shard_of_process = tuple(groups.index(frozenset(rows[p]))
                           for p in sorted(rows))
  me = jax.process_index()
  return DataLayout(len(groups), shard_of_process[me], shard_of_process, me)


# -- agreeing -----------------------------------------------------------------


def all_true(value: bool, what: str = '') -> bool:
  """Whether `value` holds on every process (one process: `value`)."""
  if jax.process_count() == 1:
    return bool(value)
  del what  # the name helps a reader of the caller
  flags = multihost_utils.process_allgather(np.array([bool(value)]))
  return bool(np.all(flags))


def broadcast_json(value: Any) -> Any:
  """Process 0's `value` (JSON-serialisable) on every process."""
  if jax.process_count() == 1:
    return value
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  if jax.process_index() != 0:
    data = np.zeros((0,), np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(
      np.array(len(data), np.int32)))
  buffer = np.zeros((size,), np.uint8)
  buffer[:len(data)] = data
  data = multihost_utils.broadcast_one_to_all(buffer)
  return json.loads(np.asarray(data, np.uint8).tobytes().decode())


E = TypeVar('E', bound=Exception)


def raise_everywhere(fn: Callable[[], Any], error_type: type[E],
                     on_process_0_only: bool = True) -> None:
  """Runs `fn`; if it raised `error_type` anywhere, raises it everywhere.

  The same message, at once on every process, so none goes on or waits
  alone.

  Args:
    fn: the check.
    error_type: the exception to pass on.
    on_process_0_only: run `fn` on process 0 only, else on every process.
  """
  message = None
  if not on_process_0_only or jax.process_index() == 0:
    try:
      fn()
    except error_type as e:  # pylint: disable=broad-except
      if jax.process_count() == 1:
        raise
      message = str(e)
  if jax.process_count() == 1:
    return
  if on_process_0_only:
    message = broadcast_json(message)
  else:
    messages = [m for m in _allgather_json(message) if m]
    message = messages[0] if messages else None
  if message is not None:
    raise error_type(message)


def _allgather_json(value: Any) -> list[Any]:
  """Every process's JSON-serialisable `value`, by process index."""
  mine = np.frombuffer(json.dumps(value).encode(), np.uint8)
  sizes = np.ravel(multihost_utils.process_allgather(
      np.array([len(mine)], np.int32)))
  buffer = np.zeros((1, int(np.max(sizes))), np.uint8)
  buffer[0, :len(mine)] = mine
  rows = np.asarray(multihost_utils.process_allgather(buffer))
  rows = rows.reshape(len(sizes), -1)
  return [json.loads(row[:size].tobytes().decode())
          for row, size in zip(rows, sizes)]


def sync(name: str) -> None:
  """Every process waits here for the others."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def is_writer() -> bool:
  """Whether this process writes the run's files (process 0)."""
  return jax.process_index() == 0


# -- host values --------------------------------------------------------------


def host_value(tree: Any) -> Any:
  """`tree`'s arrays as host numpy on every process, gathered if need be."""
  def fetch(x):
    if not isinstance(x, jax.Array):
      return np.asarray(x)
    if x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(fetch, tree)


def fully_addressable(tree: Any) -> bool:
  """Whether this process can read every array of `tree` by itself."""
  return all(x.is_fully_addressable or x.is_fully_replicated
             for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))
