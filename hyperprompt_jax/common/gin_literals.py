"""The plain gin files' settings, read without gin, for tools run without it.

Model sizes (gin/models/), method settings (gin/variants/) and task-id
spaces (gin/tasks/), e.g. for the MFU benchmark on a bare accelerator image.
A plain file holds imports, includes, macros and bindings whose values are
Python literals, macros or references on one line each (`NUM_TASKS = 8`,
`network.T5Config:` blocks, `a.b.c = %NAME`, `x = @module.Name()`); anything
else is an error naming the line. tests/test_mfu.py holds this equal to gin.
"""

import ast
import dataclasses
import os
import re
from typing import Any

from hyperprompt_jax import paths

_INCLUDE = re.compile(r"include\s+'([^']+)'")
_BLOCK = re.compile(r'([\w.]+):')
_MACRO = re.compile(r'([A-Z][A-Z0-9_]*)\s*=\s*(.+)')
_BINDING = re.compile(r'([\w.]+)\.(\w+)\s*=\s*(.+)')
_PARAMETER = re.compile(r'(\w+)\s*=\s*(.+)')
_REFERENCE = re.compile(r'@([\w.]+)\(\)')


@dataclasses.dataclass(frozen=True)
class Reference:
  """A binding's `@name()`: the configurable `name` with its own bindings."""
  name: str


def read(name: str) -> dict[str, dict[str, Any]]:
  """`{configurable: {parameter: value}}` of a shipped gin file, includes read.

  `name` is relative to the gin directory (e.g. 'models/t5_1_1_base.gin');
  macros are resolved, references given as `Reference`s.
  """
  macros, bindings = {}, {}
  _read_into(name, macros, bindings)
  return {configurable: {parameter: _value(text, macros, where)
                         for parameter, (text, where) in values.items()}
          for configurable, values in bindings.items()}


def _read_into(name: str, macros: dict, bindings: dict) -> None:
  """Adds the raw `(value text, file:line)` of `name`'s settings, in order."""
  path = os.path.join(paths.gin_dir(), name)
  block = None
  with open(path) as f:
    for number, line in enumerate(f, 1):
      text = line.strip()
      where = f'{path}:{number}'
      if not text or text.startswith(('#', 'from ', 'import ')):
        continue
      if line[0].isspace() and block is not None:
        match = _PARAMETER.fullmatch(text)
        if match:
          bindings[block][match[1]] = (match[2], where)
          continue
      block = None
      if match := _INCLUDE.fullmatch(text):
        _read_into(match[1], macros, bindings)
      elif match := _BLOCK.fullmatch(text):
        block = match[1]
        bindings.setdefault(block, {})
      elif match := _MACRO.fullmatch(text):
        macros[match[1]] = (match[2], where)
      elif match := _BINDING.fullmatch(text):
        bindings.setdefault(match[1], {})[match[2]] = (match[3], where)
      else:
        raise ValueError(f'{where}: {text!r} is not a one-line binding; read '
                         'this file with gin.')


def _value(text: str, macros: dict, where: str) -> Any:
  """A binding's value: a literal, a macro's value or a `Reference`."""
  if text.startswith('%'):
    if text[1:] not in macros:
      raise ValueError(f'{where}: the macro {text} is not set in the file '
                       'or its includes.')
    macro_text, macro_where = macros[text[1:]]
    return _value(macro_text, macros, macro_where)
  if match := _REFERENCE.fullmatch(text):
    return Reference(match[1])
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError) as e:
    raise ValueError(f'{where}: {text!r} is not a Python literal; read this '
                     'file with gin.') from e


def paper_task_file(variant_file: str) -> str:
  """The task file of the first paper setup (gin/setups/) of `variant_file`.

  Its task list sets the variant's T (HyperPrompt and the baselines: one GLUE
  or SuperGLUE run; HyperGrid: both).
  """
  setups = os.path.join(paths.gin_dir(), 'setups')
  for name in sorted(os.listdir(setups)):
    with open(os.path.join(setups, name)) as f:
      text = f.read()
    if f"include '{variant_file}'" in text:
      return re.search(r"include '(tasks/[^']+)'", text).group(1)
  raise ValueError(f'No paper setup in {setups} includes {variant_file}.')
