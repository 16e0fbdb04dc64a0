"""The registry of task-conditioning methods.

Each method module has the same small face:

    CONFIG_FIELD   the `network.T5Config` field holding its config (None: off)
    SCOPES         the parameter scopes its parameters live under
    AXIS_NAMES     the logical axis names its parameters use (replicated)
    VARIANT_FILES  the gin/variants files that select it
    check(cfg, model_config)   raises ValueError on a config that cannot build
    is_active(cfg, stack)      whether it conditions 'encoder' / 'decoder'

and `REGISTRY` lists the modules. The network's checks, `param_groups`,
`partitioning`'s axis rules and the benchmark's variants read it: a new
method is its module, an entry here, a T5Config field and its wiring in
`conditioning.py`.
"""

import sys
from typing import Any
import warnings

from hyperprompt_jax.methods import adapters
from hyperprompt_jax.methods import hyperformer
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.methods import hyperprompt
from hyperprompt_jax.methods import prompt_tuning

REGISTRY = (adapters, hyperformer, prompt_tuning, hyperprompt, hypergrid)

STACKS = ('encoder', 'decoder')


def scopes() -> tuple[str, ...]:
  """Every method's parameter scopes, in registry order."""
  return tuple(scope for method in REGISTRY for scope in method.SCOPES)


def axis_names() -> tuple[str, ...]:
  """The logical axis names the methods add, each once, in registry order."""
  return tuple(dict.fromkeys(
      name for method in REGISTRY for name in method.AXIS_NAMES))


def variant_files() -> tuple[str, ...]:
  """Every gin/variants file that selects a method, in registry order."""
  return tuple(f for method in REGISTRY for f in method.VARIANT_FILES)


# A variant's name is its gin/variants file's. The benchmarks' --variants
# named HyperPrompt's by the hypernetwork alone before 0.2; those names
# keep working, with a warning, for one release.
RENAMED_VARIANTS = {'share': 'hyperprompt_share', 'sep': 'hyperprompt_sep',
                    'global': 'hyperprompt_global'}


def variant_names(flag: str) -> list[str]:
  """The names of a comma-separated --variants value, old names renamed."""
  names = []
  for name in (n for n in flag.split(',') if n):
    if name in RENAMED_VARIANTS:
      warnings.warn(f"--variants: '{name}' is now "
                    f"'{RENAMED_VARIANTS[name]}'", DeprecationWarning,
                    stacklevel=2)
      print(f"--variants: '{name}' is now '{RENAMED_VARIANTS[name]}' (the "
            'old name goes in the next release)', file=sys.stderr)
      name = RENAMED_VARIANTS[name]
    names.append(name)
  return names


def configured(model_config: Any) -> list[tuple[Any, Any]]:
  """`(method module, its config)` of the methods `model_config` turns on."""
  return [(method, getattr(model_config, method.CONFIG_FIELD))
          for method in REGISTRY
          if getattr(model_config, method.CONFIG_FIELD) is not None]


def check(model_config: Any) -> None:
  """Each configured method's own check."""
  for method, cfg in configured(model_config):
    method.check(cfg, model_config)


def is_task_conditioned(model_config: Any) -> bool:
  """Whether any method conditions a stack (so the network reads task ids)."""
  return any(method.is_active(cfg, stack)
             for method, cfg in configured(model_config) for stack in STACKS)
