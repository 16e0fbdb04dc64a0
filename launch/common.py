"""Shared parts of the launch scripts: flags, command lines, quoting, running.

Standard library only, so the scripts run from a laptop without JAX. A command
is a list of words; `render` shell-quotes it into the line `--dry-run` prints,
and `execute` runs exactly that line with /bin/sh.
"""

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from typing import Optional, Sequence

MODES = ('train', 'eval', 'infer')
RUNNERS = ('t5x', 'builtin')

# t5x and the two libraries it imports that the package index lacks (airio) or
# has too old (jestimator), cloned beside the package. `pip install --no-deps`:
# t5x's setup.py asks for flax, optax, clu and seqio at their git HEADs, which
# would replace this package's pinned versions.
T5X_REPOS = (
    ('t5x', 'https://github.com/google-research/t5x'),
    ('airio', 'https://github.com/google/airio'),
    ('jestimator', 'https://github.com/google-research/jestimator'),
)
# t5x's remaining run-time dependencies, not pulled in by hyperprompt_jax;
# verified with its pins (jax 0.10.2, flax 0.12.8).
T5X_EXTRA_PACKAGES = ('grain==0.2.12', 'cached_property', 'chex', 'fiddle',
                      'jaxtyping')

# The per-mode macros of t5x's run files, which the built-in runner shares.
OUTPUT_DIR_MACRO = {'eval': 'EVAL_OUTPUT_DIR', 'infer': 'INFER_OUTPUT_DIR'}

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


def remote_script(commands: Sequence[Command]) -> str:
  """Several commands as one line for `ssh HOST LINE`, stopping at the first
  failure (`set -e`: `a && b` would mis-group with `test -d x || git clone`)."""
  if len(commands) == 1:
    return render(commands[0])
  return '; '.join(['set -e'] + [render(c) for c in commands])


def gin_string(macro: str, value: str) -> str:
  """`--gin.MACRO='value'`: a gin string binding needs its own quotes."""
  return f"--gin.{macro}='{value}'"


def make_parser(script: str, description: str) -> argparse.ArgumentParser:
  """The parser of `python launch/<script>`: its docstring as --help, every
  flag written in full (no abbreviations)."""
  return argparse.ArgumentParser(
      prog=f'python launch/{script}', description=description,
      formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)


def add_install_flags(parser: argparse.ArgumentParser, package: str,
                      where: str, package_note: str = '') -> None:
  """--install, --package and --python: what is installed on `where` (e.g.
  'every worker') and the interpreter that runs it there."""
  parser.add_argument('--install', action='store_true',
                      help='install the package (and t5x for --runner=t5x) '
                      f'on {where} first')
  parser.add_argument('--package', default=package,
                      help=f'pip requirement for --install{package_note}; '
                      "default: '%(default)s'")
  parser.add_argument('--python', default='python3',
                      help=f"the interpreter on {where} (Python >= 3.11), "
                      "e.g. '~/venv/bin/python'; default: %(default)s")


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
                      'gin directory (e.g. runs/hyperprompt_glue.gin)')
  parser.add_argument('--gin', action='append', default=[],
                      metavar='KEY=VALUE',
                      help='gin binding, repeatable, passed as '
                      "--gin.KEY=VALUE; strings need their quotes: "
                      "--gin \"X='a'\" (t5x's --gin.KEY=VALUE form is passed "
                      'through too)')
  parser.add_argument('--model_dir',
                      help='train: checkpoints and summaries (MODEL_DIR)')
  parser.add_argument('--checkpoint_path',
                      help='eval / infer: a checkpoint_<step> folder, or '
                      '(eval) a MODEL_DIR of them (CHECKPOINT_PATH)')
  parser.add_argument('--output_dir',
                      help='eval / infer: EVAL_OUTPUT_DIR / INFER_OUTPUT_DIR')
  parser.add_argument('--tfds_data_dir',
                      help="where the TFDS data was prepared (t5x's "
                      '--tfds_data_dir; TFDS_DATA_DIR for the built-in runner)')
  parser.add_argument('--dry-run', action='store_true',
                      help='print the commands, one per line, and run nothing')


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
    parser.error('no --gin_file: name a run file, e.g. '
                 '--gin_file=runs/hyperprompt_glue.gin')
  check_gin_files(parser, args, remote=remote)
  for binding in args.gin:
    if '=' not in binding:
      parser.error(f'--gin {binding!r} is not KEY=VALUE, e.g. '
                   "--gin TRAIN_STEPS=1000 or --gin \"X='a string'\"")
  if args.mode == 'train':
    if args.checkpoint_path or args.output_dir:
      parser.error('--checkpoint_path / --output_dir are for --mode=eval / '
                   'infer; training writes to --model_dir')
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
    for flag in ('model_dir', 'checkpoint_path', 'output_dir'):
      value = getattr(args, flag)
      if value and not value.startswith('gs://'):
        parser.error(
            f'--{flag}={value} must be a gs:// path (e.g. gs://my-bucket/'
            'hyperprompt/run1): the hosts of a TPU pod have separate local '
            'disks, so every host must read and write the same Cloud Storage '
            'folder')


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


def check_gin_files(parser: argparse.ArgumentParser,
                    args: argparse.Namespace, *, remote: bool) -> None:
  """Fails (exit 2) on a --gin_file found neither as given nor under the
  search paths, before anything is created or run.

  Not checked here: URLs (gs://...), t5x's own files where t5x is not
  installed, and, for a job on another host (`remote`), absolute paths,
  which may exist there only.
  """
  search_paths = gin_search_paths()
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


def install_commands(package: str, runner: str, python: str) -> list[Command]:
  """pip-installs `package`, and t5x beside it for the t5x runner."""
  pip = [python, '-m', 'pip', 'install']
  commands = [pip + [package]]
  if runner == 't5x':
    for name, url in T5X_REPOS:
      # Skips a clone already there, so that --install can be repeated.
      commands.append(['test', '-d', name, Shell('||'),
                       'git', 'clone', '--depth=1', url, name])
    commands.append(pip + ['--no-deps'] + [f'./{n}' for n, _ in T5X_REPOS])
    commands.append(pip + list(T5X_EXTRA_PACKAGES))
  return commands


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
  commands at once); returns the exit code, the first failing command's."""
  if dry_run:
    for command in commands:
      if isinstance(command, Together):
        print('\n'.join(f'{render(c)} &' for c in command) + '\nwait')
      else:
        print(render(command))
    return 0
  for command in commands:
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
