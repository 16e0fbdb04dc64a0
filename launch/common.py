"""Shared parts of the launch scripts: flags, command lines, quoting, the
scripts a host runs (install, job), running.

Standard library only, so the scripts run from a laptop without JAX. A command
is a list of words; `render` shell-quotes it into the line `--dry-run` prints,
and `execute` runs exactly that line with /bin/sh. A `File` is a script that
a launcher writes here and sends to the hosts; `--dry-run` prints it whole.
"""

import argparse
import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence
import urllib.parse

MODES = ('train', 'eval', 'infer', 'leaderboard', 'probe')
# The built-in runner's commands that t5x has no script for; they read t5x's
# checkpoints too.
BUILTIN_ONLY_MODES = ('leaderboard', 'probe')
RUNNERS = ('t5x', 'builtin')

# t5x and the two libraries it imports that the package index lacks (airio) or
# has too old (jestimator), at the commits the project's t5x tests run
# against: (name, repository, commit). Installed with `pip install --no-deps`:
# t5x's setup.py asks for flax, optax, clu and seqio at their git HEADs, which
# would replace this package's pinned versions.
T5X_REPOS = (
    ('t5x', 'https://github.com/google-research/t5x',
     'cc342d419ec3e3e9c4bf1df33c82330cafdc1e16'),
    ('airio', 'https://github.com/google/airio',
     '69897df7d9a427b947a9f7bb4164c7782b43e601'),
    ('jestimator', 'https://github.com/google-research/jestimator',
     '326824a477feef6d92e6f44175000907a72899ca'),
)
# t5x's remaining run-time dependencies, not pulled in by hyperprompt_jax;
# verified with its pins (jax 0.10.2, flax 0.12.8).
T5X_EXTRA_PACKAGES = ('grain==0.2.12', 'cached_property', 'chex', 'fiddle',
                      'jaxtyping')

# Where the launchers put things on a host (`~/`: that host's home).
HOST_DIR = '~/hyperprompt_launch'  # the scripts each host runs, the archive
SOURCE_DIR = HOST_DIR + '/hyperprompt_jax'  # the source, replaced by --install
VENV_DIR = '~/hyperprompt_venv'
VENV_PYTHON = VENV_DIR + '/bin/python'
LOG_DIR = '~/hyperprompt_logs'
ARCHIVE = 'hyperprompt_jax.tar.gz'
# The package needs >= 3.11, and the Ubuntu 22.04 TPU runtime's python3 is
# 3.10: uv fetches a standalone CPython for the virtual environment.
PYTHON_VERSION = '3.11'
# This checkout, which --install ships by default.
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The per-mode macros of t5x's run files, which the built-in runner shares.
OUTPUT_DIR_MACRO = {'eval': 'EVAL_OUTPUT_DIR', 'infer': 'INFER_OUTPUT_DIR',
                    'leaderboard': 'LEADERBOARD_OUTPUT_DIR',
                    'probe': 'PROBE_OUTPUT_DIR'}

Command = list  # of words: str, or Shell for shell syntax


class Shell(str):
  """A word kept unquoted: shell syntax such as `||` or a `$(...)`."""


# Characters shlex.quote leaves bare.
_SAFE = re.compile(r'[\w@%+=:,./-]+', re.ASCII)
_FLAG = re.compile(r'(--?[\w.-]+=)(.*)', re.ASCII | re.DOTALL)


def _quote_value(value: str) -> str:
  if not value:
    return "''"
  if _SAFE.fullmatch(value):
    return value
  if "'" not in value:
    return f"'{value}'"
  # gin strings carry inner single quotes; "..." keeps them readable
  # (--gin.MODEL_DIR="'gs://b/run'"). Only without `$` and backquotes, which
  # would need escapes that shlex.split does not undo, and `!`, which
  # interactive bash expands inside double quotes.
  if not set(value) & set('$`!'):
    return '"' + re.sub(r'([\\"])', r'\\\1', value) + '"'
  return shlex.quote(value)


def quote(word: str) -> str:
  """Shell-quotes one word; `shlex.split` gives it back unchanged.

  `--flag=value` quotes only the value, and a leading `~/` stays bare so that
  the shell which runs the command (on a remote host: that host's) expands it.
  """
  if isinstance(word, Shell):
    return str(word)
  match = _FLAG.fullmatch(word)
  if match:
    return match.group(1) + _quote_value(match.group(2))
  if word.startswith('~/'):
    return '~/' + (_quote_value(word[2:]) if word[2:] else '')
  return _quote_value(word)


def render(command: Command) -> str:
  """The copy-pasteable shell line of a command."""
  return ' '.join(quote(word) for word in command)


def gin_string(macro: str, value: str) -> str:
  """`--gin.MACRO='value'`: a gin string binding needs its own quotes."""
  return f"--gin.{macro}='{value}'"


def make_parser(script: str, description: str) -> argparse.ArgumentParser:
  """The parser of `python launch/<script>`: its docstring as --help, every
  flag written in full (no abbreviations)."""
  return argparse.ArgumentParser(
      prog=f'python launch/{script}', description=description,
      formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)


def add_install_flags(parser: argparse.ArgumentParser, extra: str,
                      where: str) -> None:
  """--install, --source, --package and --python: what --install puts on
  `where` (e.g. 'every worker'), with the package's `extra` ('tpu', 'gpu'),
  and the interpreter that runs the job there."""
  parser.add_argument('--install', action='store_true',
                      help=f'install the package (and t5x for --runner=t5x) '
                      f'on {where} first, into a Python {PYTHON_VERSION} '
                      f'virtual environment ({VENV_DIR}, made with uv) '
                      'unless --python names your own interpreter')
  parser.add_argument('--source',
                      help="what --install installs: 'checkout' (default), "
                      "this checkout's committed HEAD, sent with git archive "
                      '(uncommitted changes are not included: commit them); '
                      'or git+https://HOST/REPO@COMMIT, that commit cloned '
                      f'on {where}. Either lands in {SOURCE_DIR} and is '
                      f"pip-installed with its [{extra}] extra")
  parser.add_argument('--package',
                      help='instead of --source: a pip requirement for '
                      "--install, e.g. 'hyperprompt_jax[tpu] @ "
                      "git+https://...' or a wheel's path or URL")
  parser.add_argument('--python',
                      help=f'the interpreter on {where} (Python >= '
                      f"{PYTHON_VERSION}), e.g. '~/venv/bin/python' (`~/` "
                      'is expanded there); --install then installs into it '
                      f'and makes no virtual environment; default: '
                      f'{VENV_PYTHON}, the one --install makes')


def add_run_flags(parser: argparse.ArgumentParser,
                  default_runner: str) -> None:
  """Flags shared by the scripts: what to run and with which gin."""
  parser.add_argument('--runner', choices=RUNNERS, default=default_runner,
                      help='t5x (python -m t5x.MODE) or the built-in runner '
                      '(python -m hyperprompt_jax.MODE); default: %(default)s')
  parser.add_argument('--mode', choices=MODES, default='train',
                      help='default: %(default)s')
  parser.add_argument('--gin_file', action='append', default=[],
                      help='gin file, repeatable, resolved against the shipped '
                      "gin directory; the runner's run files: t5x/*.gin "
                      '(t5x), runs/*.gin (builtin)')
  parser.add_argument('--gin', action='append', default=[],
                      metavar='KEY=VALUE',
                      help='gin binding, repeatable, passed as '
                      "--gin.KEY=VALUE; strings need their quotes: "
                      "--gin \"X='a'\" (t5x's --gin.KEY=VALUE form is passed "
                      'through too)')
  parser.add_argument('--model_dir',
                      help='train: checkpoints and summaries (MODEL_DIR)')
  parser.add_argument('--checkpoint_path',
                      help='eval / infer / leaderboard / probe: a '
                      'checkpoint_<step> folder, or (eval, probe) a MODEL_DIR '
                      "of them (CHECKPOINT_PATH; t5x's eval reads every "
                      'checkpoint of a MODEL_DIR: for one, add --gin '
                      "\"utils.RestoreCheckpointConfig.mode='specific'\")")
  parser.add_argument('--output_dir',
                      help='eval / infer: EVAL_OUTPUT_DIR / INFER_OUTPUT_DIR')
  parser.add_argument('--tfds_data_dir',
                      help="where the TFDS data was prepared (t5x's "
                      '--tfds_data_dir; TFDS_DATA_DIR for the built-in runner)')
  parser.add_argument('--env', action='append', default=[],
                      metavar='KEY=VALUE',
                      help='environment variable of the job, repeatable, e.g. '
                      '--env JAX_COMPILATION_CACHE_DIR=gs://my-bucket/jax_cache '
                      '(exported in the job script each host runs)')
  parser.add_argument('--dry-run', action='store_true',
                      help='print the commands, one per line (the files '
                      'they write as heredocs), and run nothing')


def parse_args(parser: argparse.ArgumentParser,
               argv: Optional[Sequence[str]]) -> argparse.Namespace:
  """Parses `argv`, taking t5x-style `--gin.KEY=VALUE` words as `--gin`."""
  args, extra = parser.parse_known_args(argv)
  for word in extra:
    if word.startswith('--gin.') and '=' in word:
      args.gin.append(word[len('--gin.'):])
    elif word.startswith('--gin.'):
      parser.error(f'{word} needs a value: write {word}=VALUE')
    else:
      parser.error(f'unrecognized argument: {word}')
  return args


def check_run_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                   *, require_dirs: bool, gcs_only: bool,
                   remote: bool = False) -> None:
  """Fails early (exit 2, message naming the fix) on an unusable run;
  `remote`: the job runs on another host."""
  if not args.gin_file:
    parser.error(f'no --gin_file: name a run file of --runner={args.runner}, '
                 f'e.g. --gin_file={EXAMPLE_RUN_FILE[args.runner]} (the '
                 f'shipped ones: {RUN_FILE_DIR[args.runner]}/*.gin)')
  if args.mode in BUILTIN_ONLY_MODES and args.runner != 'builtin':
    parser.error(f'--mode={args.mode} is the built-in runner\'s command '
                 f'(python -m hyperprompt_jax.{args.mode}; t5x has none), '
                 "which reads t5x's checkpoints too: add --runner=builtin")
  check_gin_files(parser, args, remote=remote)
  for variable in args.env:
    if not re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*=.*', variable, re.DOTALL):
      parser.error(f'--env {variable!r} is not KEY=VALUE, e.g. --env '
                   'JAX_COMPILATION_CACHE_DIR=gs://my-bucket/jax_cache')
  for binding in args.gin:
    if '=' not in binding:
      parser.error(f'--gin {binding!r} is not KEY=VALUE, e.g. '
                   "--gin TRAIN_STEPS=1000 or --gin \"X='a string'\"")
  if args.mode == 'train':
    if args.checkpoint_path or args.output_dir:
      parser.error('--checkpoint_path / --output_dir are for the modes '
                   'that read a checkpoint (eval, infer, leaderboard, probe); '
                   'training writes to --model_dir')
    if require_dirs and not args.model_dir:
      parser.error('--mode=train needs --model_dir, where checkpoints go '
                   '(e.g. --model_dir=gs://my-bucket/hyperprompt/run1)')
  else:
    if args.model_dir:
      parser.error(f'--model_dir is for --mode=train; --mode={args.mode} reads '
                   '--checkpoint_path and writes --output_dir')
    if require_dirs and not args.checkpoint_path:
      parser.error(f'--mode={args.mode} needs --checkpoint_path, a '
                   'checkpoint_<step> folder (eval: or the MODEL_DIR holding '
                   'several), e.g. --checkpoint_path=gs://my-bucket/'
                   'hyperprompt/run1/checkpoint_300000')
    if require_dirs and not args.output_dir:
      parser.error(f'--mode={args.mode} needs --output_dir, where '
                   f'{OUTPUT_DIR_MACRO[args.mode]} results go')
  if gcs_only:
    for flag in ('model_dir', 'checkpoint_path', 'output_dir',
                 'tfds_data_dir'):
      value = getattr(args, flag)
      if value and not value.startswith('gs://'):
        parser.error(
            f'--{flag}={value} must be a gs:// path (e.g. gs://my-bucket/'
            'hyperprompt/run1): the hosts of a TPU pod have separate local '
            'disks, so every host must read and write the same Cloud Storage '
            'folder')


_INCLUDE = re.compile(r'''^include\s+['"]([^'"]+)['"]''', re.MULTILINE)
_REAL_TASKS = re.compile(r'tasks/(?!fixture_)[\w]+\.gin')


def reads_prepared_data(gin_files: Sequence[str]) -> bool:
  """Whether the shipped gin files (and what they include) name a task file
  of the real GLUE / SuperGLUE tasks, which read prepared TFDS data (the
  `fixture_*` ones read the package's own files). Files of the user's own
  are not read: they may exist on the hosts only."""
  seen, todo = set(), list(gin_files)
  dirs = gin_search_paths()
  while todo:
    name = todo.pop()
    if _REAL_TASKS.fullmatch(name):
      return True
    path = next((os.path.join(d, name) for d in dirs
                 if os.path.isfile(os.path.join(d, name))), None)
    if path is None or path in seen:
      continue
    seen.add(path)
    with open(path, encoding='utf-8') as f:
      todo += _INCLUDE.findall(f.read())
  return False


def gin_search_paths() -> list[str]:
  """Where the jobs look for a --gin_file: the shipped gin directory, of the
  installed package (`hyperprompt_jax.paths.gin_dir()`) and of this checkout
  (the scripts also run where the package is not installed)."""
  found = []
  try:
    from hyperprompt_jax import paths  # pylint: disable=g-import-not-at-top
    found.append(paths.gin_dir())
  except (ImportError, FileNotFoundError):
    pass
  checkout = os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), 'gin')
  if os.path.isdir(os.path.join(checkout, 'models')):
    found.append(checkout)
  return list(dict.fromkeys(os.path.realpath(p) for p in found))


# t5x's own gin files (t5x/configs/..., t5x/examples/...), which gin reads
# from the t5x package; the project's t5x run files are t5x/NAME.gin.
_T5X_PACKAGE_FILE = re.compile(r't5x/[^/]+/.+')

# Each runner's run files, under the gin directory: a runs/ file configures
# the built-in runner's loop, a t5x/ file t5x's. The other folders (models/,
# variants/, tasks/, setups/) serve both.
RUN_FILE_DIR = {'t5x': 't5x', 'builtin': 'runs'}
EXAMPLE_RUN_FILE = {'t5x': 't5x/hyperprompt_global_glue.gin',
                    'builtin': 'runs/hyperprompt_glue.gin'}
_RUNNER_NAME = {'t5x': 't5x', 'builtin': 'the built-in runner'}


def _in_gin_dir(name: str, gin_dirs: Sequence[str]) -> Optional[str]:
  """`name` as a path under the gin directory ('runs/x.gin'), or None for a
  file of the user's own. A relative name is read as the jobs read it:
  against the search paths."""
  if '://' in name:
    return None
  if os.path.exists(name):  # e.g. gin/runs/x.gin in the checkout
    path = os.path.realpath(name)
    for d in gin_dirs:
      if path.startswith(d + os.sep):
        return os.path.relpath(path, d)
  return None if os.path.isabs(name) else os.path.normpath(name)


def _check_runner_of(parser: argparse.ArgumentParser, runner: str, name: str,
                     gin_dirs: Sequence[str]) -> None:
  """Fails (exit 2) on a run file of the other runner, naming this runner's
  file of the same name where there is one."""
  other = 'builtin' if runner == 't5x' else 't5x'
  relative = _in_gin_dir(name, gin_dirs)
  if relative is None or relative.split(os.sep)[0] != RUN_FILE_DIR[other]:
    return
  twin = '/'.join([RUN_FILE_DIR[runner]] + relative.split(os.sep)[1:])
  if any(os.path.isfile(os.path.join(d, twin)) for d in gin_dirs):
    fix = f'use --gin_file={twin}, or --runner={other}'
  else:
    fix = (f'use --runner={other}, or a run file of --runner={runner} '
           f'({RUN_FILE_DIR[runner]}/*.gin, e.g. '
           f'--gin_file={EXAMPLE_RUN_FILE[runner]})')
  parser.error(
      f'--gin_file={name} is a run file of {_RUNNER_NAME[other]} '
      f'({RUN_FILE_DIR[other]}/), which --runner={runner} does not read: '
      f'{fix}')


def check_gin_files(parser: argparse.ArgumentParser,
                    args: argparse.Namespace, *, remote: bool) -> None:
  """Fails (exit 2) on a --gin_file found neither as given nor under the
  search paths, before anything is created or run.

  Not checked here: URLs (gs://...), t5x's own files where t5x is not
  installed, and, for a job on another host (`remote`), absolute paths,
  which may exist there only.
  """
  gin_dirs = gin_search_paths()
  search_paths = list(gin_dirs)
  t5x_spec = importlib.util.find_spec('t5x')
  if t5x_spec is not None and t5x_spec.submodule_search_locations:
    # gin reads 't5x/configs/...' from the t5x package's parent folder.
    search_paths.append(os.path.dirname(
        list(t5x_spec.submodule_search_locations)[0]))
  for name in args.gin_file:
    if '://' in name or os.path.exists(name) or any(
        os.path.exists(os.path.join(p, name)) for p in search_paths):
      continue
    if (args.runner == 't5x' and t5x_spec is None
        and _T5X_PACKAGE_FILE.fullmatch(name)):
      continue
    if remote and os.path.isabs(name):
      print(f'# --gin_file={name} is not on this machine: assuming it is on '
            'the remote host', file=sys.stderr)
      continue
    parser.error(
        f'--gin_file={name} not found, neither as given nor under the gin '
        f'search paths {search_paths}. Shipped files: runs/*.gin (built-in '
        'runner), t5x/*.gin (t5x runner), models/*.gin, variants/*.gin; a '
        'file of your own: give its path, or a gs:// URL')
  for name in args.gin_file:
    _check_runner_of(parser, args.runner, name, gin_dirs)
    _say_if_renamed(name, gin_dirs)


# Shipped gin folders renamed, old -> new (`gin_utils.RENAMED_GIN_FOLDERS`):
# the old folder's alias files include the new paths for one release.
RENAMED_GIN_FOLDERS = {'experiments': 'setups'}


def _say_if_renamed(name: str, gin_dirs: Sequence[str]) -> None:
  """Names the new path of a --gin_file in a renamed folder (t5x, which
  reads it through its alias file, says nothing)."""
  relative = _in_gin_dir(name, gin_dirs)
  parts = relative.split(os.sep) if relative else []
  if len(parts) == 2 and parts[0] in RENAMED_GIN_FOLDERS:
    new = f'{RENAMED_GIN_FOLDERS[parts[0]]}/{parts[1]}'
    print(f'# --gin_file={name}: gin/{parts[0]}/ is now '
          f'gin/{RENAMED_GIN_FOLDERS[parts[0]]}/; give --gin_file={new} '
          '(the old path goes in the next release)', file=sys.stderr)


def run_command(args: argparse.Namespace, python: str) -> Command:
  """`python -m t5x.MODE` or `python -m hyperprompt_jax.MODE` with its flags."""
  if args.runner == 't5x':
    # t5x resolves --gin_file only against its search paths; the package
    # prints where its gin files are installed (on the host that runs it).
    command = [python, '-m', f't5x.{args.mode}', Shell(
        f'--gin_search_paths="$({quote(python)} -m hyperprompt_jax.paths '
        'gin)"')]
  else:
    # The built-in runner always searches the shipped gin directory.
    command = [python, '-m', f'hyperprompt_jax.{args.mode}']
  command += [f'--gin_file={f}' for f in args.gin_file]
  if args.model_dir:
    command.append(gin_string('MODEL_DIR', args.model_dir))
  if args.checkpoint_path:
    command.append(gin_string('CHECKPOINT_PATH', args.checkpoint_path))
  if args.output_dir:
    command.append(gin_string(OUTPUT_DIR_MACRO[args.mode], args.output_dir))
  if args.tfds_data_dir:
    if args.runner == 't5x':
      command.append(f'--tfds_data_dir={args.tfds_data_dir}')
    else:
      command.append(gin_string('TFDS_DATA_DIR', args.tfds_data_dir))
  command += [f'--gin.{binding}' for binding in args.gin]
  return command


@dataclasses.dataclass(frozen=True)
class Source:
  """What --install installs: this checkout's commit `ref` ('checkout'), the
  git repository `url` at `ref` ('git'), or the pip requirement `url`
  ('package')."""
  kind: str
  url: str
  ref: str = ''


def _git(*words: str) -> str:
  return subprocess.run(['git', '-C', CHECKOUT, *words], capture_output=True,
                        text=True, check=True).stdout.strip()


def resolve_source(parser: argparse.ArgumentParser,
                   args: argparse.Namespace) -> Optional[Source]:
  """The Source of --install (None without it); fails (exit 2) on an
  unusable one."""
  if not args.install:
    if args.source or args.package:
      parser.error('--source / --package say what --install installs: add '
                   '--install')
    return None
  if args.package:
    if args.source:
      parser.error('--source and --package are alternatives: give one')
    return Source('package', args.package)
  if args.source in (None, 'checkout'):
    try:
      ref = _git('rev-parse', '--verify', 'HEAD^{commit}')
    except (OSError, subprocess.CalledProcessError):
      parser.error(f'--install ships this checkout ({CHECKOUT}) with git '
                   'archive, and it is not a git checkout with a commit: pass '
                   '--source=git+https://HOST/REPO@COMMIT or --package=SPEC')
    try:
      dirty = _git('status', '--porcelain', '--untracked-files=no')
    except (OSError, subprocess.CalledProcessError):
      dirty = ''
    if dirty:
      print(f'# warning: {CHECKOUT} has uncommitted changes, which --install '
            f'does not ship (it ships commit {ref}): commit them to include '
            'them', file=sys.stderr)
    return Source('checkout', CHECKOUT, ref)
  # git+URL@REF as pip writes it; the ref follows the last `@` of the path
  # (ssh://git@host/... has another in the host part).
  url = args.source[len('git+'):] if args.source.startswith('git+') else ''
  parts = urllib.parse.urlsplit(url)
  path, at, ref = parts.path.rpartition('@')
  if not ((parts.scheme and parts.netloc) or parts.scheme == 'file') or not (
      at and path and ref):
    parser.error(f'--source={args.source} is neither checkout nor '
                 'git+URL@COMMIT: write e.g. --source=git+https://github.com/'
                 'USER/hyperprompt_jax@COMMIT (a commit, so that every host '
                 'and every rerun installs the same code)')
  return Source('git', urllib.parse.urlunsplit(parts._replace(path=path)), ref)


def install_script(source: Source, runner: str, python: Optional[str],
                   extra: str, archive: str) -> list[str]:
  """The lines of the script that installs on a host: a Python venv (unless
  `python`), the source in SOURCE_DIR (from the `archive` that git archive
  made, for a 'checkout'), the package with its `extra`, and for t5x its
  pinned repositories."""
  lines = ['#!/bin/bash',
           '# Written by launch/: installs hyperprompt_jax'
           + ' and t5x' * (runner == 't5x') + ' on this host.',
           'set -ex']
  if python is None:
    lines += [
        f'# uv brings a standalone CPython {PYTHON_VERSION}: the package needs '
        f'>= {PYTHON_VERSION}.',
        render(['python3', '-m', 'pip', 'install', '--user', '--quiet', 'uv']),
        render(['test', '-x', VENV_PYTHON, Shell('||'), 'python3', '-m', 'uv',
                'venv', '--seed', f'--python={PYTHON_VERSION}', VENV_DIR])]
  pip = [python or VENV_PYTHON, '-m', 'pip', 'install']
  if source.kind == 'package':
    lines.append(render(pip + [source.url]))
  else:
    lines.append(render(['rm', '-rf', SOURCE_DIR]))
    if source.kind == 'checkout':
      lines += [f'# {source.url} at commit {source.ref}',
                render(['mkdir', '-p', HOST_DIR]),
                render(['tar', '-xzf', archive, '-C', HOST_DIR])]
    else:
      lines += [render(['git', 'clone', '--quiet', source.url, SOURCE_DIR]),
                render(['git', '-C', SOURCE_DIR, 'checkout', '--quiet',
                        source.ref])]
    lines.append(render(pip + [f'{SOURCE_DIR}[{extra}]']))
  if runner == 't5x':
    lines += [
        "# --no-deps: t5x's setup.py asks for flax, optax, clu and seqio at "
        'their git HEADs,',
        '# which would replace the versions the package pins.',
        render(pip + ['--no-deps'] + [f'{name} @ git+{url}@{commit}'
                                      for name, url, commit in T5X_REPOS]),
        render(pip + list(T5X_EXTRA_PACKAGES))]
  return lines


def job_script(job: Command, *, log: str, copy_to: str,
               worker: Sequence[str] = (),
               env: Sequence[str] = ()) -> list[str]:
  """The lines of the script that runs `job` on a host: its output, shown and
  written to `log` (a path under LOG_DIR, which may use the variables that
  the `worker` lines set), copied into the folder `copy_to` (gs:// or a
  path) when it ends, with the `env` variables (KEY=VALUE) exported; the
  script exits with the job's exit code."""
  if copy_to.startswith('gs://'):
    copy = [render(['gcloud', 'storage', 'cp', Shell('"$LOG"'),
                    copy_to + '/'])]
  else:
    copy = [render(['mkdir', '-p', copy_to]),
            render(['cp', Shell('"$LOG"'), copy_to + '/'])]
  return [
      '#!/bin/bash',
      f'# Written by launch/: runs the job, its output in the log, copied to '
      f'{copy_to}/ at the end.',
      *worker,
      *(render(['export', variable]) for variable in env),
      f'LOG={log}',
      render(['mkdir', '-p', LOG_DIR]),
      render(job + [Shell('2>&1'), Shell('|'), 'tee', Shell('"$LOG"')]),
      'code=${PIPESTATUS[0]}',
      'echo "exit code $code" | tee -a "$LOG"',
      *copy,
      'exit "$code"',
  ]


def stamp() -> str:
  """A name for this launch (UTC time): its scripts and logs carry it, so
  that a rerun neither overwrites them nor the script a running job reads."""
  return time.strftime('%Y%m%d-%H%M%S', time.gmtime())


def stage_dir(target: str) -> str:
  """The folder here where a launch writes what it sends to `target`'s hosts;
  named as HOST_DIR, so that `scp -r` lands it there."""
  assert os.sep not in target and target not in ('', '.', '..'), target
  return os.path.join(tempfile.gettempdir(), f'hyperprompt_launch-{target}',
                      os.path.basename(HOST_DIR))


def stage_commands(stage: str, source: Optional[Source]) -> list[Command]:
  """Empties `stage` (a previous launch's files would go along) and, for a
  'checkout' source, archives the checkout's commit into it."""
  result = [['rm', '-rf', os.path.dirname(stage)], ['mkdir', '-p', stage]]
  if source is not None and source.kind == 'checkout':
    result.append(['git', '-C', source.url, 'archive', '--format=tar.gz',
                   f'--prefix={os.path.basename(SOURCE_DIR)}/',
                   f'--output={os.path.join(stage, ARCHIVE)}', source.ref])
  return result


class File:
  """A file this script writes here: `--dry-run` prints it as a heredoc."""

  def __init__(self, path: str, lines: Sequence[str]):
    assert 'EOF' not in lines, lines
    self.path, self.lines = path, list(lines)

  def header(self) -> str:
    return render(['cat', Shell('>'), self.path, Shell("<<'EOF'")])

  def __str__(self) -> str:
    return '\n'.join([self.header(), *self.lines, 'EOF'])

  def write(self) -> None:
    with open(self.path, 'w') as f:
      f.write('\n'.join(self.lines) + '\n')


class Together(list):
  """Commands started at once and waited for together: the processes of one
  multi-host job, one per host. `--dry-run` prints each with ` &`, then
  `wait`, as a shell would start them."""


def _run_together(commands: 'Together') -> int:
  """Starts every command, waits for all; the first non-zero exit code."""
  procs = []
  for command in commands:
    print(f'+ {render(command)} &', file=sys.stderr, flush=True)
    procs.append(subprocess.Popen(['/bin/sh', '-c', render(command)]))
  try:
    codes = [p.wait() for p in procs]
  except KeyboardInterrupt:
    for p in procs:
      p.terminate()
    return 130
  failed = [(i, c) for i, c in enumerate(codes) if c]
  for i, code in failed:
    print(f'error: process {i} exited with status {code}: '
          f'{render(commands[i])}', file=sys.stderr)
  return failed[0][1] if failed else 0


def execute(commands: Sequence[Command], dry_run: bool) -> int:
  """Prints (`dry_run`) or runs `commands` in order (a `Together`: its
  commands at once; a `File`: written); returns the exit code, the first
  failing command's."""
  if dry_run:
    for command in commands:
      if isinstance(command, Together):
        print('\n'.join(f'{render(c)} &' for c in command) + '\nwait')
      elif isinstance(command, File):
        print(command)
      else:
        print(render(command))
    return 0
  for command in commands:
    if isinstance(command, File):
      print(f'+ {command.header()} ...', file=sys.stderr, flush=True)
      try:
        command.write()
      except OSError as e:
        print(f'error: cannot write {command.path}: {e}', file=sys.stderr)
        return 1
      continue
    if isinstance(command, Together):
      code = _run_together(command)
      if code:
        return code
      continue
    print(f'+ {render(command)}', file=sys.stderr, flush=True)
    try:
      # Through a shell, so that what runs is exactly the printed line
      # (`$(...)`, `||`, `~/`).
      subprocess.run(['/bin/sh', '-c', render(command)], check=True)
    except subprocess.CalledProcessError as e:
      # A child killed by signal N reports -N; a shell would say 128 + N.
      code = e.returncode if e.returncode > 0 else 128 - e.returncode
      why = ' (command not found: is it installed and on PATH?)' * (
          code == 127)
      print(f'error: exit code {code}{why} from: {render(command)}',
            file=sys.stderr)
      return code
    except KeyboardInterrupt:
      return 130
  return 0
