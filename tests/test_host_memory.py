"""host_memory: freed host blocks kept for reuse, counted by the kernel."""

import ctypes
import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest

from hyperprompt_jax.common import host_memory

BLOCK_MB = 256
PAGES = BLOCK_MB * 2**20 // os.sysconf('SC_PAGE_SIZE')

# A child process: mallocs a block over glibc's 32 MB mmap limit, writes it,
# frees it, mallocs and writes one again, and prints the kernel's count of
# page faults of the second round (fresh pages fault once each). Transparent
# huge pages are off for the child (prctl PR_SET_THP_DISABLE), so a fresh
# page is one page of SC_PAGE_SIZE whatever the machine's THP setting.
_CHILD = textwrap.dedent(f"""
    import ctypes, resource, sys
    from hyperprompt_jax.common import host_memory
    libc = ctypes.CDLL({ctypes.util.find_library('c')!r})
    assert libc.prctl(41, 1, 0, 0, 0) == 0
    if sys.argv[1] == 'reuse':
      assert host_memory.reuse_freed_memory()
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = (ctypes.c_void_p,)
    size = {BLOCK_MB} << 20
    def write_block():
      block = libc.malloc(size)
      ctypes.memset(block, 1, size)
      return block
    libc.free(write_block())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = write_block()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    libc.free(block)
""")


def _is_glibc() -> bool:
  try:
    ctypes.CDLL(ctypes.util.find_library('c')).gnu_get_libc_version
  except (OSError, AttributeError, TypeError):
    return False
  return True


def _second_block_faults(mode: str) -> int:
  env = {k: v for k, v in os.environ.items()
         if k not in host_memory._GLIBC_MALLOC_ENV
         and k not in ('GLIBC_TUNABLES', 'LD_PRELOAD')}
  out = subprocess.run([sys.executable, '-c', _CHILD, mode], env=env,
                       capture_output=True, text=True, check=True)
  return int(out.stdout.split()[-1])


@pytest.mark.skipif(not _is_glibc(), reason='mallopt is glibc\'s')
def test_a_freed_block_is_reused_without_page_faults():
  # glibc's default: the block is mmapped anew, every page faults again.
  assert _second_block_faults('default') >= 0.9 * PAGES
  # Kept: the second block is the first one's memory, already mapped.
  assert _second_block_faults('reuse') <= 0.05 * PAGES


@pytest.mark.parametrize('name,value', [
    ('MALLOC_MMAP_MAX_', '65536'), ('MALLOC_TRIM_THRESHOLD_', '131072'),
    ('GLIBC_TUNABLES', 'glibc.malloc.hugetlb=1'),
    ('LD_PRELOAD', 'libjemalloc.so.2')])
def test_the_environment_keeps_its_own_allocator_settings(monkeypatch, name,
                                                          value):
  monkeypatch.setenv(name, value)
  assert not host_memory.reuse_freed_memory()


def test_only_on_the_cpu(monkeypatch):
  calls = []
  monkeypatch.setattr(host_memory, 'reuse_freed_memory',
                      lambda: calls.append(1) or True)
  monkeypatch.setattr(host_memory.jax, 'default_backend', lambda: 'tpu')
  assert not host_memory.reuse_freed_memory_on_cpu()
  monkeypatch.setattr(host_memory.jax, 'default_backend', lambda: 'cpu')
  assert host_memory.reuse_freed_memory_on_cpu()
  assert calls == [1]
