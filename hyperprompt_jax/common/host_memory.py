"""Host memory that a JAX program on the CPU allocates anew at every step.

XLA's CPU runtime allocates each execution's buffers with `malloc` and
frees them when the execution ends, gigabytes of temporaries a training
step. glibc's `malloc`
hands any block over 32 MB straight to the kernel (`mmap`) and returns it
(`munmap`) on `free`, and gives back the top of its heap once more than
128 kB of it is free, so every step touches its temporaries as fresh
pages: millions of page faults a step, a third of the step's CPU time in
the kernel (docs/operations.md has the measurement). The cost is the
allocator's, not the model's: it grows with a step's temporaries and with
what else the process holds, so it skews side-by-side timings, and a TPU or
GPU runtime keeps its device memory.

`reuse_freed_memory` sets two of glibc's `mallopt` parameters so that freed
blocks stay with the process and the next step reuses them: no `mmap` for
large blocks (they come from the heap) and no trimming of the heap. The
process then keeps its peak allocation for its lifetime, as a TPU or GPU
runtime keeps its device memory. `reuse_freed_memory_on_cpu` does this
only where JAX computes on the CPU: a TPU or GPU host's own memory goes on
the input pipeline and checkpoints, where returning it is worth more.

Not an allocator of its own (jemalloc and tcmalloc keep freed memory too,
but are not on every machine and must be preloaded before the process
starts): `mallopt` is glibc's own switch, callable once the process runs.
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
  """Lets glibc's `malloc` keep freed blocks for reuse (module docstring).
  Returns whether it was set: False without glibc, or where the environment
  sets the allocator (glibc's MALLOC_*_ variables or GLIBC_TUNABLES malloc
  parameters, or LD_PRELOAD)."""
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
  """`reuse_freed_memory` if JAX computes on the CPU. Initialises JAX's
  backends: call it after `jax.distributed.initialize`."""
  if jax.default_backend() != 'cpu':
    return False
  return reuse_freed_memory()
