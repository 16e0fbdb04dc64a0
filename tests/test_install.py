"""Packaging: `tasks/` installs as `hyperprompt_jax.tasks`, `gin/` ships
inside the package, and `python -m hyperprompt_jax.paths gin` finds it."""

import os
import pathlib
import subprocess
import sys
import zipfile

import hyperprompt_jax
from hyperprompt_jax import paths

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_paths_gin_prints_the_gin_directory():
  out = subprocess.run(
      [sys.executable, '-m', 'hyperprompt_jax.paths', 'gin'],
      check=True, capture_output=True, text=True, cwd='/',
  ).stdout.strip()
  assert os.path.isfile(os.path.join(out, 'models', 't5_1_1_base.gin'))


def test_tasks_package_is_importable_under_the_package():
  import hyperprompt_jax.tasks  # pylint: disable=g-import-not-at-top

  assert pathlib.Path(hyperprompt_jax.tasks.__file__).parent.name == 'tasks'


def test_wheel_layout(tmp_path):
  subprocess.run(
      [sys.executable, '-m', 'pip', 'wheel', '--no-deps',
       '--no-build-isolation', '-q', '-w', str(tmp_path), str(ROOT)],
      check=True, capture_output=True, cwd=tmp_path,
  )
  (wheel,) = tmp_path.glob('hyperprompt_jax-*.whl')
  names = set(zipfile.ZipFile(wheel).namelist())
  assert 'hyperprompt_jax/tasks/__init__.py' in names
  assert 'hyperprompt_jax/gin/models/t5_1_1_base.gin' in names
  assert 'hyperprompt_jax/gin/tasks/glue.gin' in names
  assert 'hyperprompt_jax/tasks/fixtures/glue_mnli/validation_matched.jsonl' in names
  assert 'hyperprompt_jax/paths.py' in names
  assert 'hyperprompt_jax/t5/layers.py' in names
  tops = {n.split('/')[0] for n in names}
  assert tops == {'hyperprompt_jax', f'hyperprompt_jax-{hyperprompt_jax.__version__}.dist-info'}
  # The installed paths.gin_dir() looks in the package first.
  assert paths.gin_dir().endswith('gin')
