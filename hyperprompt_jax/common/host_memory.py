"""Host memory that a JAX program on the CPU allocates anew at every step.

XLA's CPU runtime `malloc`s each execution's buffers and frees them when it
ends. glibc's `malloc` hands large blocks to the kernel (`mmap`) and returns
them on `free`, and trims the top of its heap, so every step faults its
temporaries in as fresh pages, a cost of the allocator, not the model, that
skews timings (docs/operations.md, "This machine").

`reuse_freed_memory` sets two of glibc's `mallopt` parameters (no `mmap`
for large blocks, no heap trimming) so the next step reuses freed blocks;
the process keeps its peak allocation, as a TPU or GPU runtime keeps its
device memory. `reuse_freed_memory_on_cpu` does this only where JAX
computes on the CPU: an accelerator host's memory goes on the input
pipeline and checkpoints, where returning it is worth more. `mallopt` is
glibc's own switch, callable once the process runs, unlike jemalloc or
tcmalloc, which must be preloaded.
"""

import ctypes
import ctypes.util
import logging
import os

import jax

log = logging.getLogger('hyperprompt_jax')

# glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# The environment variables by which glibc reads malloc parameters when the
# process starts: a process started with any of them set keeps its own.
_GLIBC_MALLOC_ENV = ('MALLOC_MMAP_MAX_', 'MALLOC_TRIM_THRESHOLD_',
                     'MALLOC_MMAP_THRESHOLD_', 'MALLOC_TOP_PAD_')


def _chosen_by_environment() -> str:
  """Why the environment already decides the allocator's behaviour, or ''."""
  for name in _GLIBC_MALLOC_ENV:
    if name in os.environ:
      return name
  if 'glibc.malloc' in os.environ.get('GLIBC_TUNABLES', ''):
    return 'GLIBC_TUNABLES'
  if os.environ.get('LD_PRELOAD'):  # e.g. jemalloc or tcmalloc
    return 'LD_PRELOAD'
  return ''


def reuse_freed_memory() -> bool:
  """Lets glibc's `malloc` keep freed blocks for reuse.

  Returns:
    Whether it was set: False without glibc, or where the environment sets
    the allocator (glibc's MALLOC_*_ variables, GLIBC_TUNABLES, LD_PRELOAD).
  """
  reason = _chosen_by_environment()
  if reason:
    log.info('Host memory: left to the environment (%s).', reason)
    return False
  name = ctypes.util.find_library('c')
  try:
    mallopt = ctypes.CDLL(name).mallopt
  except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS)
    return False
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  # M_TRIM_THRESHOLD is an int here and a size_t inside glibc: -1 is the
  # largest size, never reached.
  return bool(mallopt(_M_MMAP_MAX, 0)) and bool(
      mallopt(_M_TRIM_THRESHOLD, -1))


def reuse_freed_memory_on_cpu() -> bool:
  """`reuse_freed_memory` if JAX computes on the CPU.

  It initialises JAX's backends: call it after `jax.distributed.initialize`.
  """
  if jax.default_backend() != 'cpu':
    return False
  return reuse_freed_memory()
