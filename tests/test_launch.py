"""The launch scripts (launch/*.py): the commands and host scripts `--dry-run`
prints, their quoting through the shells, running in order, the jobs' logs,
and input errors.

No network and no gcloud: the scripts run as subprocesses from the repository
root; runs that execute use fake `gcloud`, `python3`, `curl` programs on PATH
and a fake home folder for the workers.
"""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEAD = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=ROOT, text=True,
                      capture_output=True, check=True).stdout.strip()

TPU = ['--tpu=hp-pod', '--zone=us-central2-b', '--tfds_data_dir=gs://b/tfds']
WHERE = '--zone=us-central2-b'
SSH = f'gcloud compute tpus tpu-vm ssh hp-pod {WHERE} --worker=all --command='
STAGE = 'TMP/hyperprompt_launch-hp-pod/hyperprompt_launch'
GPU_STAGE = 'TMP/hyperprompt_launch-gpu/hyperprompt_launch'
VENV_PY = '~/hyperprompt_venv/bin/python'
SEARCH_PATHS = (f'--gin_search_paths="$({VENV_PY} -m hyperprompt_jax.paths '
                'gin)"')
WORKER = ('W=$(curl -sf -H Metadata-Flavor:Google http://metadata.google.'
          'internal/computeMetadata/v1/instance/attributes/'
          'agent-worker-number || hostname)')

# The lines of install.sh.
VENV = [
    '# uv brings a standalone CPython 3.11: the package needs >= 3.11.',
    'python3 -m pip install --user --quiet uv',
    'test -x ~/hyperprompt_venv/bin/python || python3 -m uv venv --seed '
    '--python=3.11 ~/hyperprompt_venv',
]
UNPACK = [
    'rm -rf ~/hyperprompt_launch/hyperprompt_jax',
    '# ROOT at commit COMMIT',
    'mkdir -p ~/hyperprompt_launch',
    'tar -xzf ~/hyperprompt_launch/hyperprompt_jax.tar.gz -C '
    '~/hyperprompt_launch',
]
T5X_PINNED = [
    "# --no-deps: t5x's setup.py asks for flax, optax, clu and seqio at their "
    'git HEADs,',
    '# which would replace the versions the package pins.',
    f"{VENV_PY} -m pip install --no-deps "
    "'t5x @ git+https://github.com/google-research/t5x"
    "@cc342d419ec3e3e9c4bf1df33c82330cafdc1e16' "
    "'airio @ git+https://github.com/google/airio"
    "@69897df7d9a427b947a9f7bb4164c7782b43e601' "
    "'jestimator @ git+https://github.com/google-research/jestimator"
    "@326824a477feef6d92e6f44175000907a72899ca'",
    f'{VENV_PY} -m pip install grain==0.2.12 cached_property chex fiddle '
    'jaxtyping',
]


def _install_sh(*body, t5x):
  return ['#!/bin/bash',
          '# Written by launch/: installs hyperprompt_jax'
          + ' and t5x' * t5x + ' on this host.',
          'set -ex', *body]


def _job_sh(job, log, copy, worker=(), quoted=None):
  """A job script; `quoted`: `copy` as the shell reads it, if it needs
  quotes (the folder itself, then with a slash)."""
  quoted = quoted or (copy, copy + '/')
  return ['#!/bin/bash',
          '# Written by launch/: runs the job, its output in the log, copied '
          f'to {copy}/ at the end.',
          *worker, f'LOG={log}', 'mkdir -p ~/hyperprompt_logs',
          job + ' 2>&1 | tee "$LOG"', 'code=${PIPESTATUS[0]}',
          'echo "exit code $code" | tee -a "$LOG"',
          *([f'gcloud storage cp "$LOG" {quoted[1]}']
            if copy.startswith('gs://')
            else [f'mkdir -p {quoted[0]}', f'cp "$LOG" {quoted[1]}']),
          'exit "$code"']


def _launch(script, *args, env=None):
  return subprocess.run([sys.executable, f'launch/{script}', *args], cwd=ROOT,
                        capture_output=True, text=True, env=env, check=False)


_STAMP = re.compile(r'\b\d{8}-\d{6}\b')


def _normalize(text):
  """The launch's time stamp as STAMP, this checkout's commit as COMMIT, its
  path as ROOT, the temporary folder as TMP."""
  stamps = set(_STAMP.findall(text))
  assert len(stamps) <= 1, stamps  # one launch, one name
  text = _STAMP.sub('STAMP', text)
  stage = os.path.join(tempfile.gettempdir(), 'hyperprompt_launch-')
  text = text.replace(stage, 'TMP/hyperprompt_launch-')
  return text.replace(HEAD, 'COMMIT').replace(str(ROOT), 'ROOT')


def _dry_run(script, *args, env=None):
  """(the printed lines, the files the heredocs write: path -> lines)."""
  result = _launch(script, *args, '--dry-run', env=env)
  assert result.returncode == 0, result.stderr
  lines = _normalize(result.stdout).splitlines()
  files, i = {}, 0
  while i < len(lines):
    match = re.fullmatch(r"cat > (\S+) <<'EOF'", lines[i])
    if match:
      end = lines.index('EOF', i)
      files[match.group(1)] = lines[i + 1:end]
      i = end
    i += 1
  return lines, files


def _commands(lines):
  """The printed lines without the heredocs' bodies."""
  out, skip = [], False
  for line in lines:
    if skip:
      skip = line != 'EOF'
      continue
    out.append(line)
    skip = line.endswith("<<'EOF'")
  return out


def _job_line(script_lines):
  """The job's command line in a job script, unquoted by sh."""
  (line,) = [l for l in script_lines if l.endswith(' 2>&1 | tee "$LOG"')]
  return _sh_words(line[:-len(' 2>&1 | tee "$LOG"')])


def _sh_words(line):
  """The argv /bin/sh makes of `line`, no command run: `$(...)` and `~/` are
  kept as written (the former escaped, the latter expanded to HOME=~)."""
  out = subprocess.run(['/bin/sh', '-c', 'printf "%s\\0" '
                        + line.replace('$(', '\\$(')],
                       capture_output=True, text=True, check=True,
                       env=dict(os.environ, HOME='~')).stdout
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
      'import json, os, shutil, subprocess, sys\n'
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
  lines, files = _dry_run(
      'tpu_pod.py', *TPU, '--accelerator=v4-32', '--create', '--install',
      '--gin_file=t5x/hyperprompt_global_glue.gin', '--model_dir=gs://b/run')
  job = (f'{VENV_PY} -m t5x.train {SEARCH_PATHS} '
         '--gin_file=t5x/hyperprompt_global_glue.gin '
         '--gin.MODEL_DIR="\'gs://b/run\'" --tfds_data_dir=gs://b/tfds')
  assert lines == [
      'gcloud compute tpus tpu-vm create hp-pod --zone=us-central2-b '
      '--accelerator-type=v4-32 --version=tpu-ubuntu2204-base',
      # This machine: the worker scripts and this checkout's commit.
      'rm -rf TMP/hyperprompt_launch-hp-pod',
      f'mkdir -p {STAGE}',
      'git -C ROOT archive --format=tar.gz --prefix=hyperprompt_jax/ '
      f'--output={STAGE}/hyperprompt_jax.tar.gz COMMIT',
      f"cat > {STAGE}/install.sh <<'EOF'",
      *_install_sh(*VENV, *UNPACK,
                   f"{VENV_PY} -m pip install "
                   "~/'hyperprompt_launch/hyperprompt_jax[tpu]'",
                   *T5X_PINNED, t5x=True),
      'EOF',
      f"cat > {STAGE}/train-STAMP.sh <<'EOF'",
      *_job_sh(job, '~/hyperprompt_logs/train-STAMP-worker$W.log',
               'gs://b/run/logs', worker=[WORKER]),
      'EOF',
      # Every worker: the scripts, install, the job in the background.
      f'gcloud compute tpus tpu-vm scp --recurse {STAGE} hp-pod: {WHERE} '
      '--worker=all',
      SSH + "'bash ~/hyperprompt_launch/install.sh'",
      SSH + "'setsid nohup bash ~/hyperprompt_launch/train-STAMP.sh > "
      "/dev/null 2>&1 < /dev/null &'",
  ]
  assert _job_line(files[f'{STAGE}/train-STAMP.sh']) == [
      VENV_PY, '-m', 't5x.train',
      f'--gin_search_paths=$({VENV_PY} -m hyperprompt_jax.paths gin)',
      '--gin_file=t5x/hyperprompt_global_glue.gin',
      "--gin.MODEL_DIR='gs://b/run'", '--tfds_data_dir=gs://b/tfds']


_GIN_FILE = {'t5x': 't5x/mtl_glue.gin', 'builtin': 'runs/mtl_glue.gin'}
_DIRS = {
    'train': (['--model_dir=gs://b/run'], 'gs://b/run/logs',
              ["--gin.MODEL_DIR='gs://b/run'"]),
    'eval': (['--checkpoint_path=gs://b/run/checkpoint_1000',
              '--output_dir=gs://b/eval/'], 'gs://b/eval/logs',
             ["--gin.CHECKPOINT_PATH='gs://b/run/checkpoint_1000'",
              "--gin.EVAL_OUTPUT_DIR='gs://b/eval/'"]),
    'infer': (['--checkpoint_path=gs://b/run/checkpoint_1000',
               '--output_dir=gs://b/infer'], 'gs://b/infer/logs',
              ["--gin.CHECKPOINT_PATH='gs://b/run/checkpoint_1000'",
               "--gin.INFER_OUTPUT_DIR='gs://b/infer'"]),
}


@pytest.mark.parametrize('mode', ['train', 'eval', 'infer'])
@pytest.mark.parametrize('runner', ['t5x', 'builtin'])
def test_tpu_every_runner_and_mode(runner, mode):
  """Install (pinned t5x for t5x only), the venv's python, the job's log
  under the run's output folder."""
  dirs, logs, gin = _DIRS[mode]
  result = _launch('tpu_pod.py', *TPU, '--install', f'--runner={runner}',
                   f'--mode={mode}', f'--gin_file={_GIN_FILE[runner]}', *dirs,
                   '--dry-run')
  assert result.returncode == 0, result.stderr
  lines, files = _dry_run('tpu_pod.py', *TPU, '--install', f'--runner={runner}',
                          f'--mode={mode}', f'--gin_file={_GIN_FILE[runner]}',
                          *dirs)
  assert _commands(lines) == [
      'rm -rf TMP/hyperprompt_launch-hp-pod', f'mkdir -p {STAGE}',
      'git -C ROOT archive --format=tar.gz --prefix=hyperprompt_jax/ '
      f'--output={STAGE}/hyperprompt_jax.tar.gz COMMIT',
      f"cat > {STAGE}/install.sh <<'EOF'",
      f"cat > {STAGE}/{mode}-STAMP.sh <<'EOF'",
      f'gcloud compute tpus tpu-vm scp --recurse {STAGE} hp-pod: {WHERE} '
      '--worker=all',
      SSH + "'bash ~/hyperprompt_launch/install.sh'",
      SSH + f"'setsid nohup bash ~/hyperprompt_launch/{mode}-STAMP.sh > "
      "/dev/null 2>&1 < /dev/null &'"]
  install = files[f'{STAGE}/install.sh']
  assert install == _install_sh(
      *VENV, *UNPACK,
      f"{VENV_PY} -m pip install ~/'hyperprompt_launch/hyperprompt_jax[tpu]'",
      *(T5X_PINNED if runner == 't5x' else []), t5x=runner == 't5x')
  script = files[f'{STAGE}/{mode}-STAMP.sh']
  assert script[2:4] == [WORKER,
                         f'LOG=~/hyperprompt_logs/{mode}-STAMP-worker$W.log']
  assert script[-2] == f'gcloud storage cp "$LOG" {logs}/'
  if runner == 't5x':
    assert _job_line(script) == [
        VENV_PY, '-m', f't5x.{mode}',
        f'--gin_search_paths=$({VENV_PY} -m hyperprompt_jax.paths gin)',
        '--gin_file=t5x/mtl_glue.gin', *gin, '--tfds_data_dir=gs://b/tfds']
  else:
    # No search path (the runner searches its gin files); every worker joins.
    assert _job_line(script) == [
        VENV_PY, '-m', f'hyperprompt_jax.{mode}',
        '--gin_file=runs/mtl_glue.gin', *gin,
        "--gin.TFDS_DATA_DIR='gs://b/tfds'", '--multiprocess']
  # How to follow worker 0's log, and where the logs go.
  hint = _normalize(result.stderr)
  assert (f"gcloud compute tpus tpu-vm ssh hp-pod {WHERE} --worker=0 "
          f"--command='tail -f ~/hyperprompt_logs/{mode}-STAMP-worker0.log'"
          in hint)
  assert f"Each worker's log is copied to {logs}/ when its job ends." in hint


def test_tpu_without_install_runs_only():
  lines, files = _dry_run('tpu_pod.py', *TPU, '--gin_file=t5x/mtl_glue.gin',
                          '--model_dir=gs://b/run', '--foreground')
  assert _commands(lines) == [
      'rm -rf TMP/hyperprompt_launch-hp-pod', f'mkdir -p {STAGE}',
      f"cat > {STAGE}/train-STAMP.sh <<'EOF'",
      f'gcloud compute tpus tpu-vm scp --recurse {STAGE} hp-pod: {WHERE} '
      '--worker=all',
      # --foreground: in the ssh session.
      SSH + "'bash ~/hyperprompt_launch/train-STAMP.sh'"]
  assert list(files) == [f'{STAGE}/train-STAMP.sh']


def test_tpu_gin_bindings_project_and_tfds_data_dir():
  lines, files = _dry_run(
      'tpu_pod.py', *TPU, '--project=my-proj', '--gin_file=t5x/mtl_glue.gin',
      '--gin_file=t5x/adapter_glue.gin', '--model_dir=gs://b/run',
      '--tfds_data_dir=gs://b/tfds', '--gin', 'TRAIN_STEPS=1000',
      '--gin', "MIXTURE_OR_TASK_NAME='glue_rte'", '--gin.BATCH_SIZE=64')
  assert lines[-2] == (
      f'gcloud compute tpus tpu-vm scp --recurse {STAGE} hp-pod: '
      '--zone=us-central2-b --project=my-proj --worker=all')
  assert lines[-1].startswith('gcloud compute tpus tpu-vm ssh hp-pod '
                              '--zone=us-central2-b --project=my-proj '
                              '--worker=all --command=')
  assert _job_line(files[f'{STAGE}/train-STAMP.sh']) == [
      VENV_PY, '-m', 't5x.train',
      f'--gin_search_paths=$({VENV_PY} -m hyperprompt_jax.paths gin)',
      '--gin_file=t5x/mtl_glue.gin', '--gin_file=t5x/adapter_glue.gin',
      "--gin.MODEL_DIR='gs://b/run'", '--tfds_data_dir=gs://b/tfds',
      '--gin.TRAIN_STEPS=1000', "--gin.MIXTURE_OR_TASK_NAME='glue_rte'",
      '--gin.BATCH_SIZE=64']


def test_tpu_builtin_tfds_data_dir_is_a_macro():
  _, files = _dry_run('tpu_pod.py', *TPU, '--runner=builtin',
                      '--gin_file=runs/hyperprompt_glue.gin',
                      '--model_dir=gs://b/run', '--tfds_data_dir=gs://b/tfds')
  assert _job_line(files[f'{STAGE}/train-STAMP.sh'])[-2:] == [
      "--gin.TFDS_DATA_DIR='gs://b/tfds'", '--multiprocess']


def test_tpu_own_python_gets_no_venv():
  _, files = _dry_run('tpu_pod.py', *TPU, '--runner=builtin', '--install',
                      '--python=~/venv/bin/python', '--mode=infer',
                      '--gin_file=runs/mtl_glue.gin',
                      '--checkpoint_path=gs://b/c', '--output_dir=gs://b/o')
  assert files[f'{STAGE}/install.sh'] == _install_sh(
      *UNPACK,
      "~/venv/bin/python -m pip install "
      "~/'hyperprompt_launch/hyperprompt_jax[tpu]'", t5x=False)
  # `~/` stays bare so that each worker expands it to its own home.
  assert _job_line(files[f'{STAGE}/infer-STAMP.sh'])[:4] == [
      '~/venv/bin/python', '-m', 'hyperprompt_jax.infer',
      '--gin_file=runs/mtl_glue.gin']


def test_tpu_source_from_git_at_a_commit():
  lines, files = _dry_run(
      'tpu_pod.py', *TPU, '--install',
      '--source=git+https://github.com/me/hyperprompt_jax@0123abc',
      '--gin_file=t5x/mtl_glue.gin', '--model_dir=gs://b/run')
  assert not any(l.startswith('git -C ROOT archive') for l in lines)
  assert files[f'{STAGE}/install.sh'] == _install_sh(
      *VENV,
      'rm -rf ~/hyperprompt_launch/hyperprompt_jax',
      'git clone --quiet https://github.com/me/hyperprompt_jax '
      '~/hyperprompt_launch/hyperprompt_jax',
      'git -C ~/hyperprompt_launch/hyperprompt_jax checkout --quiet 0123abc',
      f"{VENV_PY} -m pip install ~/'hyperprompt_launch/hyperprompt_jax[tpu]'",
      *T5X_PINNED, t5x=True)
  # An ssh URL: its user's `@` is not the commit's.
  _, files = _dry_run(
      'tpu_pod.py', *TPU, '--install', '--runner=builtin',
      '--source=git+ssh://git@github.com/me/hp.git@v1.0',
      '--gin_file=runs/mtl_glue.gin', '--model_dir=gs://b/run')
  assert files[f'{STAGE}/install.sh'][-3:-1] == [
      'git clone --quiet ssh://git@github.com/me/hp.git '
      '~/hyperprompt_launch/hyperprompt_jax',
      'git -C ~/hyperprompt_launch/hyperprompt_jax checkout --quiet v1.0']


def test_tpu_package_instead_of_a_source():
  lines, files = _dry_run(
      'tpu_pod.py', *TPU, '--install', '--runner=builtin',
      '--package=hyperprompt_jax[tpu] @ git+https://github.com/me/hp.git',
      '--gin_file=runs/mtl_glue.gin', '--model_dir=gs://b/run')
  assert not any(l.startswith('git -C ROOT archive') for l in lines)
  assert files[f'{STAGE}/install.sh'] == _install_sh(
      *VENV, f"{VENV_PY} -m pip install "
      "'hyperprompt_jax[tpu] @ git+https://github.com/me/hp.git'", t5x=False)


@pytest.mark.parametrize('accelerator,version', [
    ('v4-32', 'tpu-ubuntu2204-base'),
    ('v5litepod-16', 'v2-alpha-tpuv5-lite'),
    ('v5p-128', 'v2-alpha-tpuv5'),
    ('v6e-8', 'v2-alpha-tpuv6e'),
])
def test_tpu_create_runtime_version_per_generation(accelerator, version):
  lines, _ = _dry_run('tpu_pod.py', *TPU, '--project=p', '--create',
                      f'--accelerator={accelerator}',
                      '--gin_file=t5x/mtl_glue.gin', '--model_dir=gs://b/run')
  assert lines[0] == (
      'gcloud compute tpus tpu-vm create hp-pod --zone=us-central2-b '
      f'--project=p --accelerator-type={accelerator} --version={version}')
  lines, _ = _dry_run('tpu_pod.py', *TPU, '--create', '--runtime_version=mine',
                      f'--accelerator={accelerator}',
                      '--gin_file=t5x/mtl_glue.gin', '--model_dir=gs://b/run')
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
    (['--model_dir=gs://b/r', '--tpu=../pod'], 'is not a TPU name'),
    (['--model_dir=gs://b/r', '--source=git+https://github.com/me/hp'],
     'add --install'),
    (['--model_dir=gs://b/r', '--install',
      '--source=git+https://github.com/me/hp'],
     'write e.g. --source=git+https://github.com/USER/hyperprompt_jax@COMMIT'),
    (['--model_dir=gs://b/r', '--install', '--source=https://x/hp@abc'],
     'neither checkout nor git+URL@COMMIT'),
    (['--model_dir=gs://b/r', '--install', '--package=hp',
      '--source=checkout'], '--source and --package are alternatives'),
])
def test_tpu_bad_input_fails_naming_the_fix(args, fix):
  result = _launch('tpu_pod.py', *TPU, '--gin_file=t5x/mtl_glue.gin', *args,
                   '--dry-run')
  assert result.returncode == 2
  assert fix in result.stderr
  assert not result.stdout


def test_tpu_job_environment():
  _, files = _dry_run('tpu_pod.py', *TPU, '--gin_file=t5x/mtl_glue.gin',
                      '--model_dir=gs://b/run',
                      '--env', 'JAX_COMPILATION_CACHE_DIR=gs://b/jax cache',
                      '--env', 'XLA_FLAGS=--xla_dump_to=/tmp/d')
  script = files[f'{STAGE}/train-STAMP.sh']
  assert script[2:5] == [
      WORKER, "export 'JAX_COMPILATION_CACHE_DIR=gs://b/jax cache'",
      'export XLA_FLAGS=--xla_dump_to=/tmp/d']
  result = _launch('tpu_pod.py', *TPU, '--gin_file=t5x/mtl_glue.gin',
                   '--model_dir=gs://b/run', '--env', '1X=y', '--dry-run')
  assert result.returncode == 2
  assert "--env '1X=y' is not KEY=VALUE" in result.stderr


NO_DATA_DIR = ['--tpu=hp-pod', '--zone=us-central2-b']


@pytest.mark.parametrize('gin_files', [
    ['t5x/mtl_glue.gin'],  # its setup includes tasks/glue.gin
    ['models/t5_1_1_small.gin', 'tasks/super_glue.gin'],
])
def test_tpu_a_run_of_the_real_tasks_needs_the_data_in_cloud_storage(
    gin_files):
  flags = [f'--gin_file={f}' for f in gin_files] + ['--model_dir=gs://b/r']
  result = _launch('tpu_pod.py', *NO_DATA_DIR, *flags, '--dry-run')
  assert result.returncode == 2
  assert ('the run reads the GLUE / SuperGLUE TFDS data, and no '
          '--tfds_data_dir says where') in result.stderr
  assert ('python -m hyperprompt_jax.prepare_data --gin_file=<the run file> '
          '--data_dir=gs://my-bucket/tfds --prepare') in result.stderr
  result = _launch('tpu_pod.py', *NO_DATA_DIR, *flags,
                   '--tfds_data_dir=/data/tfds', '--dry-run')
  assert result.returncode == 2
  assert '--tfds_data_dir=/data/tfds must be a gs:// path' in result.stderr


def test_an_old_setup_path_still_launches_naming_the_new():
  """gin/experiments/ is gin/setups/: its alias files still resolve
  for one release, and the launcher names the new path."""
  result = _launch('tpu_pod.py', *TPU, '--mode=eval', '--gin_file=t5x/eval.gin',
                   '--gin_file=experiments/hyperprompt_global_glue.gin',
                   '--checkpoint_path=gs://b/run', '--output_dir=gs://b/eval',
                   '--dry-run')
  assert result.returncode == 0, result.stderr
  assert ('gin/experiments/ is now gin/setups/; give '
          '--gin_file=setups/hyperprompt_global_glue.gin') in result.stderr


def test_tpu_the_fixtures_need_no_data_dir():
  result = _launch('tpu_pod.py', *NO_DATA_DIR,
                   '--gin_file=t5x/quickstart_train.gin',
                   '--model_dir=gs://b/r', '--dry-run')
  assert result.returncode == 0, result.stderr


@pytest.mark.parametrize('mode,macro', [
    ('leaderboard', 'LEADERBOARD_OUTPUT_DIR'), ('probe', 'PROBE_OUTPUT_DIR')])
def test_tpu_leaderboard_and_probe_run_on_every_worker(mode, macro):
  flags = ['--gin_file=runs/leaderboard.gin' if mode == 'leaderboard'
           else '--gin_file=runs/probe.gin',
           '--gin_file=setups/hyperprompt_global_glue.gin',
           '--checkpoint_path=gs://b/run/checkpoint_1000',
           f'--output_dir=gs://b/{mode}', f'--mode={mode}']
  _, files = _dry_run('tpu_pod.py', *TPU, '--runner=builtin', *flags)
  assert _job_line(files[f'{STAGE}/{mode}-STAMP.sh']) == [
      VENV_PY, '-m', f'hyperprompt_jax.{mode}', flags[0], flags[1],
      "--gin.CHECKPOINT_PATH='gs://b/run/checkpoint_1000'",
      f"--gin.{macro}='gs://b/{mode}'", "--gin.TFDS_DATA_DIR='gs://b/tfds'",
      '--multiprocess']
  result = _launch('tpu_pod.py', *TPU, *flags, '--dry-run')  # runner t5x
  assert result.returncode == 2
  assert (f"--mode={mode} is the built-in runner's command (python -m "
          f"hyperprompt_jax.{mode}; t5x has none), which reads t5x's "
          'checkpoints too: add --runner=builtin') in result.stderr


@pytest.mark.parametrize('runner,gin_file,fix', [
    # A twin of the same name in the runner's folder.
    ('t5x', 'runs/hyperprompt_global_glue.gin',
     'use --gin_file=t5x/hyperprompt_global_glue.gin, or --runner=builtin'),
    ('t5x', 'runs/mtl_glue.gin',
     'use --gin_file=t5x/mtl_glue.gin, or --runner=builtin'),
    ('builtin', 't5x/hypergrid_lg_glue_super_glue.gin',
     'use --gin_file=runs/hypergrid_lg_glue_super_glue.gin, or --runner=t5x'),
    # None: the other runner, or an example.
    ('t5x', 'runs/hyperprompt_glue.gin',
     'use --runner=builtin, or a run file of --runner=t5x (t5x/*.gin, e.g. '
     '--gin_file=t5x/hyperprompt_global_glue.gin)'),
    ('builtin', 't5x/add_task.gin',
     'use --runner=t5x, or a run file of --runner=builtin (runs/*.gin, e.g. '
     '--gin_file=runs/hyperprompt_glue.gin)'),
])
def test_tpu_refuses_a_run_file_of_the_other_runner(runner, gin_file, fix):
  result = _launch('tpu_pod.py', *TPU, f'--runner={runner}',
                   '--gin_file=models/t5_1_1_small.gin',
                   f'--gin_file={gin_file}', '--model_dir=gs://b/r',
                   '--dry-run')
  assert result.returncode == 2
  owner = {'runs': 'the built-in runner (runs/)', 't5x': 't5x (t5x/)'}[
      gin_file.split('/')[0]]
  assert (f'--gin_file={gin_file} is a run file of {owner}, which '
          f'--runner={runner} does not read: {fix}') in result.stderr
  assert not result.stdout


def test_tpu_refuses_a_shipped_run_file_given_by_its_path():
  result = _launch('tpu_pod.py', *TPU, '--gin_file=gin/runs/mtl_glue.gin',
                   '--model_dir=gs://b/r', '--dry-run')
  assert result.returncode == 2
  assert 'use --gin_file=t5x/mtl_glue.gin, or --runner=builtin' in (
      result.stderr)


@pytest.mark.parametrize('runner,example', [
    ('t5x', '--gin_file=t5x/hyperprompt_global_glue.gin (the shipped ones: '
     't5x/*.gin)'),
    ('builtin', '--gin_file=runs/hyperprompt_glue.gin (the shipped ones: '
     'runs/*.gin)'),
])
def test_tpu_needs_a_gin_file_of_its_runner(runner, example):
  result = _launch('tpu_pod.py', *TPU, f'--runner={runner}',
                   '--model_dir=gs://b/r', '--dry-run')
  assert result.returncode == 2
  assert (f'no --gin_file: name a run file of --runner={runner}, e.g. '
          f'{example}') in result.stderr


def test_tpu_runs_commands_in_order_and_stops_at_the_first_failure(tmp_path):
  log = tmp_path / 'log'
  # gcloud fails its third call (the install) with exit code 7.
  _fake(tmp_path, 'gcloud', _log_argv('gcloud') +
        'sys.exit(7 if len(open(LOG).readlines()) == 3 else 0)\n')
  env = dict(os.environ, PATH=f'{tmp_path}:{os.environ["PATH"]}',
             FAKE_LOG=str(log), TMPDIR=str(tmp_path))
  args = [*TPU, '--accelerator=v4-32', '--create', '--install',
          '--gin_file=t5x/mtl_glue.gin', '--model_dir=gs://b/run']
  lines, _ = _dry_run('tpu_pod.py', *args, env=env)
  expected = [shlex.split(l) for l in _commands(lines)
              if l.startswith('gcloud ')]
  assert [w[4] for w in expected] == ['create', 'scp', 'ssh', 'ssh']
  result = _launch('tpu_pod.py', *args, env=env)
  assert result.returncode == 7
  assert 'exit code 7' in result.stderr
  calls = [shlex.split(_normalize(shlex.join(c))) for c in _read_log(log)]
  assert calls == expected[:3]  # the run never started
  # What this machine wrote: the archive of the commit and both scripts.
  stage = tmp_path / 'hyperprompt_launch-hp-pod' / 'hyperprompt_launch'
  assert sorted(p.name for p in stage.iterdir())[:2] == [
      'hyperprompt_jax.tar.gz', 'install.sh']
  members = subprocess.run(['tar', '-tzf', stage / 'hyperprompt_jax.tar.gz'],
                           capture_output=True, text=True,
                           check=True).stdout.split()
  assert {'hyperprompt_jax/setup.py', 'hyperprompt_jax/launch/common.py',
          'hyperprompt_jax/gin/t5x/mtl_glue.gin'} <= set(members)

  log.unlink()
  _fake(tmp_path, 'gcloud', _log_argv('gcloud'))
  result = _launch('tpu_pod.py', *args, env=env)
  assert result.returncode == 0, result.stderr
  calls = [shlex.split(_normalize(shlex.join(c))) for c in _read_log(log)]
  assert calls == expected


def _fake_pod(tmp_path, code=0):
  """A fake pod of one worker: `gcloud` copies (scp) into and runs (ssh, with
  bash) in the home folder tmp_path/home, copies (storage cp) gs://X to
  tmp_path/gs/X; `curl` says worker 0; `python3` makes a venv whose python
  logs its arguments, prints `job output` and exits with `code`."""
  home, gs, bin_dir = (tmp_path / n for n in ('home', 'gs', 'bin'))
  home.mkdir()
  bin_dir.mkdir()
  _fake(bin_dir, 'gcloud', _log_argv('gcloud') +
        "home, gs = os.environ['FAKE_HOME'], os.environ['FAKE_GS']\n"
        "if args[3] == 'scp':\n"
        '  shutil.copytree(args[5], os.path.join(home, os.path.basename('
        'args[5])), dirs_exist_ok=True)\n'
        "elif args[3] == 'ssh':\n"
        "  (command,) = [a for a in args if a.startswith('--command=')]\n"
        "  sys.exit(subprocess.run(['bash', '-c', command[len('--command='):]]"
        ', cwd=home, env=dict(os.environ, HOME=home)).returncode)\n'
        "elif args[:2] == ['storage', 'cp']:\n"
        "  dest = os.path.join(gs, args[3][len('gs://'):])\n"
        '  os.makedirs(dest, exist_ok=True)\n'
        '  shutil.copy(args[2], dest)\n')
  _fake(bin_dir, 'curl', "print(0, end='')\n")
  venv_python = _fake(
      tmp_path, 'venv_python',
      "if args == ['-m', 'hyperprompt_jax.paths', 'gin']:\n"
      "  print('/site/hyperprompt_jax/gin')\n"
      '  sys.exit(0)\n' + _log_argv('venv') +
      "if args[:2] != ['-m', 'pip']:\n"
      "  print('job output')\n"
      '  sys.exit(int(os.environ["FAKE_CODE"]))\n')
  _fake(bin_dir, 'python3', _log_argv('python3') +
        "if args[:3] == ['-m', 'uv', 'venv']:\n"
        "  os.makedirs(os.path.join(args[-1], 'bin'))\n"
        f"  shutil.copy({str(venv_python)!r}, "
        "os.path.join(args[-1], 'bin', 'python'))\n")
  log = tmp_path / 'log'
  env = dict(os.environ, PATH=f'{bin_dir}:{os.environ["PATH"]}',
             FAKE_LOG=str(log), FAKE_HOME=str(home), FAKE_GS=str(gs),
             FAKE_CODE=str(code), TMPDIR=str(tmp_path))
  return env, home, gs, log


@pytest.mark.parametrize('code', [0, 3])
def test_tpu_install_and_run_on_a_fake_worker(tmp_path, code):
  """Install and run in the foreground, through the fake gcloud and the
  worker's bash: the venv, the checkout unpacked and installed, pinned t5x,
  the job's argv, its log kept and copied, its exit code passed on."""
  env, home, gs, log = _fake_pod(tmp_path, code)
  result = _launch('tpu_pod.py', *TPU, '--install', '--foreground',
                   '--gin_file=t5x/mtl_glue.gin', '--model_dir=gs://b/my run',
                   '--gin', """X='it''s "odd" $HOME !'""", env=env)
  assert result.returncode == code, result.stderr
  assert 'job output' in result.stdout  # shown here
  calls = [c for c in _read_log(log) if c[0] != 'gcloud']
  venv = f'{home}/hyperprompt_venv'
  assert calls == [
      ['python3', '-m', 'pip', 'install', '--user', '--quiet', 'uv'],
      ['python3', '-m', 'uv', 'venv', '--seed', '--python=3.11', venv],
      ['venv', '-m', 'pip', 'install',
       f'{home}/hyperprompt_launch/hyperprompt_jax[tpu]'],
      ['venv', '-m', 'pip', 'install', '--no-deps',
       't5x @ git+https://github.com/google-research/t5x'
       '@cc342d419ec3e3e9c4bf1df33c82330cafdc1e16',
       'airio @ git+https://github.com/google/airio'
       '@69897df7d9a427b947a9f7bb4164c7782b43e601',
       'jestimator @ git+https://github.com/google-research/jestimator'
       '@326824a477feef6d92e6f44175000907a72899ca'],
      ['venv', '-m', 'pip', 'install', 'grain==0.2.12', 'cached_property',
       'chex', 'fiddle', 'jaxtyping'],
      ['venv', '-m', 't5x.train',
       '--gin_search_paths=/site/hyperprompt_jax/gin',
       '--gin_file=t5x/mtl_glue.gin', "--gin.MODEL_DIR='gs://b/my run'",
       '--tfds_data_dir=gs://b/tfds',
       """--gin.X='it''s "odd" $HOME !'"""],
  ]
  # The checkout's commit, unpacked where pip read it.
  unpacked = home / 'hyperprompt_launch/hyperprompt_jax'
  assert (unpacked / 'setup.py').read_text() == subprocess.run(
      ['git', 'show', 'HEAD:setup.py'], cwd=ROOT, capture_output=True,
      text=True, check=True).stdout
  (kept,) = (home / 'hyperprompt_logs').iterdir()
  assert re.fullmatch(r'train-\d{8}-\d{6}-worker0\.log', kept.name)
  assert kept.read_text() == f'job output\nexit code {code}\n'
  assert (gs / 'b/my run/logs' / kept.name).read_text() == kept.read_text()


def test_tpu_job_outlives_the_ssh_session(tmp_path):
  """By default the ssh returns at once; the job goes on, and its log reaches
  the output folder when it ends."""
  env, home, gs, _ = _fake_pod(tmp_path)
  (home / 'hyperprompt_venv/bin').mkdir(parents=True)
  (home / 'hyperprompt_venv/bin/python').symlink_to(tmp_path / 'venv_python')
  result = _launch('tpu_pod.py', *TPU, '--runner=builtin', '--mode=eval',
                   '--gin_file=runs/mtl_glue.gin', '--checkpoint_path=gs://b/c',
                   '--output_dir=gs://b/eval', env=env)
  assert result.returncode == 0, result.stderr
  assert 'job output' not in result.stdout
  logs = gs / 'b/eval/logs'
  for _ in range(400):  # the fake worker's job: well under a second
    if logs.is_dir() and any(
        p.read_text().endswith('exit code 0\n') for p in logs.iterdir()):
      break
    time.sleep(0.05)
  (copied,) = logs.iterdir()
  assert re.fullmatch(r'eval-\d{8}-\d{6}-worker0\.log', copied.name)
  assert copied.read_text() == 'job output\nexit code 0\n'
  assert copied.name in result.stderr  # the tail -f hint


# GPU hosts.


def test_gpu_here_install_and_train():
  lines, _ = _dry_run('gpu.py', '--install', '--mem_fraction=0.9',
                      '--gin_file=runs/hyperprompt_glue.gin',
                      '--model_dir=/data/hp run', '--gin', 'TRAIN_STEPS=10')
  # Here the scripts run from where they were written; the same install.
  assert lines == [
      'rm -rf TMP/hyperprompt_launch-gpu', f'mkdir -p {GPU_STAGE}',
      'git -C ROOT archive --format=tar.gz --prefix=hyperprompt_jax/ '
      f'--output={GPU_STAGE}/hyperprompt_jax.tar.gz COMMIT',
      f"cat > {GPU_STAGE}/install.sh <<'EOF'",
      *_install_sh(
          *VENV, 'rm -rf ~/hyperprompt_launch/hyperprompt_jax',
          '# ROOT at commit COMMIT', 'mkdir -p ~/hyperprompt_launch',
          f'tar -xzf {GPU_STAGE}/hyperprompt_jax.tar.gz '
          '-C ~/hyperprompt_launch',
          f"{VENV_PY} -m pip install "
          "~/'hyperprompt_launch/hyperprompt_jax[gpu]'", t5x=False),
      'EOF',
      f"cat > {GPU_STAGE}/train-STAMP.sh <<'EOF'",
      *_job_sh('env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 '
               f'{VENV_PY} -m hyperprompt_jax.train '
               '--gin_file=runs/hyperprompt_glue.gin '
               '--gin.MODEL_DIR="\'/data/hp run\'" --gin.TRAIN_STEPS=10',
               '~/hyperprompt_logs/train-STAMP.log', '/data/hp run/logs',
               quoted=("'/data/hp run/logs'", "'/data/hp run/logs/'")),
      'EOF',
      f'bash {GPU_STAGE}/install.sh',
      f'bash {GPU_STAGE}/train-STAMP.sh',
  ]


@pytest.mark.parametrize('runner, module', [('builtin', 'hyperprompt_jax'),
                                            ('t5x', 't5x')])
def test_gpu_passes_the_memory_settings_to_either_runner(runner, module):
  """--num_microbatches / --remat_policy become the macros both runners'
  train.gin read; they are training settings only."""
  gin_file = f'--gin_file={_GIN_FILE[runner]}'
  _, files = _dry_run('gpu.py', f'--runner={runner}', gin_file,
                      '--model_dir=/data/run', '--num_microbatches=4',
                      '--remat_policy=full')
  words = _job_line(files[f'{GPU_STAGE}/train-STAMP.sh'])
  assert words[:3] == [VENV_PY, '-m', f'{module}.train']
  assert words[-2:] == ['--gin.NUM_MICROBATCHES=4',
                        "--gin.REMAT_POLICY='full'"]
  for bad, message in [(['--mode=eval', '--checkpoint_path=/r',
                         '--output_dir=/o', '--num_microbatches=2'],
                        'training settings'),
                       (['--model_dir=/r', '--num_microbatches=0'],
                        'must be >= 1'),
                       (['--model_dir=/r', '--remat_policy=some'],
                        'invalid choice')]:
    result = _launch('gpu.py', f'--runner={runner}', gin_file, *bad,
                     '--dry-run')
    assert result.returncode == 2 and message in result.stderr, bad


@pytest.mark.parametrize('mode', ['train', 'eval', 'infer'])
def test_gpu_over_ssh_with_t5x(mode):
  dirs = (['--model_dir=/data/run'] if mode == 'train' else
          ['--checkpoint_path=/data/run', f'--output_dir=/data/{mode}'])
  lines, files = _dry_run('gpu.py', '--host=me@gpu-box', '--install',
                          '--runner=t5x', f'--mode={mode}',
                          '--gin_file=t5x/mtl_glue.gin', *dirs)
  assert _commands(lines)[-3:] == [
      f'scp -r {GPU_STAGE} me@gpu-box:',
      "ssh me@gpu-box 'bash ~/hyperprompt_launch/install.sh'",
      f"ssh me@gpu-box 'bash ~/hyperprompt_launch/{mode}-STAMP.sh'"]
  # On the host the archive is where scp put it.
  assert files[f'{GPU_STAGE}/install.sh'] == _install_sh(
      *VENV, *UNPACK,
      f"{VENV_PY} -m pip install ~/'hyperprompt_launch/hyperprompt_jax[gpu]'",
      *T5X_PINNED, t5x=True)
  script = files[f'{GPU_STAGE}/{mode}-STAMP.sh']
  out = '/data/run' if mode == 'train' else f'/data/{mode}'
  assert script[-3:] == [f'mkdir -p {out}/logs', f'cp "$LOG" {out}/logs/',
                         'exit "$code"']
  assert script[2] == f'LOG=~/hyperprompt_logs/{mode}-STAMP.log'
  macro = {'train': ["--gin.MODEL_DIR='/data/run'"],
           'eval': ["--gin.CHECKPOINT_PATH='/data/run'",
                    "--gin.EVAL_OUTPUT_DIR='/data/eval'"],
           'infer': ["--gin.CHECKPOINT_PATH='/data/run'",
                     "--gin.INFER_OUTPUT_DIR='/data/infer'"]}[mode]
  assert _job_line(script) == [
      VENV_PY, '-m', f't5x.{mode}',
      f'--gin_search_paths=$({VENV_PY} -m hyperprompt_jax.paths gin)',
      '--gin_file=t5x/mtl_glue.gin', *macro]


def test_gpu_on_two_hosts_starts_one_process_each():
  """Each host runs the same command as process i of 2, process 0's machine
  coordinating; started together (`&`, then `wait`)."""
  lines, files = _dry_run('gpu.py', '--host=me@gpu-0', '--host=me@gpu-1',
                          '--install', '--gin_file=runs/hyperprompt_glue.gin',
                          '--model_dir=/nfs/hp')
  assert _commands(lines)[-7:] == [
      f'scp -r {GPU_STAGE} me@gpu-0:',
      "ssh me@gpu-0 'bash ~/hyperprompt_launch/install.sh'",
      f'scp -r {GPU_STAGE} me@gpu-1:',
      "ssh me@gpu-1 'bash ~/hyperprompt_launch/install.sh'",
      "ssh me@gpu-0 'bash ~/hyperprompt_launch/train-STAMP-process0.sh' &",
      "ssh me@gpu-1 'bash ~/hyperprompt_launch/train-STAMP-process1.sh' &",
      'wait']
  for i in (0, 1):
    script = files[f'{GPU_STAGE}/train-STAMP-process{i}.sh']
    assert script[2] == f'LOG=~/hyperprompt_logs/train-STAMP-process{i}.log'
    assert _job_line(script) == [
        VENV_PY, '-m', 'hyperprompt_jax.train',
        '--gin_file=runs/hyperprompt_glue.gin', "--gin.MODEL_DIR='/nfs/hp'",
        '--coordinator_address=gpu-0:12345', '--num_processes=2',
        f'--process_id={i}']
  _, files = _dry_run('gpu.py', '--host=a', '--host=b', '--runner=t5x',
                      '--coordinator_address=10.0.0.1:999',
                      '--gin_file=t5x/mtl_glue.gin', '--model_dir=gs://b/hp')
  script = files[f'{GPU_STAGE}/train-STAMP-process1.sh']
  assert _job_line(script)[-4:] == [
      '--multiprocess_gpu', '--coordinator_address=10.0.0.1:999',
      '--process_count=2', '--process_index=1']
  assert script[-2] == 'gcloud storage cp "$LOG" gs://b/hp/logs/'


def test_gpu_runs_here_keeping_the_log(tmp_path):
  """The job script runs here: output shown, the log copied into the model
  folder, the job's exit code passed on."""
  python = _fake(tmp_path, 'python', _log_argv('python') +
                 "print('job output')\nsys.exit(5)\n")
  env = dict(os.environ, FAKE_LOG=str(tmp_path / 'log'), HOME=str(tmp_path),
             TMPDIR=str(tmp_path))
  result = _launch('gpu.py', f'--python={python}',
                   '--gin_file=runs/hyperprompt_glue.gin',
                   f'--model_dir={tmp_path}/run', env=env)
  assert result.returncode == 5
  assert result.stdout == 'job output\nexit code 5\n'
  (copied,) = (tmp_path / 'run/logs').iterdir()
  assert re.fullmatch(r'train-\d{8}-\d{6}\.log', copied.name)
  assert copied.read_text() == 'job output\nexit code 5\n'
  assert (tmp_path / 'hyperprompt_logs' / copied.name).is_file()


@pytest.mark.parametrize('args,fix', [
    (['--host=a', '--host=a', '--model_dir=/m'], 'names a host twice'),
    (['--coordinator_address=a:1', '--model_dir=/m'], 'repeat --host'),
    (['--mem_fraction=1.5'], 'must be in (0, 1]'),
    (['--mode=infer', '--checkpoint_path=/c'], 'needs --output_dir'),
    ([], '--mode=train needs --model_dir'),
    (['--model_dir=/m', '--package=hp'], 'add --install'),
])
def test_gpu_bad_input(args, fix):
  result = _launch('gpu.py', '--gin_file=runs/mtl_glue.gin', *args, '--dry-run')
  assert result.returncode == 2
  assert fix in result.stderr


def test_gpu_refuses_a_run_file_of_the_other_runner():
  result = _launch('gpu.py', '--gin_file=t5x/mtl_glue.gin', '--model_dir=/m',
                   '--dry-run')
  assert result.returncode == 2
  assert ('--gin_file=t5x/mtl_glue.gin is a run file of t5x (t5x/), which '
          '--runner=builtin does not read: use --gin_file=runs/mtl_glue.gin, '
          'or --runner=t5x') in result.stderr
  result = _launch('gpu.py', '--runner=t5x', '--model_dir=/m', '--dry-run')
  assert result.returncode == 2
  assert '--gin_file=t5x/hyperprompt_global_glue.gin' in result.stderr


# This machine.


@pytest.mark.parametrize('mode,gin_file', [
    ('train', 'runs/quickstart.gin'),
    ('eval', 'runs/quickstart_eval.gin'),
    ('infer', 'runs/quickstart_infer.gin'),
    ('leaderboard', 'runs/quickstart_leaderboard.gin'),
    ('probe', 'runs/quickstart_probe.gin'),
])
def test_local_defaults_to_the_quickstart(mode, gin_file):
  (line,), _ = _dry_run('local.py', f'--mode={mode}')
  # The interpreter running the script (this checkout's path read as ROOT).
  assert shlex.split(line) == [
      sys.executable.replace(str(ROOT), 'ROOT'), '-m',
      f'hyperprompt_jax.{mode}', f'--gin_file={gin_file}']
  assert (ROOT / 'gin' / gin_file).is_file()


def test_local_overrides_and_t5x():
  (line,), _ = _dry_run('local.py', '--python=python3', '--model_dir=/tmp/q',
                        '--gin.TRAIN_STEPS=20')
  assert line == ('python3 -m hyperprompt_jax.train '
                  '--gin_file=runs/quickstart.gin '
                  '--gin.MODEL_DIR="\'/tmp/q\'" --gin.TRAIN_STEPS=20')
  (line,), _ = _dry_run('local.py', '--python=python3', '--runner=t5x',
                        '--gin_file=t5x/mtl_glue.gin', '--model_dir=/tmp/q')
  assert line == ('python3 -m t5x.train --gin_search_paths="$(python3 -m '
                  'hyperprompt_jax.paths gin)" --gin_file=t5x/mtl_glue.gin '
                  '--gin.MODEL_DIR="\'/tmp/q\'"')
  result = _launch('local.py', '--runner=t5x', '--dry-run')
  assert result.returncode == 2
  assert ('--runner=t5x needs --gin_file, a t5x run file (e.g. '
          '--gin_file=t5x/hyperprompt_global_glue.gin)') in result.stderr


@pytest.mark.parametrize('runner,gin_file,fix', [
    ('builtin', 't5x/quickstart_eval.gin',
     'use --gin_file=runs/quickstart_eval.gin, or --runner=t5x'),
    ('t5x', 'runs/quickstart.gin', 'use --runner=builtin, or a run file of '
     '--runner=t5x'),
])
def test_local_refuses_a_run_file_of_the_other_runner(runner, gin_file, fix):
  result = _launch('local.py', f'--runner={runner}', f'--gin_file={gin_file}',
                   '--dry-run')
  assert result.returncode == 2
  assert fix in result.stderr and not result.stdout


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
