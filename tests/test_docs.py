"""Every command the README and docs/ show can run as written.

From README.md and docs/*.md this reads every command line of a code block
(backslash continuations joined) and every inline code span that runs one of
the project's commands, and checks, for each:

- `python -m hyperprompt_jax.<module>`: the module exists and is runnable;
  every `--gin_file` resolves (against `--gin_search_paths` and the shipped
  gin directory) and the files parse together, with the command's `--gin.X=Y`
  bindings (each macro must be defined by the files, as the commands
  require); every `--flag` is one the command's own parser knows (built as
  `gin_utils.parse_command_line` builds it, from the `add_flags` its `main`
  passes to `gin_utils.command_flags`);
- `python launch/<script>.py`: the script exists, its parser knows every
  flag, and its gin files resolve (and parse, for the built-in runner);
- `python -m t5x.<script>`: the project's gin files it names exist (t5x
  itself may be absent).

Values are not judged where they are placeholders (`...`, `<dir>`, `$VAR`);
flags in `[...]` (optional) are checked like the others. Nothing is compiled
or trained. The documents also must not cite the papers by internal file and
line, their links must resolve, the paths and `hyperprompt_jax.` names in
their inline code must exist, the README must show CI's install and test
lines, docs/layout.md's tree must name every source file, and docs/gin.md
or docs/t5x.md every run file.
"""

import argparse
import dataclasses
import importlib
import importlib.util
import itertools
import pathlib
import re
import shlex
import sys
from typing import Optional

import gin
import pytest

from hyperprompt_jax import paths
from hyperprompt_jax.common import gin_utils

ROOT = pathlib.Path(__file__).resolve().parents[1]
GIN_DIR = pathlib.Path(paths.gin_dir())


def _documents(root: pathlib.Path) -> list[pathlib.Path]:
  return [root / 'README.md', *sorted((root / 'docs').glob('*.md'))]


DOCS = _documents(ROOT)


# ---------------------------------------------------------------------------
# Reading the documents.

_FENCE = re.compile(r'^\s*(```|~~~)')


def _split_fences(text: str) -> tuple[list[tuple[int, str]], str]:
  """(the lines of the fenced code blocks with their 1-based numbers, the
  text outside them with every fenced line blanked, so offsets keep their
  line numbers)."""
  code, prose, fence = [], [], None
  for number, line in enumerate(text.splitlines(), 1):
    match = _FENCE.match(line)
    if fence is None and match:
      fence = match.group(1)
      prose.append('')
    elif fence is not None and match and match.group(1) == fence:
      fence = None
      prose.append('')
    elif fence is not None:
      code.append((number, line))
      prose.append('')
    else:
      prose.append(line)
  return code, '\n'.join(prose)


def _logical_lines(code: list[tuple[int, str]]) -> list[tuple[int, str]]:
  """Code lines with backslash continuations joined, each with the number of
  its first line."""
  out, start, parts, previous = [], None, [], None
  for number, line in code:
    if parts and previous is not None and number != previous + 1:
      out.append((start, ' '.join(parts)))  # the block ended mid-command
      parts = []
    if not parts:
      start = number
    previous = number
    stripped = line.rstrip()
    if stripped.endswith('\\'):
      parts.append(stripped[:-1].strip())
      continue
    parts.append(stripped.strip())
    out.append((start, ' '.join(parts)))
    parts = []
  if parts:
    out.append((start, ' '.join(parts)))
  return out


def _inline_spans(prose: str) -> list[tuple[int, str]]:
  """Inline code spans (`...`) of the prose, whitespace collapsed, each with
  its line number."""
  spans = []
  for match in re.finditer(r'(?<!`)`([^`]+)`(?!`)', prose):
    line = prose.count('\n', 0, match.start()) + 1
    spans.append((line, ' '.join(match.group(1).split())))
  return spans


@dataclasses.dataclass(frozen=True)
class Command:
  doc: str        # the document, relative to the checkout
  line: int       # where the command starts in it
  kind: str       # 'hyperprompt_jax', 'launch' or 't5x'
  target: str     # the module after `-m`, or the launch script's path
  args: tuple     # the words after it
  text: str       # the whole line, for messages

  @property
  def id(self) -> str:
    return f'{self.doc}:{self.line}:{self.target}'


_PYTHON = re.compile(r'^(.*/)?python(3(\.\d+)?)?$')
_NESTED = re.compile(r'\$\(([^()]*)\)')


def _words(line: str) -> Optional[list[str]]:
  """Shell words of `line`, comments dropped, `;`, `&&`, `|` kept as words
  of their own; None when the line is not shell (unbalanced quotes)."""
  lexer = shlex.shlex(line, posix=True, punctuation_chars='|&;')
  lexer.whitespace_split = True
  lexer.commenters = '#'
  try:
    return list(lexer)
  except ValueError:
    return None


def _commands_in(line: str) -> list[tuple[str, str, list[str]]]:
  """(kind, target, args) of every command `line` runs, commands inside
  `$(...)` included."""
  words = _words(line)
  if words is None:
    return []
  found = []
  for word in words:
    for nested in _NESTED.findall(word):
      found += _commands_in(nested)
  simple = []
  for is_operator, group in itertools.groupby(
      words, lambda w: bool(w) and set(w) <= set('|&;')):
    if not is_operator:
      simple.append(list(group))
  for command in simple:
    for i, word in enumerate(command):
      if not _PYTHON.match(word) or i + 1 >= len(command):
        continue
      if command[i + 1] == '-m' and i + 2 < len(command):
        module = command[i + 2]
        if module.startswith('hyperprompt_jax.'):
          found.append(('hyperprompt_jax', module[len('hyperprompt_jax.'):],
                        command[i + 3:]))
        elif module.startswith('t5x.'):
          found.append(('t5x', module, command[i + 3:]))
      elif command[i + 1].startswith('launch/'):
        found.append(('launch', command[i + 1], command[i + 2:]))
      break
  return found


def extract_commands(path: pathlib.Path, root: pathlib.Path) -> list[Command]:
  """Every command `path` shows, in code blocks and inline code."""
  code, prose = _split_fences(path.read_text(encoding='utf-8'))
  candidates = _logical_lines(code) + [
      (line, span) for line, span in _inline_spans(prose)
      if re.search(r'python3? (-m |launch/)', span)]
  doc = path.relative_to(root).as_posix()
  commands = []
  for line, text in candidates:
    for kind, target, args in _commands_in(text):
      commands.append(Command(doc, line, kind, target, tuple(args), text))
  return commands


COMMANDS = [c for doc in DOCS for c in extract_commands(doc, ROOT)]


# ---------------------------------------------------------------------------
# Checking one command.

def _is_placeholder(value: str) -> bool:
  """A value the documents leave to the reader: `...`, `<x>`, `$X`, `*`."""
  return any(mark in value for mark in ('...', '…', '<', '>', '$', '*'))


def _clean_args(args) -> list[str]:
  """The words of a command as its parser sees them: optional-flag brackets
  (`[--x=1]`) removed, bare placeholders (`...`) dropped."""
  out = []
  for arg in args:
    opened = len(arg) - len(arg.lstrip('['))
    arg = arg[opened:]
    closed = min(opened, len(arg) - len(arg.rstrip(']')))
    arg = arg[:len(arg) - closed]
    if arg and arg not in ('...', '…', ']'):
      out.append(arg)
  return out


def _unknown_value_checks(parser: argparse.ArgumentParser) -> None:
  """Values are not judged: placeholders stand where a type or a choice
  would refuse them. Flags are: no abbreviations."""
  parser.allow_abbrev = False
  for action in parser._actions:  # pylint: disable=protected-access
    action.type = None
    action.choices = None
    action.required = False  # a command named in passing, without its flags


def _parse_known(parser: argparse.ArgumentParser, args: list[str],
                 where: str) -> tuple[argparse.Namespace, list[str]]:
  def refuse(message):
    raise AssertionError(f'{where}: {message}')
  parser.error = refuse
  try:
    return parser.parse_known_args(args)
  except SystemExit as e:  # --help or a parser error argparse exits on
    raise AssertionError(f'{where}: the parser exited ({e})') from None


class _Captured(Exception):

  def __init__(self, **kwargs):
    super().__init__()
    self.kwargs = kwargs


def command_parser(module_name: str,
                   monkeypatch) -> Optional[argparse.ArgumentParser]:
  """The parser `python -m hyperprompt_jax.<module_name>` parses its flags
  with, built as `gin_utils.parse_command_line` does (None: the module takes
  no argparse flags)."""
  module = importlib.import_module(f'hyperprompt_jax.{module_name}')
  if 'command_flags' not in pathlib.Path(module.__file__).read_text():
    return None

  def capture(prog, description, argv, *, add_flags=None, tensorflow=False):
    del argv, tensorflow
    raise _Captured(prog=prog, description=description, add_flags=add_flags)

  with monkeypatch.context() as patch:
    patch.setattr(gin_utils, 'command_flags', capture)
    try:
      module.main([])
    except _Captured as captured:
      found = captured.kwargs
    else:
      raise AssertionError(f'hyperprompt_jax.{module_name}.main does not '
                           'call gin_utils.command_flags')
  return gin_utils._parser(found['prog'], found['description'],  # pylint: disable=protected-access
                           found['add_flags'])


# Runnable modules that take no argparse flags: the words they accept.
_FIXED_ARGS = {'paths': ['gin'], 'tasks.fixture_data': [],
               'benchmarks.metabalance_microbatches': []}

_MACRO = re.compile(r'^\s*([A-Z][A-Z0-9_]*)\s*=')


def _t5x_installed() -> bool:
  return importlib.util.find_spec('t5x') is not None


def check_gin(gin_files, bindings, search_paths, where: str) -> None:
  """Each gin file resolves; together they parse, with the bindings whose
  values are not placeholders (a macro the files do not define is refused,
  as the commands refuse it)."""
  search_paths = [p for p in [*search_paths, str(GIN_DIR)] if p]
  real = [f for f in gin_files if not _is_placeholder(f)]
  for name in real:
    try:
      gin_utils.resolve_gin_file(name, search_paths)
    except ValueError as e:
      raise AssertionError(f'{where}: {e}') from None
  if not real:
    return
  if any(pathlib.PurePath(f).parts[0] == 't5x' for f in real):
    if not _t5x_installed():
      return  # t5x's run files include t5x's own configuration
    pytest.skip('t5x run files parse with t5x as __main__: '
                'tests/test_gin_files.py')
  placeholders = len(real) < len(gin_files)
  usable = [b for b in bindings if not _is_placeholder(b)
            and not (placeholders and _MACRO.match(b))]
  gin.clear_config()
  try:
    gin_utils.parse_gin(real, usable, search_paths)
  except ValueError as e:
    raise AssertionError(f'{where}: {e}') from None
  finally:
    gin.clear_config()


def check_hyperprompt_command(command: Command, monkeypatch) -> None:
  where = f'{command.doc}:{command.line}: python -m hyperprompt_jax.{command.target}'
  if _is_placeholder(command.target):
    return  # `python -m hyperprompt_jax.<command>`
  name = f'hyperprompt_jax.{command.target}'
  try:
    spec = importlib.util.find_spec(name)
  except ModuleNotFoundError:
    spec = None
  assert spec is not None and spec.origin, f'{where}: no module {name}'
  source = pathlib.Path(spec.origin).read_text(encoding='utf-8')
  assert "__name__ == '__main__'" in source, (
      f'{where}: {name} is not a command (no __main__)')
  args = _clean_args(command.args)
  parser = command_parser(command.target, monkeypatch)
  if parser is None:
    expected = _FIXED_ARGS.get(command.target)
    assert expected is not None, f'{where}: {name} takes no flags the test knows'
    assert args == expected, f'{where}: {name} takes {expected}, shown {args}'
    return
  _unknown_value_checks(parser)
  try:
    args = gin_utils.rewrite_gin_shorthand(args)
  except ValueError as e:
    raise AssertionError(f'{where}: {e}') from None
  flags, unknown = _parse_known(parser, args, where)
  assert not unknown, f'{where}: unknown to its parser: {unknown}'
  check_gin(flags.gin_file, flags.gin_bindings,
            flags.gin_search_paths.split(','), where)


def _load_launch_script(path: pathlib.Path, monkeypatch):
  """The script as a module; its `import common` (launch/common.py) is
  undone from sys.modules afterwards, the module keeps it."""
  monkeypatch.syspath_prepend(str(path.parent))
  saved = sys.modules.pop('common', None)
  try:
    spec = importlib.util.spec_from_file_location(
        f'_launch_{path.stem}', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.modules.pop('common', None)
    if saved is not None:
      sys.modules['common'] = saved
  return module


def check_launch_command(command: Command, monkeypatch,
                         root: pathlib.Path = ROOT) -> None:
  where = f'{command.doc}:{command.line}: python {command.target}'
  if _is_placeholder(command.target):
    return  # `python launch/<script>.py --help`
  path = root / command.target
  assert path.is_file(), f'{where}: no script {command.target}'
  with monkeypatch.context() as patch:
    module = _load_launch_script(path, patch)

    def capture(parser, argv):
      del argv
      raise _Captured(parser=parser)

    patch.setattr(module.common, 'parse_args', capture)
    try:
      module.main([])
    except _Captured as captured:
      parser = captured.kwargs['parser']
    else:
      raise AssertionError(f'{where}: main does not call common.parse_args')
  _unknown_value_checks(parser)
  flags, extra = _parse_known(parser, _clean_args(command.args), where)
  # As common.parse_args: t5x's --gin.KEY=VALUE words pass as --gin.
  unknown = [w for w in extra if not (w.startswith('--gin.') and '=' in w)]
  assert not unknown, f'{where}: unknown to its parser: {unknown}'
  bindings = flags.gin + [w[len('--gin.'):] for w in extra]
  if getattr(flags, 'runner', None) == 't5x':
    check_gin_files_exist(flags.gin_file, where)
  else:
    check_gin(flags.gin_file, bindings, [], where)


def _gin_files_of(args) -> list[str]:
  files, args = [], list(args)
  for i, arg in enumerate(args):
    if arg.startswith('--gin_file='):
      files.append(arg[len('--gin_file='):])
    elif arg == '--gin_file' and i + 1 < len(args):
      files.append(args[i + 1])
  return files


def check_gin_files_exist(files, where: str) -> None:
  for name in files:
    if not _is_placeholder(name):
      assert (GIN_DIR / name).is_file(), (
          f'{where}: no gin file {name} in {GIN_DIR}')


def check_command(command: Command, monkeypatch,
                  root: pathlib.Path = ROOT) -> None:
  if command.kind == 'hyperprompt_jax':
    check_hyperprompt_command(command, monkeypatch)
  elif command.kind == 'launch':
    check_launch_command(command, monkeypatch, root)
  else:
    check_gin_files_exist(_gin_files_of(_clean_args(command.args)),
                          f'{command.doc}:{command.line}: {command.target}')


# ---------------------------------------------------------------------------
# The tests.

def test_the_documents_show_commands():
  assert [d.name for d in DOCS[1:]], 'docs/ has no documents'
  kinds = {c.kind for c in COMMANDS}
  assert kinds == {'hyperprompt_jax', 'launch', 't5x'}, kinds
  assert len(COMMANDS) >= 40, len(COMMANDS)


@pytest.mark.parametrize('command', COMMANDS, ids=lambda c: c.id)
def test_command(command, monkeypatch):
  check_command(command, monkeypatch)


def test_readme_shows_the_ci_commands():
  """`.ci/run` runs the README's install and test lines: they must match."""
  readme = (ROOT / 'README.md').read_text(encoding='utf-8')
  ci = (ROOT / '.ci' / 'run').read_text(encoding='utf-8').splitlines()
  lines = [l.strip() for l in ci
           if 'pip install' in l or l.strip().startswith('python -m pytest')]
  assert len(lines) == 2, lines
  for line in lines:
    assert line in readme.splitlines(), f'README.md lacks {line!r}'


_INTERNAL = re.compile(r'\[\d{3}( Table \d+,)? L\d|SEEDS_DIGEST|DESIGN\.md'
                       r'|/shared/')


@pytest.mark.parametrize('doc', DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_no_internal_references(doc):
  """Papers are cited by title and section, not by internal file and line."""
  for number, line in enumerate(doc.read_text(encoding='utf-8').splitlines(), 1):
    assert not _INTERNAL.search(line), f'{doc.name}:{number}: {line}'


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading."""
  text = re.sub(r'[^\w\- ]', '', heading.strip().lower())
  return text.replace(' ', '-')


def _anchors(path: pathlib.Path) -> set[str]:
  _, prose = _split_fences(path.read_text(encoding='utf-8'))
  return {_slug(m.group(1))
          for m in re.finditer(r'^#+\s+(.*)$', prose, re.MULTILINE)}


@pytest.mark.parametrize('doc', DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_links_resolve(doc):
  _, prose = _split_fences(doc.read_text(encoding='utf-8'))
  for match in re.finditer(r'\]\(([^)\s]+)\)', prose):
    target = match.group(1)
    if re.match(r'[a-z]+://', target):
      continue
    line = prose.count('\n', 0, match.start()) + 1
    file, _, anchor = target.partition('#')
    path = (doc.parent / file) if file else doc
    assert path.exists(), f'{doc.name}:{line}: {target}: no {path}'
    if anchor:
      assert anchor in _anchors(path), f'{doc.name}:{line}: no #{anchor} in {path.name}'


_PATH = re.compile(r'^[\w.{},<>*/-]+\.(py|gin|json|png|md)$')
# Paths of other projects the documents name.
_FOREIGN = ('t5x/configs/',)


def _expand_braces(path: str) -> list[str]:
  match = re.search(r'\{([^{}]*)\}', path)
  if not match:
    return [path]
  return [expanded for option in match.group(1).split(',')
          for expanded in _expand_braces(
              path[:match.start()] + option + path[match.end():])]


def _path_exists(path: str) -> bool:
  pattern = re.sub(r'<[^<>]*>', '*', path)
  return any(list(base.glob(pattern)) for base in (ROOT, GIN_DIR))


def _names(doc: pathlib.Path) -> list[tuple[int, str]]:
  _, prose = _split_fences(doc.read_text(encoding='utf-8'))
  return _inline_spans(prose)


@pytest.mark.parametrize('doc', DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_paths_in_inline_code_exist(doc):
  """`hyperprompt_jax/training/trainer.py`, `runs/quickstart.gin`,
  `models/t5_1_1_{small,base}.gin`: files of the checkout or of the gin
  directory."""
  missing = []
  for line, span in _names(doc):
    if ('/' not in span or not _PATH.match(span) or '...' in span
        or span.startswith(_FOREIGN) or span.startswith('/')
        or re.match(r'[A-Z_]+/', span)):  # under MODEL_DIR, /tmp, ...
      continue
    for path in _expand_braces(span):
      if not _path_exists(path):
        missing.append(f'{doc.name}:{line}: {path}')
  assert not missing, missing


def _module_and_rest(name: str):
  parts = name.split('.')
  for i in range(len(parts), 0, -1):
    try:
      if importlib.util.find_spec('.'.join(parts[:i])) is not None:
        return '.'.join(parts[:i]), parts[i:]
    except (ImportError, AttributeError, ValueError):
      continue
  return None, parts


@pytest.mark.parametrize('doc', DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_dotted_names_exist(doc):
  """`hyperprompt_jax.training.optimizers.make_optimizer`: the module exists
  and holds the name (modules that need t5x only where it is installed)."""
  missing = []
  for line, span in _names(doc):
    match = re.fullmatch(r'(hyperprompt_jax(\.\w+)+)(\(\))?', span)
    if not match:
      continue
    module_name, rest = _module_and_rest(match.group(1))
    if module_name is None:
      missing.append(f'{doc.name}:{line}: {span} (no such module)')
      continue
    if not rest:
      continue
    try:
      module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
      if e.name == 't5x' or (e.name or '').startswith('t5x.'):
        continue
      raise
    if not hasattr(module, rest[0]):
      missing.append(f'{doc.name}:{line}: {span} ({module_name} has no '
                     f'{rest[0]})')
  assert not missing, missing


_LAYOUT_WORD = re.compile(
    r'((?:[\w.-]+/)*[\w.-]+(?:/|\.(?:py|sh|md|toml))|\.ci/run)(,\s*|\s+|$)')
_SOURCE_GLOBS = ('hyperprompt_jax/**/*.py', 'tasks/**/*.py', 'launch/*.py',
                 'tools/*', '*.py', '*.toml', '.ci/run')


def layout_names(text: str) -> tuple[set[str], set[str]]:
  """(the paths docs/layout.md's tree lists as entries, every path it names).

  An entry starts a line of the tree: a file or folder, or a comma-separated
  list of files, at most two spaces deeper than its folder's entry (deeper
  lines continue a description). Within a line, a bare `name.py` names a
  file of the folder the line is under."""
  _, _, rest = text.partition('```\n')
  tree, _, _ = rest.partition('```')
  entries, named, folders = set(), set(), []  # folders: (indent, 'x/')
  for line in tree.splitlines():
    indent = len(line) - len(line.lstrip())
    body = line.strip()
    words = []
    if not folders or indent <= folders[-1][0] + 2:
      while body:
        match = _LAYOUT_WORD.match(body)
        if not match:
          break
        words.append(match.group(1))
        body = body[match.end():]
        if not match.group(2).startswith(','):
          break
    if words:
      while folders and folders[-1][0] >= indent:
        folders.pop()
    prefix = ''.join(f for _, f in folders)
    entries.update(prefix + w for w in words)
    if len(words) == 1 and words[0].endswith('/'):
      folders.append((indent, words[0]))
      prefix += words[0]
    for word in re.findall(r'(?<![\w./-])([\w./-]+\.(?:py|sh))\b', body):
      named.add(word if '/' in word else prefix + word)
  return entries, entries | named


def test_layout_lists_every_file():
  """docs/layout.md's tree names every source file (packages' `__init__.py`
  aside) where it lives, and every entry it lists exists."""
  entries, named = layout_names(
      (ROOT / 'docs' / 'layout.md').read_text(encoding='utf-8'))
  assert len(entries) > 50, sorted(entries)
  missing = sorted(p for p in entries if not (ROOT / p).exists())
  assert not missing, f'docs/layout.md lists what does not exist: {missing}'
  files = {p.relative_to(ROOT).as_posix()
           for pattern in _SOURCE_GLOBS for p in ROOT.glob(pattern)
           if p.is_file() and p.name != '__init__.py'
           and '__pycache__' not in p.parts}
  unnamed = sorted(files - named)
  assert not unnamed, f'docs/layout.md does not name: {unnamed}'


def test_gin_and_t5x_docs_name_every_run_file():
  """Every file of gin/runs/ and gin/t5x/ is named in docs/gin.md or
  docs/t5x.md, or is a paper setup (`<method>_<benchmark>.gin`, one per
  file of gin/setups/)."""
  named = {path for doc in ('gin.md', 't5x.md')
           for _, span in _names(ROOT / 'docs' / doc)
           if span.endswith('.gin') for path in _expand_braces(span)}
  setups = {p.name for p in (GIN_DIR / 'setups').glob('*.gin')}
  unnamed = sorted(
      f'{folder}/{p.name}' for folder in ('runs', 't5x')
      for p in (GIN_DIR / folder).glob('*.gin')
      if f'{folder}/{p.name}' not in named and p.name not in setups)
  assert not unnamed, f'neither docs/gin.md nor docs/t5x.md names {unnamed}'


# ---------------------------------------------------------------------------
# The checks catch what they are for.

_BROKEN = """\
# A broken document

```sh
python -m hyperprompt_jax.trian --gin_file=runs/quickstart.gin
python -m hyperprompt_jax.train --gin_file=runs/quickstrat.gin
python -m hyperprompt_jax.train --gin_file=runs/quickstart.gin --steps=10
python -m hyperprompt_jax.train --gin_file=runs/quickstart.gin \\
  --gin.TRAIN_STPES=10
python -m hyperprompt_jax.eval --gin_file=runs/quickstart_eval.gin --metrics=x
python -m hyperprompt_jax.paths gni
python launch/local.py --mdoe=eval
python launch/gpu.py --gin_file=runs/nope.gin --model_dir=/x --dry-run
python -m t5x.train --gin_file=t5x/nope.gin
```

Inline too: `python -m hyperprompt_jax.param_table --gin_file=models/t5_1_1_base.gin --flop`.
"""

_FINE = """\
```bash
python -m hyperprompt_jax.train --gin_file=runs/quickstart.gin \\
  --gin.TRAIN_STEPS=10 [--gin.SEED=1]   # a comment
G="--gin_search_paths=$(python -m hyperprompt_jax.paths gin)"
python -m t5x.train "$G" --gin_file=t5x/quickstart_train.gin
python -m hyperprompt_jax.param_table --gin_file=models/t5_1_1_base.gin [--gin_file=variants/<variant>.gin] [--json]
python launch/local.py --mode=eval --dry-run
```
"""


def test_broken_commands_fail(tmp_path, monkeypatch):
  (tmp_path / 'docs').mkdir()
  doc = tmp_path / 'docs' / 'broken.md'
  doc.write_text(_BROKEN)
  (tmp_path / 'launch').symlink_to(ROOT / 'launch')
  commands = extract_commands(doc, tmp_path)
  assert [c.line for c in commands] == [4, 5, 6, 7, 9, 10, 11, 12, 13, 16]
  for command in commands:
    with pytest.raises(AssertionError):
      check_command(command, monkeypatch, tmp_path)


def test_fine_commands_pass(tmp_path, monkeypatch):
  (tmp_path / 'docs').mkdir()
  doc = tmp_path / 'docs' / 'fine.md'
  doc.write_text(_FINE)
  (tmp_path / 'launch').symlink_to(ROOT / 'launch')
  commands = extract_commands(doc, tmp_path)
  assert [(c.line, c.target) for c in commands] == [
      (2, 'train'), (4, 'paths'), (5, 't5x.train'), (6, 'param_table'),
      (7, 'launch/local.py')]
  assert commands[0].args[-1] == '[--gin.SEED=1]'
  for command in commands:
    check_command(command, monkeypatch, tmp_path)


def test_layout_names_read_the_tree():
  text = """Intro `x.py`.

```
setup.py, pyproject.toml  the package
hyperprompt_jax/
  train.py, eval.py
                    the commands; paths.py is named in passing
  runner/           the runner
    trainer.py        the step (its twin, tests/test_train.py)
launch/             start a run: gpu.py, local.py
tools/run.sh        a script
```
"""
  entries, named = layout_names(text)
  assert entries == {
      'setup.py', 'pyproject.toml', 'hyperprompt_jax/',
      'hyperprompt_jax/train.py', 'hyperprompt_jax/eval.py',
      'hyperprompt_jax/runner/', 'hyperprompt_jax/runner/trainer.py',
      'launch/', 'tools/run.sh'}
  assert named - entries == {
      'hyperprompt_jax/paths.py', 'tests/test_train.py', 'launch/gpu.py',
      'launch/local.py'}
