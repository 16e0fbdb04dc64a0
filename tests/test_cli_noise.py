"""The command-line tools: `--help` at once, without TensorFlow or JAX, and no
TensorFlow start-up lines on stderr (`gin_utils.cli_preamble`)."""

import json
import os
import pathlib
import re
import subprocess
import sys

from hyperprompt_jax.common import gin_utils

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / 'hyperprompt_jax'
# Every command: a module run through `gin_utils.run(main)`.
COMMANDS = sorted(p.stem for p in PACKAGE.glob('*.py')
                  if 'gin_utils.run(main)' in p.read_text())
# Gets its hook with the edit of train.py under way.
PENDING = set()
HEAVY = ('tensorflow', 'jax', 'seqio', 'flax', 'optax')

# What TensorFlow prints at start-up on a machine without a GPU.
STARTUP_LINE = re.compile(
    r'absl::InitializeLog|port\.cc|cudart_stub|cuInit|cpu_feature_guard'
    r'|oneDNN')

_HELP_ALL = """
import contextlib, io, json, runpy, sys
results = {}
for name in sys.argv[1:]:
  module = 'hyperprompt_jax.' + name
  sys.argv = [module, '--help']
  out = io.StringIO()
  code = None
  with contextlib.redirect_stdout(out):
    try:
      runpy.run_module(module, run_name='__main__', alter_sys=True)
    except SystemExit as e:
      code = e.code
  results[name] = [code, out.getvalue()]
heavy = [m for m in %r if m in sys.modules]
print(json.dumps({'results': results, 'heavy': heavy}))
""" % (HEAVY,)


def test_every_command_answers_help_without_heavy_imports():
  commands = [c for c in COMMANDS if c not in PENDING]
  assert {'eval', 'infer', 'benchmark', 'param_table'} <= set(commands)
  # One interpreter runs every command's --help: none may import the heavy
  # libraries (TensorFlow alone takes seconds).
  result = subprocess.run([sys.executable, '-c', _HELP_ALL, *commands],
                          capture_output=True, text=True, check=True, cwd=ROOT)
  report = json.loads(result.stdout)
  assert report['heavy'] == []
  own_flag = {'eval': '--metrics_dir', 'benchmark': '--batch_sizes',
              'param_table': '--flops'}
  for name, (code, text) in report['results'].items():
    assert code in (0, None), name
    assert text.startswith(f'usage: python -m hyperprompt_jax.{name}'), name
    assert '--gin_file' in text and own_flag.get(name, '--gin_file') in text
    doc_start = (PACKAGE / f'{name}.py').read_text().split('"""')[1]
    assert doc_start.split('\n')[0] in text, name


def test_a_command_prints_no_tensorflow_startup_lines(tmp_path):
  metrics = tmp_path / 'inference_eval'
  metrics.mkdir()
  (metrics / 'glue_rte-metrics.jsonl').write_text(
      '{"step": 100, "accuracy": 50.0}\n')
  env = {k: v for k, v in os.environ.items() if k != 'TF_CPP_MIN_LOG_LEVEL'}
  result = subprocess.run(
      [sys.executable, '-m', 'hyperprompt_jax.eval',
       f'--metrics_dir={metrics}', f'--output_dir={tmp_path / "out"}'],
      capture_output=True, text=True, cwd=ROOT, env=env, check=False)
  assert result.returncode == 0, result.stderr
  assert 'glue_rte' in result.stdout
  assert not [line for line in result.stderr.splitlines()
              if STARTUP_LINE.search(line)], result.stderr


def test_held_back_stderr_passes_on_all_but_the_startup_lines(capfd):
  with gin_utils._stderr_without(gin_utils._TF_STARTUP_NOISE):  # pylint: disable=protected-access
    os.write(2, b'WARNING: All log messages before absl::InitializeLog() is '
             b'called are written to STDERR\n'
             b'I0000 00:00:1795466770.676520    3491 port.cc:153] oneDNN '
             b'custom operations are on.\n'
             b'E0000 00:00:1795466776.114344    3491 cuda_platform.cc:52] '
             b'failed call to cuInit: INTERNAL: CUDA error\n'
             b'E0000 00:00:1795466776.114344    3491 kernel.cc:1] a real '
             b'error\n'
             b'W0000 00:00:1795466776.114344    3491 x.cc:1] a warning\n'
             b'Traceback (most recent call last):\n')
  assert capfd.readouterr().err == (
      'E0000 00:00:1795466776.114344    3491 kernel.cc:1] a real error\n'
      'W0000 00:00:1795466776.114344    3491 x.cc:1] a warning\n'
      'Traceback (most recent call last):\n')


_FAILING_MAIN = """
import errno, sys, zipfile
from hyperprompt_jax.common import gin_utils
failures = {
    'missing': FileNotFoundError(errno.ENOENT, 'No such file', '/x/y.npz'),
    'disk_full': OSError(errno.ENOSPC, 'No space left on device', '/run'),
    'zip': zipfile.BadZipFile('File is not a zip file'),
    'reported': gin_utils.ReportedError('The loss became NaN. Lower it.'),
    'usage': ValueError('Unknown MIXTURE_OR_TASK_NAME'),
    'bug': KeyError('a bug'),
}
def main():
  raise failures[sys.argv[1]]
gin_utils.run(main)
"""


def _fail(kind, *flags):
  return subprocess.run([sys.executable, '-c', _FAILING_MAIN, kind, *flags],
                        capture_output=True, text=True, timeout=60,
                        check=False)


def test_a_failure_with_a_known_cause_is_one_line_and_exit_1():
  """A full disk printed 195 lines of traceback; now one line naming the
  cause (and the fix where there is one), the traceback behind a flag."""
  expected = {
      'missing': "error: FileNotFoundError: [Errno 2] No such file: "
                 "'/x/y.npz'",
      'disk_full': 'error: [Errno 28] No space left on device: '
                   "'/run'. Free space",
      'zip': 'error: File is not a zip file: the file is not a whole .npz',
      'reported': 'error: The loss became NaN. Lower it.',
  }
  for kind, start in expected.items():
    result = _fail(kind)
    assert result.returncode == 1, (kind, result.stderr)
    assert result.stderr.startswith(start), (kind, result.stderr)
    assert 'Traceback' not in result.stderr
    assert len(result.stderr.splitlines()) == 2  # the line, the flag's hint
    assert 'Traceback' in _fail(kind, '--traceback').stderr
  usage = _fail('usage')
  assert (usage.returncode, usage.stderr) == (
      2, 'error: Unknown MIXTURE_OR_TASK_NAME\n')
  bug = _fail('bug')  # no cause a user can act on: the traceback is the report
  assert bug.returncode == 1 and 'Traceback' in bug.stderr
