"""The model, the methods and the training step are a pure layer: they
import no runner, evaluation or task module, and a machine without
TensorFlow, seqio, tensorflow-datasets, orbax or gin builds and steps the
model (the accelerator image's case)."""

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / 'hyperprompt_jax'

# What an accelerator image may lack; the pure modules import none of it.
BLOCKED = ('tensorflow', 'seqio', 'tensorflow_datasets', 'orbax', 'gin',
           'clu', 't5x')
# The modules of the pure layer (the model, the methods, the training
# step, the benchmark's step timing and MFU measurement).
PURE_MODULES = (
    'hyperprompt_jax',
    'hyperprompt_jax.model.network',
    'hyperprompt_jax.model.decoding',
    'hyperprompt_jax.t5.losses',
    'hyperprompt_jax.t5.inputs',
    'hyperprompt_jax.methods',
    'hyperprompt_jax.methods.param_groups',
    'hyperprompt_jax.training.trainer',
    'hyperprompt_jax.training.optimizers',
    'hyperprompt_jax.common.partitioning',
    'hyperprompt_jax.training.metabalance',
    'hyperprompt_jax.benchmarks.timing',
    'hyperprompt_jax.benchmarks.mfu',
)
# Packages the model layer never imports (the layers above it).
ABOVE_THE_MODEL = ('hyperprompt_jax.runner', 'hyperprompt_jax.evaluation',
                   'hyperprompt_jax.tasks', 'hyperprompt_jax.task_params',
                   'hyperprompt_jax.benchmarks', 'hyperprompt_jax.t5x',
                   'tensorflow', 'seqio', 'tensorflow_datasets', 'orbax',
                   'gin', 'clu', 't5x')


def _imported_names(path: pathlib.Path) -> set[str]:
  """Every module an `import` / `from ... import` in `path` names,
  including imports inside functions."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f'{node.module}.{alias.name}' for alias in node.names)
  return names


def test_model_and_methods_import_nothing_above_them():
  bad = {}
  for folder in ('t5', 'methods', 'model'):
    for path in sorted((PACKAGE / folder).glob('*.py')):
      hits = sorted(n for n in _imported_names(path)
                    if any(n == a or n.startswith(a + '.')
                           for a in ABOVE_THE_MODEL))
      if hits:
        bad[str(path.relative_to(ROOT))] = hits
  assert not bad


# The network's floors, bottom up: each imports only the floors below it
# (T5's primitives name no method; the methods know no network).
FLOORS = ('hyperprompt_jax.t5', 'hyperprompt_jax.methods',
          'hyperprompt_jax.model')


def test_the_network_floors_import_down_only():
  bad = {}
  for i, floor in enumerate(FLOORS):
    above = FLOORS[i + 1:]
    folder = PACKAGE / floor.rsplit('.', 1)[-1]
    for path in sorted(folder.glob('*.py')):
      hits = sorted(n for n in _imported_names(path)
                    if any(n == a or n.startswith(a + '.') for a in above))
      if hits:
        bad[str(path.relative_to(ROOT))] = hits
  assert not bad


_SCRIPT = '''
import importlib.abc
import sys

BLOCKED = {blocked!r}


class Blocker(importlib.abc.MetaPathFinder):
  """As if these packages were not installed."""

  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in BLOCKED:
      raise ModuleNotFoundError(f'No module named {{name!r}} (blocked)',
                                name=name)
    return None


sys.meta_path.insert(0, Blocker())
import importlib
for name in {modules!r}:
  importlib.import_module(name)
above = sorted(m for m in sys.modules if m.startswith((
    'hyperprompt_jax.tasks', 'hyperprompt_jax.evaluation',
    'hyperprompt_jax.task_params', 'hyperprompt_jax.common.input_pipeline',
    'hyperprompt_jax.common.batches', 'hyperprompt_jax.checkpointing.checkpoints')))
assert not above, above

import functools
import jax
import jax.numpy as jnp
import numpy as np
from hyperprompt_jax.benchmarks import mfu
from hyperprompt_jax.benchmarks import timing
from hyperprompt_jax.model import network
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import trainer

cfg = mfu.model_config('t5_1_1_tiny', 'hyperprompt_global', 'float32')
model = network.Transformer(cfg)
optimizer = optimizers.make_optimizer()
state = timing.fresh_state(model, optimizer, 16, 4)
batch = timing.random_batch(np.random.default_rng(0), 2, 16, 4,
                            cfg.vocab_size)
step = jax.jit(functools.partial(trainer.train_step, model, optimizer,
                                 z_loss=timing.Z_LOSS))
state, terms = step(state, batch, jax.random.PRNGKey(0))
assert int(state['step']) == 1 and bool(terms['finite'])
print('stepped', float(terms['loss']))
'''


def _stdout_without_blocked(script: str) -> str:
  """What `script` prints, run in a fresh CPU process; it must succeed."""
  result = subprocess.run([sys.executable, '-c', textwrap.dedent(script)],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
                          timeout=300)
  assert result.returncode == 0, result.stderr[-4000:]
  return result.stdout


def test_the_training_step_runs_without_tensorflow_seqio_orbax_or_gin():
  assert 'stepped' in _stdout_without_blocked(
      _SCRIPT.format(blocked=BLOCKED, modules=PURE_MODULES))


# What the TPU compile command's decode needs (the Predictor's decode
# function and its batch checks): also none of `BLOCKED`.
_DECODE_SCRIPT = _SCRIPT.split('above = ', 1)[0] + "print('imported')\n"


def test_the_decode_and_the_tpu_compile_import_no_tensorflow_seqio_or_gin():
  assert 'imported' in _stdout_without_blocked(_DECODE_SCRIPT.format(
      blocked=BLOCKED, modules=('hyperprompt_jax.common.batches',
                                'hyperprompt_jax.evaluation.predictor',
                                'hyperprompt_jax.benchmarks.tpu_compile')))
