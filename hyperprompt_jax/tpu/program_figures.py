"""What a program compiled for a TPU slice holds and does, read from XLA.

`figures`, for one device (the SPMD program every device runs): arguments,
outputs, temporaries, aliased (donated) and their total (arguments +
outputs + temporaries - aliased: `memory_analysis()`) against the HBM;
FLOPs and bytes accessed (`cost_analysis()`: a loop's body counted once, so
where the compiler keeps a step's microbatches or MetaBalance's shares as a
loop one part is counted; `loops` says how many the module holds); from the
optimized module's text (`hlo_summary`) the collectives by kind, the
scatters and gathers (the large ones with their shape and the op that made
them), host callbacks and the instructions that touch the most bytes
(`largest`); with the lowered arguments, what a chip holds of each
(`argument_shards`); `per_chip`: the memory of a chip of several devices.
"""

import collections
import math
import os
import re
from typing import Any, Optional, Sequence

import flax
from flax.linen import partitioning as nn_partitioning
import jax
import numpy as np

from hyperprompt_jax import files

# The collective ops of an optimized HLO module (an async pair counts by its
# start).
COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all',
               'collective-permute', 'all-reduce-start', 'all-gather-start',
               'collective-permute-start')
# A gather or scatter under this many bytes is left out of the lists (an
# index's lookup in a small table; the count still has it).
LARGE_BYTES = 1 << 20

_INSTRUCTION = re.compile(
    r'^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*'
    r'(?P<shape>\(.*?\)|\S+)\s+'
    r'(?P<op>[a-z][\w\-]*)\(', re.MULTILINE)
_ARRAY = re.compile(r'\b(pred|s4|u4|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|'
                    r'u64|f64|c64|c128|f8e\w+)\[([\d,]*)\]')
_ITEM_BITS = {'pred': 8, 's4': 4, 'u4': 4, 's8': 8, 'u8': 8, 's16': 16,
              'u16': 16, 'f16': 16, 'bf16': 16, 's32': 32, 'u32': 32,
              'f32': 32, 's64': 64, 'u64': 64, 'f64': 64, 'c64': 64,
              'c128': 128}
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# A computation's first line (`%fused_computation.3 (param_0: ...) -> ... {`,
# `ENTRY %main ... {`), the computations an instruction calls, an operand.
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_CALLED = re.compile(r'(?:calls|to_apply)=%?([\w.\-]+)')
_OPERAND = re.compile(r'%([\w.\-]+)')
_LAYOUT = re.compile(r'\{[^{}]*\}')
# Instructions that move no data of their own.
_BOOKKEEPING = frozenset({'parameter', 'constant', 'get-tuple-element',
                          'tuple', 'bitcast', 'after-all', 'partition-id',
                          'replica-id', 'copy-done', 'all-gather-done',
                          'all-reduce-done', 'collective-permute-done',
                          'while', 'conditional', 'call'})
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
# What a host callback leaves in an optimized module: send / recv host
# transfers (jax's callbacks on TPU), or a callback custom call (CPU, GPU).
_HOST_TRANSFER = re.compile(r'is_host_transfer=true')
_CALLBACK_TARGET = re.compile(
    r'custom_call_target="([^"]*(?:callback|python)[^"]*)"', re.IGNORECASE)


def array_bytes(shape_text: str) -> int:
  """Bytes of the arrays an HLO shape names (`bf16[8,128]{1,0}`, or a
  tuple of them)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape_text):
    count = math.prod(int(d) for d in dims.split(',') if d)
    total += count * _ITEM_BITS.get(dtype, 8) // 8
  return total


def host_callbacks(text: str) -> list[str]:
  """The host transfers and callback custom calls of an HLO module."""
  return (_CALLBACK_TARGET.findall(text)
          + [m.group(0) for m in _HOST_TRANSFER.finditer(text)])


def _plain(shape: str) -> str:
  """An HLO shape without its layouts: `(bf16[8,128], f32[8])`."""
  return _LAYOUT.sub('', shape)


def _where(line: str) -> str:
  """The jax op and source line an HLO instruction came from."""
  op = _OP_NAME.search(line)
  source = _SOURCE.search(line)
  where = op.group(1) if op else '?'
  if source:
    where += f' ({os.path.basename(source.group(1))}:{source.group(2)})'
  return where


def hlo_summary(text: str, top: int = 12) -> dict[str, Any]:
  """What an optimized HLO module does beyond its arithmetic: collectives
  by kind (`{op: {'count', 'bytes'}}`, bytes of their results), the count
  of scatters and gathers and the large ones (`LARGE_BYTES`: shape, bytes,
  the op that made them), its loops (XLA's cost analysis counts a loop's
  body once), host callbacks, and the `top` instructions the program
  schedules (fusions, copies, collectives: not those inside a fusion) that
  touch the most bytes (`largest`: their result and operands)."""
  collectives = collections.defaultdict(lambda: {'count': 0, 'bytes': 0})
  counts = collections.Counter()
  large = {'scatter': [], 'gather': []}
  loops = 0
  instructions = []  # (computation, match, line)
  computation = None
  for line in text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    instructions.append((computation, m, line))
    op = m.group('op')
    if op in COLLECTIVES:
      kind = collectives[op.removesuffix('-start')]
      kind['count'] += 1
      kind['bytes'] += array_bytes(m.group('shape'))
    elif op in large:
      counts[op] += 1
      size = array_bytes(m.group('shape'))
      if size >= LARGE_BYTES:
        large[op].append({'shape': _plain(m.group('shape')),
                          'bytes': size, 'from': _where(line)})
    elif op == 'while':
      loops += 1
  return {'collectives': dict(collectives),
          'scatters': counts['scatter'], 'gathers': counts['gather'],
          'large_scatters': large['scatter'], 'large_gathers': large['gather'],
          'loops': loops, 'host_callbacks': host_callbacks(text),
          'largest': _largest(instructions, top)}


def _largest(instructions, top: int) -> list[dict[str, Any]]:
  """The scheduled instructions (those of computations no fusion or
  reduction calls: the entry's, a loop's body) that touch the most bytes:
  result + operands, a loop's body counted once."""
  sizes = {m.group('name'): array_bytes(m.group('shape'))
           for _, m, _ in instructions}
  inner = set()
  for _, _, line in instructions:
    inner.update(_CALLED.findall(line))
  rows = []
  for computation, m, line in instructions:
    op = m.group('op')
    if computation in inner or op in _BOOKKEEPING:
      continue
    operands = line[m.end():].split(')', 1)[0]
    size = sizes[m.group('name')] + sum(
        sizes.get(name, 0) for name in _OPERAND.findall(operands))
    rows.append({'op': op, 'bytes': size,
                 'shape': _plain(m.group('shape'))[:160],
                 'from': _where(line)})
  return sorted(rows, key=lambda r: -r['bytes'])[:top]


def figures(compiled, seconds: float, hbm_bytes: Optional[int] = None,
            args: Any = None, param_axes: Optional[dict] = None,
            hlo_path: Optional[str] = None) -> dict[str, Any]:
  """A compiled program's figures for one chip (the module docstring), and
  with `args` (the abstract arguments it was lowered for) what a chip holds
  of each (`argument_shards`). The optimized module's text goes to
  `hlo_path` where one is given."""
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
    cost = cost[0]
  sizes = {k: getattr(memory, f'{k}_size_in_bytes') for k in (
      'argument', 'output', 'alias', 'temp', 'generated_code')}
  total = (sizes['argument'] + sizes['output'] + sizes['temp']
           - sizes['alias'])
  text = compiled.as_text()
  if hlo_path:
    files.write_atomically(hlo_path, text)
  out = {
      'compile_s': round(seconds, 1),
      'memory': dict(sizes, total=total),
      'hbm_bytes': hbm_bytes,
      'fits': None if hbm_bytes is None else total <= hbm_bytes,
      'flops': cost.get('flops'),
      'bytes_accessed': cost.get('bytes accessed'),
      **hlo_summary(text),
  }
  if args is not None:
    out['arguments'] = argument_shards(compiled, args, param_axes or {})
  return out


def per_chip(program: dict[str, Any], cores: int) -> dict[str, Any]:
  """A program's memory a chip holds (bytes): each of its `cores` devices
  (TensorCores) runs the same SPMD program, so a chip holds `cores` times
  one device's arguments, temporaries and total, against `cores` times a
  device's HBM."""
  memory = program['memory']
  hbm = program.get('hbm_bytes')
  return {'devices': cores,
          **{k: memory[k] * cores
             for k in ('argument', 'output', 'temp', 'alias', 'total')},
          'hbm_bytes': None if hbm is None else hbm * cores}


def argument_shards(compiled, args: Any, param_axes: dict[str, list]
                    ) -> list[dict[str, Any]]:
  """Per argument leaf: its path, shape, dtype, the logical axes of a
  parameter (`param_axes`, by path), and as the program takes it on a chip:
  its shard's shape and the shard laid out (`tiled`: in the layout's order,
  minor dimensions padded to its tile: what the chip allocates); `pruned`
  for an argument the program does not use."""
  formats = jax.tree.leaves(compiled.input_formats[0])
  leaves = jax.tree_util.tree_leaves_with_path(args)
  assert len(formats) == len(leaves), (len(formats), len(leaves))
  out = []
  for (path, leaf), fmt in zip(leaves, formats):
    path = jax.tree_util.keystr(path)
    argument = {'path': path, 'shape': list(leaf.shape),
                'dtype': str(leaf.dtype),
                'itemsize': np.dtype(leaf.dtype).itemsize,
                'axes': param_axes.get(path)}
    if fmt.layout is None:
      out.append(dict(argument, pruned=True))
      continue
    shard = fmt.sharding.shard_shape(leaf.shape)
    layout = fmt.layout
    out.append(dict(
        argument, pruned=False, shard=list(shard),
        tiled=list(_tiled([shard[i] for i in layout.major_to_minor],
                          layout.tiling[0] if layout.tiling else ()))))
  return out


def _tiled(physical, tile) -> tuple[int, ...]:
  """A shape in its layout's order (major to minor) with its minor
  dimensions rounded up to the layout's tile (a scalar is one element)."""
  shape = list(physical) or [1]
  tile = list(tile)[-len(shape):] if tile else []
  offset = len(shape) - len(tile)
  for i, t in enumerate(tile):
    shape[offset + i] = -(-shape[offset + i] // t) * t
  return tuple(shape)


def param_axes_by_path(params_axes: Any, prefix: Sequence[Any]
                       ) -> dict[str, list]:
  """keystr of each parameter (under `prefix`, its place among a program's
  arguments) -> its logical axis names."""
  names = nn_partitioning.get_axis_names(params_axes)
  return {jax.tree_util.keystr(tuple(prefix) + path): list(axes)
          for path, axes in jax.tree_util.tree_leaves_with_path(
              flax.core.unfreeze(names),
              is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))}
