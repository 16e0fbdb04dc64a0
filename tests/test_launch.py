"""The launch scripts (launch/*.py): the commands `--dry-run` prints, their
quoting through one and two shells, running in order, and input errors.

No network and no gcloud: the scripts run as subprocesses from the repository
root; runs that execute use fake `gcloud` / `python3` programs on PATH.
"""

import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

TPU = ['--tpu=hp-pod', '--zone=us-central2-b']
SSH = ('gcloud compute tpus tpu-vm ssh hp-pod --zone=us-central2-b '
       '--worker=all --command=')
T5X_INSTALL = (
    "python3 -m pip install 'hyperprompt_jax[tpu]'; "
    'test -d t5x || git clone --depth=1 https://github.com/google-research/t5x'
    ' t5x; '
    'test -d airio || git clone --depth=1 https://github.com/google/airio '
    'airio; '
    'test -d jestimator || git clone --depth=1 '
    'https://github.com/google-research/jestimator jestimator; '
    'python3 -m pip install --no-deps ./t5x ./airio ./jestimator; '
    'python3 -m pip install grain==0.2.12 cached_property chex fiddle '
    'jaxtyping')
SEARCH_PATHS = '--gin_search_paths="$(python3 -m hyperprompt_jax.paths gin)"'


def _launch(script, *args, env=None):
  return subprocess.run([sys.executable, f'launch/{script}', *args], cwd=ROOT,
                        capture_output=True, text=True, env=env, check=False)


def _dry_run(script, *args):
  result = _launch(script, *args, '--dry-run')
  assert result.returncode == 0, result.stderr
  return result.stdout.splitlines()


def _sh_words(line):
  """The argv /bin/sh makes of `line` (no command is run)."""
  out = subprocess.run(['/bin/sh', '-c', 'printf "%s\\0" ' + line],
                       capture_output=True, text=True, check=True).stdout
  return out.split('\0')[:-1]


def _remote(line):
  """The --command=... of a gcloud ssh line, unquoted."""
  (command,) = [w for w in shlex.split(line) if w.startswith('--command=')]
  return command[len('--command='):]


def _fake(directory, name, body):
  """An executable `directory/name` running the Python `body` (argv in
  `args`, the log file in `LOG`)."""
  path = directory / name
  path.write_text(
      f'#!{sys.executable}\n'
      'import json, os, subprocess, sys\n'
      'args = sys.argv[1:]\n'
      "LOG = os.environ['FAKE_LOG']\n" + body)
  path.chmod(0o755)
  return path


def _log_argv(name):
  return (f"with open(LOG, 'a') as f:\n"
          f"  f.write(json.dumps([{name!r}] + args) + '\\n')\n")


def _read_log(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


# TPU pod.


def test_tpu_v4_32_create_install_train_with_t5x():
  lines = _dry_run('tpu_pod.py', *TPU, '--accelerator=v4-32', '--create',
                   '--install', '--gin_file=t5x/hyperprompt_global_glue.gin',
                   '--model_dir=gs://b/run')
  assert lines == [
      'gcloud compute tpus tpu-vm create hp-pod --zone=us-central2-b '
      '--accelerator-type=v4-32 --version=tpu-ubuntu2204-base',
      SSH + f'"set -e; {T5X_INSTALL}"',
      SSH + "'python3 -m t5x.train "
      '--gin_search_paths="$(python3 -m hyperprompt_jax.paths gin)" '
      '--gin_file=t5x/hyperprompt_global_glue.gin '
      '--gin.MODEL_DIR="\'"\'"\'gs://b/run\'"\'"\'"\'',
  ]
  # What the workers' shell receives, read back with shlex and with sh.
  assert _remote(lines[2]) == (
      f'python3 -m t5x.train {SEARCH_PATHS} '
      '--gin_file=t5x/hyperprompt_global_glue.gin '
      '--gin.MODEL_DIR="\'gs://b/run\'"')
  assert _sh_words(lines[2]) == shlex.split(lines[2])
  assert shlex.split(_remote(lines[2])) == [
      'python3', '-m', 't5x.train',
      '--gin_search_paths=$(python3 -m hyperprompt_jax.paths gin)',
      '--gin_file=t5x/hyperprompt_global_glue.gin',
      "--gin.MODEL_DIR='gs://b/run'"]
  assert _remote(lines[1]) == f'set -e; {T5X_INSTALL}'


def test_tpu_gin_bindings_project_and_tfds_data_dir():
  (line,) = _dry_run(
      'tpu_pod.py', *TPU, '--project=my-proj', '--gin_file=t5x/mtl_glue.gin',
      '--gin_file=t5x/adapter_glue.gin', '--model_dir=gs://b/run',
      '--tfds_data_dir=gs://b/tfds', '--gin', 'TRAIN_STEPS=1000',
      '--gin', "MIXTURE_OR_TASK_NAME='glue_rte'", '--gin.BATCH_SIZE=64')
  assert line.startswith('gcloud compute tpus tpu-vm ssh hp-pod '
                         '--zone=us-central2-b --project=my-proj '
                         '--worker=all --command=')
  assert shlex.split(_remote(line)) == [
      'python3', '-m', 't5x.train',
      '--gin_search_paths=$(python3 -m hyperprompt_jax.paths gin)',
      '--gin_file=t5x/mtl_glue.gin', '--gin_file=t5x/adapter_glue.gin',
      "--gin.MODEL_DIR='gs://b/run'", '--tfds_data_dir=gs://b/tfds',
      '--gin.TRAIN_STEPS=1000', "--gin.MIXTURE_OR_TASK_NAME='glue_rte'",
      '--gin.BATCH_SIZE=64']


@pytest.mark.parametrize('mode,macro', [('eval', 'EVAL_OUTPUT_DIR'),
                                        ('infer', 'INFER_OUTPUT_DIR')])
def test_tpu_eval_and_infer_with_t5x(mode, macro):
  (line,) = _dry_run('tpu_pod.py', *TPU, f'--mode={mode}',
                     '--gin_file=t5x/mtl_glue.gin',
                     '--checkpoint_path=gs://b/run/checkpoint_1000',
                     f'--output_dir=gs://b/{mode}')
  assert shlex.split(_remote(line)) == [
      'python3', '-m', f't5x.{mode}',
      '--gin_search_paths=$(python3 -m hyperprompt_jax.paths gin)',
      '--gin_file=t5x/mtl_glue.gin',
      "--gin.CHECKPOINT_PATH='gs://b/run/checkpoint_1000'",
      f"--gin.{macro}='gs://b/{mode}'"]


def test_tpu_builtin_runner():
  lines = _dry_run('tpu_pod.py', *TPU, '--runner=builtin', '--install',
                   '--gin_file=runs/hyperprompt_glue.gin',
                   '--model_dir=gs://b/run', '--tfds_data_dir=gs://b/tfds')
  # No t5x to install, no search path (the runner searches its gin files).
  assert lines == [
      SSH + '"python3 -m pip install \'hyperprompt_jax[tpu]\'"',
      SSH + '"python3 -m hyperprompt_jax.train '
      '--gin_file=runs/hyperprompt_glue.gin '
      '--gin.MODEL_DIR=\\"\'gs://b/run\'\\" '
      '--gin.TFDS_DATA_DIR=\\"\'gs://b/tfds\'\\" --multiprocess"',
  ]
  assert _sh_words(lines[1]) == shlex.split(lines[1])
  assert shlex.split(_remote(lines[1])) == [
      'python3', '-m', 'hyperprompt_jax.train',
      '--gin_file=runs/hyperprompt_glue.gin', "--gin.MODEL_DIR='gs://b/run'",
      "--gin.TFDS_DATA_DIR='gs://b/tfds'", '--multiprocess']


def test_tpu_package_and_python():
  lines = _dry_run('tpu_pod.py', *TPU, '--runner=builtin', '--install',
                   '--package=git+https://github.com/me/hp.git#egg=hp[tpu]',
                   '--python=~/venv/bin/python', '--mode=infer',
                   '--gin_file=runs/mtl_glue.gin', '--checkpoint_path=gs://b/c',
                   '--output_dir=gs://b/o')
  assert lines[0] == SSH + ('"~/venv/bin/python -m pip install '
                            '\'git+https://github.com/me/hp.git#egg=hp[tpu]\'"')
  # `~/` stays bare so that each worker expands it to its own home.
  assert _remote(lines[1]).startswith(
      '~/venv/bin/python -m hyperprompt_jax.infer --gin_file=runs/mtl_glue.gin ')


@pytest.mark.parametrize('accelerator,version', [
    ('v4-32', 'tpu-ubuntu2204-base'),
    ('v5litepod-16', 'v2-alpha-tpuv5-lite'),
    ('v5p-128', 'v2-alpha-tpuv5'),
    ('v6e-8', 'v2-alpha-tpuv6e'),
])
def test_tpu_create_runtime_version_per_generation(accelerator, version):
  lines = _dry_run('tpu_pod.py', *TPU, '--project=p', '--create',
                   f'--accelerator={accelerator}', '--gin_file=t5x/mtl_glue.gin',
                   '--model_dir=gs://b/run')
  assert lines[0] == (
      'gcloud compute tpus tpu-vm create hp-pod --zone=us-central2-b '
      f'--project=p --accelerator-type={accelerator} --version={version}')
  lines = _dry_run('tpu_pod.py', *TPU, '--create', '--runtime_version=mine',
                   f'--accelerator={accelerator}', '--gin_file=t5x/mtl_glue.gin',
                   '--model_dir=gs://b/run')
  assert lines[0].endswith(' --version=mine')


@pytest.mark.parametrize('args,fix', [
    (['--model_dir=/tmp/run'], 'must be a gs:// path'),
    (['--model_dir=b/run'], 'separate local disks'),
    (['--mode=eval', '--output_dir=gs://b/e'], 'needs --checkpoint_path'),
    (['--mode=infer', '--output_dir=gs://b/e'], 'needs --checkpoint_path'),
    (['--mode=eval', '--checkpoint_path=gs://b/c'], 'needs --output_dir'),
    (['--mode=eval', '--checkpoint_path=/ckpt', '--output_dir=gs://b/e'],
     '--checkpoint_path=/ckpt must be a gs:// path'),
    (['--mode=eval', '--model_dir=gs://b/run'], 'reads --checkpoint_path'),
    ([], '--mode=train needs --model_dir'),
    (['--model_dir=gs://b/r', '--accelerator=v4_32'], 'e.g. v4-32'),
    (['--model_dir=gs://b/r', '--accelerator=4-32'], 'e.g. v4-32'),
    (['--model_dir=gs://b/r', '--accelerator=v4'], 'e.g. v4-32'),
    (['--model_dir=gs://b/r', '--create'], '--create needs --accelerator'),
    (['--model_dir=gs://b/r', '--gin', 'TRAIN_STEPS'], 'is not KEY=VALUE'),
    (['--model_dir=gs://b/r', '--gin.TRAIN_STEPS'], '--gin.TRAIN_STEPS=VALUE'),
    (['--model_dir=gs://b/r', '--bogus'], 'unrecognized argument: --bogus'),
])
def test_tpu_bad_input_fails_naming_the_fix(args, fix):
  result = _launch('tpu_pod.py', *TPU, '--gin_file=t5x/mtl_glue.gin', *args,
                   '--dry-run')
  assert result.returncode == 2
  assert fix in result.stderr
  assert not result.stdout


def test_tpu_needs_a_gin_file():
  result = _launch('tpu_pod.py', *TPU, '--model_dir=gs://b/r', '--dry-run')
  assert result.returncode == 2
  assert 'no --gin_file' in result.stderr


def test_tpu_runs_commands_in_order_and_stops_at_the_first_failure(tmp_path):
  log = tmp_path / 'log'
  # gcloud fails its second call (the install) with exit code 7.
  _fake(tmp_path, 'gcloud', _log_argv('gcloud') +
        'sys.exit(7 if len(open(LOG).readlines()) == 2 else 0)\n')
  env = dict(os.environ, PATH=f'{tmp_path}:{os.environ["PATH"]}',
             FAKE_LOG=str(log))
  args = [*TPU, '--accelerator=v4-32', '--create', '--install',
          '--gin_file=t5x/mtl_glue.gin', '--model_dir=gs://b/run']
  expected = [shlex.split(line) for line in _dry_run('tpu_pod.py', *args)]
  result = _launch('tpu_pod.py', *args, env=env)
  assert result.returncode == 7
  assert 'exit code 7' in result.stderr
  assert _read_log(log) == expected[:2]  # the run never started

  log.unlink()
  _fake(tmp_path, 'gcloud', _log_argv('gcloud'))
  result = _launch('tpu_pod.py', *args, env=env)
  assert result.returncode == 0, result.stderr
  assert _read_log(log) == expected


def test_tpu_run_command_through_ssh_and_the_workers_shell(tmp_path):
  """A fake gcloud runs --command with sh, as a worker's login shell would;
  a fake python3 answers `-m hyperprompt_jax.paths gin` and logs the rest."""
  log = tmp_path / 'log'
  _fake(tmp_path, 'gcloud', _log_argv('gcloud') +
        "(command,) = [a for a in args if a.startswith('--command=')]\n"
        "sys.exit(subprocess.run(['/bin/sh', '-c', "
        "command[len('--command='):]]).returncode)\n")
  _fake(tmp_path, 'python3',
        "if args == ['-m', 'hyperprompt_jax.paths', 'gin']:\n"
        "  print('/site/hyperprompt_jax/gin')\n"
        '  sys.exit(0)\n' + _log_argv('python3'))
  env = dict(os.environ, PATH=f'{tmp_path}:{os.environ["PATH"]}',
             FAKE_LOG=str(log))
  result = _launch('tpu_pod.py', *TPU, '--gin_file=t5x/mtl_glue.gin',
                   '--model_dir=gs://b/my run', '--gin',
                   """X='it''s "odd" $HOME !'""", env=env)
  assert result.returncode == 0, result.stderr
  assert _read_log(log)[1] == [
      'python3', '-m', 't5x.train',
      '--gin_search_paths=/site/hyperprompt_jax/gin', '--gin_file=t5x/mtl_glue.gin',
      "--gin.MODEL_DIR='gs://b/my run'", """--gin.X='it''s "odd" $HOME !'"""]


# Single GPU host.


def test_gpu_here_install_and_train():
  lines = _dry_run('gpu.py', '--install', '--mem_fraction=0.9',
                   '--gin_file=runs/hyperprompt_glue.gin',
                   '--model_dir=/data/hp run', '--gin', 'TRAIN_STEPS=10')
  assert lines == [
      "python3 -m pip install 'hyperprompt_jax[gpu]'",
      'env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 -m hyperprompt_jax.train '
      '--gin_file=runs/hyperprompt_glue.gin '
      '--gin.MODEL_DIR="\'/data/hp run\'" --gin.TRAIN_STEPS=10',
  ]
  assert shlex.split(lines[1])[-2] == "--gin.MODEL_DIR='/data/hp run'"


@pytest.mark.parametrize('runner, module', [('builtin', 'hyperprompt_jax'),
                                            ('t5x', 't5x')])
def test_gpu_passes_the_memory_settings_to_either_runner(runner, module):
  """--num_microbatches / --remat_policy become the macros both runners'
  train.gin read; they are training settings only."""
  lines = _dry_run('gpu.py', f'--runner={runner}',
                   '--gin_file=t5x/mtl_glue.gin', '--model_dir=/data/run',
                   '--num_microbatches=4', '--remat_policy=full')
  words = shlex.split(lines[-1])
  assert words[:3] == ['python3', '-m', f'{module}.train']
  assert words[-2:] == ['--gin.NUM_MICROBATCHES=4',
                        "--gin.REMAT_POLICY='full'"]
  for bad, message in [(['--mode=eval', '--checkpoint_path=/r',
                         '--output_dir=/o', '--num_microbatches=2'],
                        'training settings'),
                       (['--model_dir=/r', '--num_microbatches=0'],
                        'must be >= 1'),
                       (['--model_dir=/r', '--remat_policy=some'],
                        'invalid choice')]:
    result = _launch('gpu.py', f'--runner={runner}',
                     '--gin_file=t5x/mtl_glue.gin', *bad, '--dry-run')
    assert result.returncode == 2 and message in result.stderr, bad


def test_gpu_over_ssh_with_t5x():
  lines = _dry_run('gpu.py', '--host=me@gpu-box', '--install', '--runner=t5x',
                   '--mode=eval', '--gin_file=t5x/mtl_glue.gin',
                   '--checkpoint_path=/data/run', '--output_dir=/data/eval')
  assert lines[0] == ('ssh me@gpu-box "set -e; '
                      + T5X_INSTALL.replace('[tpu]', '[gpu]') + '"')
  assert shlex.split(lines[1])[:2] == ['ssh', 'me@gpu-box']
  assert shlex.split(shlex.split(lines[1])[2]) == [
      'python3', '-m', 't5x.eval',
      '--gin_search_paths=$(python3 -m hyperprompt_jax.paths gin)',
      '--gin_file=t5x/mtl_glue.gin', "--gin.CHECKPOINT_PATH='/data/run'",
      "--gin.EVAL_OUTPUT_DIR='/data/eval'"]


def test_gpu_on_two_hosts_starts_one_process_each():
  """Each host runs the same command as process i of 2, process 0's machine
  coordinating; started together (`&`, then `wait`)."""
  lines = _dry_run('gpu.py', '--host=me@gpu-0', '--host=me@gpu-1',
                   '--install', '--gin_file=runs/hyperprompt_glue.gin',
                   '--model_dir=/nfs/hp')
  assert lines[:2] == [f'ssh me@gpu-{i} "python3 -m pip install '
                       "'hyperprompt_jax[gpu]'\"" for i in (0, 1)]
  assert lines[-1] == 'wait'
  for i, line in enumerate(lines[2:4]):
    words = shlex.split(line)
    assert words[:2] == ['ssh', f'me@gpu-{i}'] and words[-1] == '&'
    assert shlex.split(words[2]) == [
        'python3', '-m', 'hyperprompt_jax.train',
        '--gin_file=runs/hyperprompt_glue.gin', "--gin.MODEL_DIR='/nfs/hp'",
        '--coordinator_address=gpu-0:12345', '--num_processes=2',
        f'--process_id={i}']
  t5x = _dry_run('gpu.py', '--host=a', '--host=b', '--runner=t5x',
                 '--coordinator_address=10.0.0.1:999',
                 '--gin_file=t5x/mtl_glue.gin', '--model_dir=/nfs/hp')
  assert shlex.split(shlex.split(t5x[1])[2])[-4:] == [
      '--multiprocess_gpu', '--coordinator_address=10.0.0.1:999',
      '--process_count=2', '--process_index=1']


@pytest.mark.parametrize('args,fix', [
    (['--host=a', '--host=a', '--model_dir=/m'], 'names a host twice'),
    (['--coordinator_address=a:1', '--model_dir=/m'], 'repeat --host'),
    (['--mem_fraction=1.5'], 'must be in (0, 1]'),
    (['--mode=infer', '--checkpoint_path=/c'], 'needs --output_dir'),
    ([], '--mode=train needs --model_dir'),
])
def test_gpu_bad_input(args, fix):
  result = _launch('gpu.py', '--gin_file=runs/mtl_glue.gin', *args, '--dry-run')
  assert result.returncode == 2
  assert fix in result.stderr


# This machine.


@pytest.mark.parametrize('mode,gin_file', [
    ('train', 'runs/quickstart.gin'),
    ('eval', 'runs/quickstart_eval.gin'),
    ('infer', 'runs/quickstart_infer.gin'),
])
def test_local_defaults_to_the_quickstart(mode, gin_file):
  (line,) = _dry_run('local.py', f'--mode={mode}')
  assert shlex.split(line) == [sys.executable, '-m', f'hyperprompt_jax.{mode}',
                               f'--gin_file={gin_file}']
  assert (ROOT / 'gin' / gin_file).is_file()


def test_local_overrides_and_t5x():
  (line,) = _dry_run('local.py', '--python=python3', '--model_dir=/tmp/q',
                     '--gin.TRAIN_STEPS=20')
  assert line == ('python3 -m hyperprompt_jax.train '
                  '--gin_file=runs/quickstart.gin '
                  '--gin.MODEL_DIR="\'/tmp/q\'" --gin.TRAIN_STEPS=20')
  (line,) = _dry_run('local.py', '--python=python3', '--runner=t5x',
                     '--gin_file=t5x/mtl_glue.gin', '--model_dir=/tmp/q')
  assert line == (f'python3 -m t5x.train {SEARCH_PATHS} --gin_file=t5x/mtl_glue.gin '
                  '--gin.MODEL_DIR="\'/tmp/q\'"')
  result = _launch('local.py', '--runner=t5x', '--dry-run')
  assert result.returncode == 2
  assert 'needs --gin_file' in result.stderr


@pytest.mark.parametrize('code', [0, 3])
def test_local_runs_the_job_and_exits_with_its_code(tmp_path, code):
  log = tmp_path / 'log'
  python = _fake(tmp_path, 'python', _log_argv('python') +
                 "print('job output')\n"
                 "sys.exit(int(os.environ['FAKE_CODE']))\n")
  env = dict(os.environ, FAKE_LOG=str(log), FAKE_CODE=str(code))
  result = _launch('local.py', f'--python={python}', '--model_dir=/tmp/q r',
                   env=env)
  assert result.returncode == code
  assert result.stdout == 'job output\n'
  assert _read_log(log) == [[
      'python', '-m', 'hyperprompt_jax.train',
      '--gin_file=runs/quickstart.gin', "--gin.MODEL_DIR='/tmp/q r'"]]


# Gin files are checked before anything is created or run.


def test_a_missing_gin_file_fails_before_the_pod_is_touched(tmp_path):
  log = tmp_path / 'log'
  _fake(tmp_path, 'gcloud', _log_argv('gcloud'))
  env = dict(os.environ, PATH=f'{tmp_path}:{os.environ["PATH"]}',
             FAKE_LOG=str(log))
  result = _launch('tpu_pod.py', *TPU, '--accelerator=v4-32', '--create',
                   '--gin_file=t5x/hyperprompt_globl_glue.gin',
                   '--model_dir=gs://b/run', env=env)
  assert result.returncode == 2
  assert '--gin_file=t5x/hyperprompt_globl_glue.gin not found' in result.stderr
  assert str(ROOT / 'gin') in result.stderr  # the search path
  assert not log.exists()  # gcloud never ran


@pytest.mark.parametrize('script,args', [
    ('local.py', []),
    ('local.py', ['--runner=t5x']),
    ('gpu.py', ['--model_dir=/d']),
    ('gpu.py', ['--host=me@gpu-box', '--model_dir=/d']),
])
def test_a_missing_gin_file_is_refused_by_every_script(script, args):
  for missing in ('runs/hyperprompt_glu.gin', '/nowhere/run.gin'):
    if missing.startswith('/') and '--host=me@gpu-box' in args:
      continue  # may exist on the remote host: see below
    result = _launch(script, *args, f'--gin_file={missing}', '--dry-run')
    assert result.returncode == 2, missing
    assert f'--gin_file={missing} not found' in result.stderr
    assert not result.stdout


def test_gin_files_that_exist_elsewhere_pass(tmp_path):
  own = tmp_path / 'my_run.gin'
  own.write_text('')
  # Our own file, a URL, and an absolute path on the remote host.
  for script, args in (
      ('local.py', [f'--gin_file={own}']),
      ('tpu_pod.py', [*TPU, '--gin_file=gs://b/my_run.gin',
                      '--model_dir=gs://b/r']),
      ('gpu.py', ['--host=me@gpu-box', '--gin_file=/home/me/my_run.gin',
                  '--model_dir=/d'])):
    result = _launch(script, *args, '--dry-run')
    assert result.returncode == 0, result.stderr
