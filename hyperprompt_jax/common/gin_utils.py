"""t5x-style gin flags for the project's command-line tools.

`--gin_file=F` (repeatable), `--gin_bindings='X=Y'` (repeatable),
`--gin.X=Y` (t5x's shorthand for a binding) and `--gin_search_paths=a,b`.
The shipped gin directory is always searched, so `models/t5_1_1_base.gin`
resolves from anywhere.

Light (gin and the standard library): a command answers `--help` through
`command_flags` before its library's heavy imports, and TensorFlow loads
without its start-up lines.
"""

import argparse
import contextlib
import errno
import logging
import os
import re
import sys
import tempfile
from typing import Callable, Optional, Sequence
import zipfile

import gin

import hyperprompt_jax
from hyperprompt_jax import paths


def add_gin_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('--gin_file', action='append', default=[],
                      help='gin file, resolved against the search paths')
  parser.add_argument('--gin_bindings', action='append', default=[],
                      help="gin binding 'X=Y' (or use --gin.X=Y)")
  parser.add_argument('--gin_search_paths', default='',
                      help='comma-separated directories to resolve gin files')


def parse_gin_flags(args: argparse.Namespace,
                    default_gin_files: Sequence[str] = ()) -> None:
  """Clears gin and parses the flags `add_gin_flags` defined."""
  gin.clear_config()
  parse_gin(args.gin_file or list(default_gin_files), args.gin_bindings,
            [p for p in args.gin_search_paths.split(',') if p])


AddFlags = Callable[[argparse.ArgumentParser], None]

# JAX's distributed service ends every process once a peer sends no
# heartbeat for this long (`multihost.HEARTBEAT_TIMEOUT_S`; repeated here so
# that --help needs no JAX).
HEARTBEAT_TIMEOUT_S = 30


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
  """The flags of a command run as one process per host (`multihost`)."""
  group = parser.add_argument_group(
      'several processes (one per host; every host runs the same command)')
  group.add_argument(
      '--multiprocess', action='store_true',
      help='join the hosts of a TPU pod, SLURM, Open MPI or k8s job: '
      'jax.distributed.initialize() finds them itself')
  group.add_argument(
      '--coordinator_address',
      help='HOST:PORT of process 0, reachable from every host (default: '
      '$JAX_COORDINATOR_ADDRESS); with --num_processes and --process_id, '
      'runs anywhere without a scheduler')
  group.add_argument('--num_processes', type=int,
                     help='how many processes (default: $JAX_NUM_PROCESSES)')
  group.add_argument('--process_id', type=int,
                     help='this process, 0 .. num_processes - 1 (default: '
                     '$JAX_PROCESS_ID)')
  group.add_argument(
      '--heartbeat_timeout_seconds', type=int, default=HEARTBEAT_TIMEOUT_S,
      help='a process silent this long is lost and every process stops '
      '(default: %(default)s)')


def _parser(prog: str, description: str,
            add_flags: Optional[AddFlags]) -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog=prog, description=description,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  add_gin_flags(parser)
  parser.add_argument('--traceback', action='store_true',
                      help='on an error, print the whole traceback too')
  if add_flags is not None:
    add_flags(parser)
  return parser


def command_flags(prog: str, description: str,
                  argv: Optional[Sequence[str]], *,
                  add_flags: Optional[AddFlags] = None,
                  tensorflow: bool = False) -> argparse.Namespace:
  """A command's flags, parsed before its library is imported.

  The command module (`hyperprompt_jax/<command>.py`) imports its library in
  `main` after this returns, so `--help` and a flag mistake answer before
  TensorFlow or JAX load. With `tensorflow`, TensorFlow is imported here,
  quietly.

  Args:
    prog: the command, e.g. 'python -m hyperprompt_jax.train'.
    description: the `--help` text (the command module's docstring).
    argv: the arguments (None: `sys.argv[1:]`).
    add_flags: adds the command's own flags to the parser.
    tensorflow: the library imports TensorFlow.

  Returns:
    The flags, for the library's `run(flags)`, which parses gin itself.
  """
  args = parse_command_line(prog, description, argv, add_flags=add_flags,
                            parse_gin_files=False)
  if tensorflow:
    import_tensorflow_quietly()
  return args


# What TensorFlow writes while it loads and probes its devices that is no
# concern of a JAX program: absl's banner for logs before its set-up, INFO
# lines (oneDNN, "Could not find cuda drivers", CPU instructions) and the
# failed CUDA probe of a machine without a GPU. Other lines pass.
_TF_STARTUP_NOISE = re.compile(
    r'WARNING: All log messages before absl::InitializeLog\(\) is called'
    r'|I\d{4} [\d:.]+ +\d+ \S+:\d+\] '
    r'|E\d{4} [\d:.]+ +\d+ \S+:\d+\] failed call to cuInit'
    r'|To enable the following instructions:')


@contextlib.contextmanager
def _stderr_without(noise: re.Pattern):
  """Holds back file descriptor 2, then passes on the lines `noise` misses."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      for line in held.read().decode(errors='replace').splitlines(True):
        if not noise.match(line):
          sys.stderr.write(line)
      sys.stderr.flush()


def import_tensorflow_quietly() -> None:
  """Imports TensorFlow, which only feeds data, and hides the GPUs from it.

  JAX owns the accelerator, as in t5x. TensorFlow's start-up lines come from
  C++ logging before `TF_CPP_MIN_LOG_LEVEL` is read, so stderr is held back
  while it loads and only what `_TF_STARTUP_NOISE` misses passes. A user who
  sets TF_CPP_MIN_LOG_LEVEL sees every line.
  """
  if 'tensorflow' in sys.modules:
    return  # loaded already: nothing left to hold back
  if 'TF_CPP_MIN_LOG_LEVEL' in os.environ:
    quiet = contextlib.nullcontext()
  else:
    os.environ['TF_CPP_MIN_LOG_LEVEL'] = '1'  # its later INFO lines
    quiet = _stderr_without(_TF_STARTUP_NOISE)
  with quiet:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    # Lists the devices, so the CUDA probe runs now, inside `quiet`.
    tf.config.set_visible_devices([], 'GPU')


def parse_command_line(
    prog: str, description: str, argv: Optional[Sequence[str]], *,
    add_flags: Optional[AddFlags] = None,
    logger: Optional[logging.Logger] = None,
    parse_gin_files: bool = True) -> argparse.Namespace:
  """Every entry point's preamble: its flags, its log on stdout, and gin.

  Args:
    prog: the command, e.g. 'python -m hyperprompt_jax.train'.
    description: the `--help` text (the module docstring).
    argv: the arguments (None: `sys.argv[1:]`); `--gin.X=Y` is t5x's
      shorthand for a binding.
    add_flags: adds the tool's own flags to the parser.
    logger: the tool's logger, sent to stdout.
    parse_gin_files: parse gin here (off for tools that parse it later, or
      with default files: `parse_gin_flags`).

  Returns:
    The parsed flags.
  """
  argv = rewrite_gin_shorthand(sys.argv[1:] if argv is None else argv)
  args = _parser(prog, description, add_flags).parse_args(argv)
  if logger is not None:
    log_to_stdout(logger)
  if parse_gin_files:
    parse_gin_flags(args)
  return args


class ReportedError(RuntimeError):
  """A failure whose message names cause and fix: one line, exit 1."""


def _without_gin_context(message: str) -> str:
  # gin appends "In call to configurable 'train' (<function ...>)": the
  # message already says what to fix.
  return re.split(r'\n\s*In call to configurable', message)[0]


def _failure_line(e: BaseException) -> Optional[str]:
  """One line naming a failure's cause, or None for a bug."""
  if isinstance(e, ReportedError):
    return _without_gin_context(str(e))
  if isinstance(e, OSError):
    if e.errno == errno.ENOSPC:
      return (f'{e}. Free space (or point MODEL_DIR elsewhere) and run the '
              'same command again: the newest committed checkpoint is kept.')
    return f'{type(e).__name__}: {e}'
  if isinstance(e, zipfile.BadZipFile):
    return f'{e}: the file is not a whole .npz (a copy cut short?).'
  # tf.io.gfile's errors (tensorflow.python.framework.errors_impl), without
  # importing TensorFlow here.
  if (type(e).__module__.startswith('tensorflow')
      and type(e).__name__.endswith('Error') and hasattr(e, 'message')):
    return f'{type(e).__name__}: {e.message}'
  return None


def run(main: Callable[[], int]) -> None:
  """Runs a command-line `main`, turning errors a user can act on into one line.

  A ValueError (a usage mistake) exits 2; a failure `_failure_line` names
  exits 1 (the traceback too with `--traceback`); anything else raises.
  """
  try:
    sys.exit(main())
  except ValueError as e:
    if '--traceback' in sys.argv[1:]:
      raise
    print(f'error: {_without_gin_context(str(e))}', file=sys.stderr)
    sys.exit(2)
  except Exception as e:  # pylint: disable=broad-except
    line = _failure_line(e)
    if line is None or '--traceback' in sys.argv[1:]:
      raise
    print(f'error: {line}\n(the traceback: the same command with '
          '--traceback)', file=sys.stderr)
    sys.exit(1)


def log_to_stdout(logger: logging.Logger) -> None:
  """A tool's progress lines on stdout, apart from the libraries' logging."""
  if not logger.handlers:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter('%(asctime)s %(message)s',
                                           '%H:%M:%S'))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def rewrite_gin_shorthand(argv: Sequence[str]) -> list[str]:
  """Rewrites `--gin.X=Y` / `--gin.X Y` into `--gin_bindings=X=Y`."""
  out, i = [], 0
  while i < len(argv):
    arg = argv[i]
    if arg.startswith('--gin.'):
      name, eq, value = arg[len('--gin.'):].partition('=')
      if not eq:
        if i + 1 >= len(argv):
          raise ValueError(f'{arg} needs a value: --gin.{name}=VALUE')
        i += 1
        value = argv[i]
      out.append(f'--gin_bindings={name} = {value}')
    else:
      out.append(arg)
    i += 1
  return out


class _QuietGinProbes(logging.Filter):
  """Drops gin's 'Path not found' errors for `include`s found later.

  gin probes each `include` as a package resource before the search paths; a
  file really missing still raises.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith('Path not found')


def parse_gin(gin_files: Sequence[str], bindings: Sequence[str],
              search_paths: Sequence[str] = ()) -> None:
  """Parses gin files and bindings, with errors that say what to fix."""
  root = logging.getLogger()
  if not any(isinstance(f, _QuietGinProbes) for f in root.filters):
    root.addFilter(_QuietGinProbes())
  search_paths = [p for p in [*search_paths, paths.gin_dir()] if p]
  for path in search_paths:
    gin.add_config_file_search_path(path)
  if not gin_files:
    raise ValueError('No --gin_file given: pass a model gin file, e.g. '
                     '--gin_file=models/t5_1_1_small.gin.')
  files = [resolve_gin_file(f, search_paths) for f in gin_files]
  for name in gin_files:
    warn_if_renamed(name)
  try:
    gin.parse_config_files_and_bindings(files, [], finalize_config=False)
    _check_macros_exist(bindings)
    gin.parse_config_files_and_bindings([], list(bindings),
                                        finalize_config=False)
  except SyntaxError as e:
    # gin's own message starts with Python's AST wording; its last line
    # names the token.
    why = (e.msg or '').strip().splitlines()[-1:] or ['']
    statement = (e.text or '').strip()
    if e.filename:
      where, hint = f'{e.filename}, line {e.lineno}', ''
    else:
      where, hint = 'a command-line binding', _string_hint(statement)
    raise ValueError(f'gin cannot parse {statement!r} ({where}): '
                     f'{why[0].strip().rstrip(".")}.{hint}') from None
  except RecursionError as e:
    raise ValueError('The gin files include each other in a cycle: '
                     f'{_include_cycle(str(e), files)}. Remove the include '
                     'that closes it.') from None
  except (ValueError, IOError, TypeError) as e:
    raise ValueError(
        f'Invalid gin configuration: {e}\n(Check the spelling of the '
        'configurable, parameter or macro, and that the gin files exist in '
        f'the search paths {search_paths}.)'
    ) from e


def _include_cycle(message: str, files: Sequence[str]) -> str:
  """'a.gin -> b.gin -> a.gin' from gin's RecursionError message."""
  cycle = []
  for path in re.findall(r'In file "([^"]+)", line', message):
    if path in cycle:
      break
    cycle.append(path)
  if not cycle:
    return '(gin does not say which)'
  start = next((cycle.index(f) for f in files if f in cycle), 0)
  cycle = cycle[start:] + cycle[:start]
  return ' -> '.join(cycle + cycle[:1])


# A binding whose value starts like a bare word or a path, not like a gin
# value (number, quoted string, list, dict, tuple, @reference, %macro).
_UNQUOTED_STRING = re.compile(r'^\s*([\w./]+)\s*=\s*([A-Za-z_/~.][^\n]*?)\s*$')


def _string_hint(statement: str) -> str:
  """How to quote the value of `NAME = value` if it looks like a bare string."""
  match = _UNQUOTED_STRING.match(statement)
  if not match or match.group(2) in ('True', 'False', 'None'):
    return ''
  name, value = match.groups()
  return (f' If it is a string, quote it for gin inside the shell\'s '
          f'quotes: --gin.{name}="\'{value}\'"')


# Shipped gin folders renamed, old name -> new. The old folder keeps one
# alias file per file for one release (each includes its new path), so a
# run file or a recorded config that names the old path still parses.
RENAMED_GIN_FOLDERS = {'experiments': 'setups'}


def renamed_gin_file(name: str) -> Optional[str]:
  """The new path of a gin file of a renamed folder, or None."""
  folder = os.path.basename(os.path.dirname(os.path.normpath(name)))
  if folder not in RENAMED_GIN_FOLDERS:
    return None
  new = f'{RENAMED_GIN_FOLDERS[folder]}/{os.path.basename(name)}'
  return new if os.path.isfile(os.path.join(paths.gin_dir(), new)) else None


def warn_if_renamed(name: str) -> None:
  """Warns of a --gin_file in a renamed folder, naming its new path."""
  new = renamed_gin_file(name)
  if new is None:
    return
  old_folder = os.path.basename(os.path.dirname(os.path.normpath(name)))
  hyperprompt_jax.warn_renamed(
      f'--gin_file={name}: gin/{old_folder}/ is now '
      f'gin/{new.split("/")[0]}/; give --gin_file={new}', stacklevel=3)


def resolve_gin_file(name: str, search_paths: Sequence[str]) -> str:
  """The path of gin file `name`: as given, or under a search path."""
  if os.path.exists(name):
    return name
  for path in search_paths:
    candidate = os.path.join(path, name)
    if os.path.exists(candidate):
      return candidate
  raise ValueError(
      f'Gin file {name!r} not found, neither as given nor under the search '
      f'paths {list(search_paths)}. Shipped files: models/*.gin, '
      'variants/*.gin (see `python -m hyperprompt_jax.paths gin`).'
  )


_MACRO_BINDING = re.compile(r'^\s*([A-Z][A-Z0-9_]*)\s*=')


def _check_macros_exist(bindings: Sequence[str]) -> None:
  """A macro set on the command line must override one a gin file defines.

  gin accepts any macro name silently, so a typo (`--gin.TRAIN_STPES=10`)
  would otherwise be ignored.
  """
  for binding in bindings:
    match = _MACRO_BINDING.match(binding)
    if not match:
      continue
    name = match.group(1)
    try:
      gin.query_parameter(f'{name}/macro.value')
    except ValueError:
      raise ValueError(
          f'Unknown gin macro {name!r}: none of the gin files defines it. '
          'Check the spelling (macros are CAPS names set in the model, '
          'variant and run files).'
      ) from None
