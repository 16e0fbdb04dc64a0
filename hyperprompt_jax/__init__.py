"""hyperprompt_jax: HyperPrompt and HyperGrid multi-task T5 in JAX / Flax."""

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

__version__ = '0.2.0'

# Modules moved in 0.2 (runner/ split by who uses it; no module named as a
# command). A user's gin file or code that imports an old path still gets
# the module, with a DeprecationWarning naming the new path, for one release.
MOVED_MODULES = {
    'runner.gin_utils': 'common.gin_utils',
    'runner.multihost': 'common.multihost',
    'runner.partitioning': 'common.partitioning',
    'runner.host_memory': 'common.host_memory',
    'runner.input_pipeline': 'common.input_pipeline',
    'runner.batches': 'common.batches',
    'runner.checkpoints': 'checkpointing.checkpoints',
    'runner.checkpoint_manager': 'checkpointing.checkpoint_manager',
    'runner.run_record': 'checkpointing.run_record',
    'runner.initial_checkpoint': 'checkpointing.initial_checkpoint',
    'runner.export_task_params': 'checkpointing.task_params_export',
    'runner.import_task_params': 'checkpointing.task_params_import',
    'runner.trainer': 'training.trainer',
    'runner.optimizers': 'training.optimizers',
    'runner.schedules': 'training.schedules',
    'runner.metabalance': 'training.metabalance',
    'runner.balancing': 'training.metabalance_plan',
    'runner.run_settings': 'training.run_settings',
    'runner.train': 'runner.training_loop',
    'evaluation.eval': 'evaluation.evaluator',
    'evaluation.infer': 'evaluation.inference',
    'evaluation.leaderboard': 'evaluation.submission_files',
    'evaluation.probe': 'evaluation.attention_probe',
    'benchmarks.benchmark': 'benchmarks.benchmark_suite',
    'benchmarks.param_table': 'benchmarks.param_counts',
    't5x.compile': 't5x.steps_compile',
    't5.placement': 't5.traced_mesh',
    'benchmarks.gin_literals': 'common.gin_literals',
}


_SAID = set()


def warn_renamed(message: str, stacklevel: int = 2, once: bool = False
                 ) -> None:
  """An old name used, kept for one release: a DeprecationWarning naming
  the new one, and the same line on stderr (Python's default filters hide
  a library's DeprecationWarning from a command's user); `once`: on stderr
  once a process (a check that runs on every model build)."""
  warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)
  if not (once and message in _SAID):
    _SAID.add(message)
    print(f'{message} (the old name goes in the next release)',
          file=sys.stderr)


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports an old module path as its new module (the same object)."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    prefix = __name__ + '.'
    if fullname.startswith(prefix) and fullname[len(prefix):] in MOVED_MODULES:
      return importlib.machinery.ModuleSpec(fullname, self)
    return None

  def create_module(self, spec):
    new = f'{__name__}.{MOVED_MODULES[spec.name[len(__name__) + 1:]]}'
    warnings.warn(f'{spec.name} moved to {new}; import {new} (the old path '
                  'goes in the next release)', DeprecationWarning, stacklevel=3)
    return importlib.import_module(new)

  def exec_module(self, module):
    del module  # the new module, already executed


sys.meta_path.append(_MovedModuleFinder())
