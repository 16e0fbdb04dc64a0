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


def test_no_module_name_twice():
  """One name a module: no two modules of the package (its folders and the
  top-level `tasks/`) share a file name, so a traceback or a grep names
  one file; `__init__.py` aside."""
  modules = [p for p in (*(ROOT / 'hyperprompt_jax').rglob('*.py'),
                         *(ROOT / 'tasks').rglob('*.py'))
             if p.name != '__init__.py']
  seen = {}
  for path in modules:
    seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
  assert {n: p for n, p in seen.items() if len(p) > 1} == {}


def test_moved_modules_import_by_their_old_path():
  """A 0.1 path (a user's gin file or code) still imports, for one release:
  the same module object as the new path, with a DeprecationWarning that
  names the new path."""
  code = (
      'import warnings, importlib\n'
      'warnings.simplefilter("error")\n'
      'from hyperprompt_jax import MOVED_MODULES\n'
      'assert len(MOVED_MODULES) == 28\n'
      'for old, new in MOVED_MODULES.items():\n'
      '  if old.startswith("t5x."): continue  # needs t5x\n'
      '  try:\n'
      '    importlib.import_module("hyperprompt_jax." + old)\n'
      '  except DeprecationWarning as e:\n'
      '    assert f"hyperprompt_jax.{new}" in str(e), e\n'
      '  else:\n'
      '    raise AssertionError(old)\n'
      'warnings.simplefilter("ignore")\n'
      'import hyperprompt_jax.runner.trainer as old\n'
      'import hyperprompt_jax.training.trainer as new\n'
      'assert old is new\n'
      'from hyperprompt_jax.runner import optimizers\n'
      'assert optimizers.make_optimizer is importlib.import_module(\n'
      '    "hyperprompt_jax.training.optimizers").make_optimizer\n')
  subprocess.run([sys.executable, '-c', code], check=True, cwd=ROOT)
