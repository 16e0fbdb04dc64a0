"""What a run's gin config records, for the commands reading its checkpoints.

A paper setup names its evaluation protocol (SELECTION, SELECTION_BENCHMARK)
in its setup file, and both runners write the run's gin config beside its
checkpoints as `MODEL_DIR/config.gin` (t5x's eval writes its own, naming
the run in CHECKPOINT_PATH). Evaluation reads the protocol there, so the
user never repeats the setup file, and says so when one given differs
(docs/evaluation.md, "Which checkpoint: the selection protocols"). Likewise
the run's MESH_MODEL, which eval, infer, probe and leaderboard take where
their gin leaves it None.
"""

import dataclasses
import logging
import os
import re
from typing import Any, Optional, Sequence

from etils import epath
from gin import config_parser

DEFAULT_SELECTION = 'best_per_task'
DEFAULT_BENCHMARK = 'glue'
CONFIG_FILE = 'config.gin'
_CHECKPOINT_DIR = re.compile(r'checkpoint_\d+')

log = logging.getLogger('hyperprompt_jax.eval')


@dataclasses.dataclass(frozen=True)
class Protocol:
  """Which checkpoint each task is read at (`eval_summary.select`)."""
  selection: str
  benchmark: str


class _Values(config_parser.ParserDelegate):
  """Parses a written config binding nothing: a reference stays a string."""

  def configurable_reference(self, scoped_name, evaluate):
    return f'@{scoped_name}'

  def macro(self, name):
    return f'%{name}'


def config_macros(text: str) -> dict[str, Any]:
  """The literal macro values of a gin config (`NAME = value` lines)."""
  out = {}
  for statement in config_parser.ConfigParser(text, _Values()):
    if (isinstance(statement, config_parser.BindingStatement)
        and not statement.arg_name and not statement.scope
        and '.' not in statement.selector):
      out[statement.selector] = statement.value
  return out


def _read_macros(directory: str) -> Optional[dict[str, Any]]:
  path = epath.Path(directory) / CONFIG_FILE
  if not path.exists():
    return None
  return config_macros(path.read_text())


def run_dir(checkpoint_path: str) -> str:
  """The MODEL_DIR of a `checkpoint_<step>` folder, or the folder itself."""
  path = checkpoint_path.rstrip('/')
  if _CHECKPOINT_DIR.fullmatch(os.path.basename(path)):
    return os.path.dirname(path)
  return path


def recorded(checkpoint_path: str) -> tuple[Optional[Protocol], str]:
  """The protocol the run of `checkpoint_path` records, and the file read.

  `checkpoint_path` is a MODEL_DIR or one of its checkpoints; None where the
  run records no protocol.
  """
  directory = run_dir(checkpoint_path)
  macros = _read_macros(directory)
  where = os.path.join(directory, CONFIG_FILE)
  if not macros or not isinstance(macros.get('SELECTION'), str):
    return None, where
  benchmark = macros.get('SELECTION_BENCHMARK')
  return Protocol(macros['SELECTION'],
                  benchmark if isinstance(benchmark, str)
                  else DEFAULT_BENCHMARK), where


def recorded_mesh_model(checkpoint_path: str) -> Optional[int]:
  """The MESH_MODEL the run of `checkpoint_path` trained with, or None."""
  macros = _read_macros(run_dir(checkpoint_path)) or {}
  value = macros.get('MESH_MODEL')
  return value if isinstance(value, int) and not isinstance(value, bool) else None


def evaluated_run(metrics_dir: str) -> Optional[str]:
  """The CHECKPOINT_PATH a t5x eval output directory scored, or None."""
  directory = metrics_dir.rstrip('/')
  if os.path.basename(directory) == 'inference_eval':
    directory = os.path.dirname(directory)
  macros = _read_macros(directory) or {}
  path = macros.get('CHECKPOINT_PATH')
  return path if isinstance(path, str) else None


def resolve(selection: Optional[str], benchmark: Optional[str],
            checkpoint_paths: Sequence[Optional[str]]) -> Protocol:
  """The protocol to score with: as given, else the runs', else the default.

  Logs which and why.

  Raises:
    ValueError: the runs record different protocols and none is given.
  """
  found = {}
  for path in checkpoint_paths:
    if path is not None:
      protocol, where = recorded(path)
      if protocol is not None:
        found[where] = protocol
  if selection is None and len(set(found.values())) > 1:
    raise ValueError(
        'The runs record different evaluation protocols ('
        + ', '.join(f'{w}: {p.selection} / {p.benchmark}'
                    for w, p in found.items())
        + '): evaluate them apart, or give SELECTION and '
        'SELECTION_BENCHMARK.')
  run = next(iter(found.values()), None)
  chosen = Protocol(
      selection or (run.selection if run else DEFAULT_SELECTION),
      benchmark or (run.benchmark if run else DEFAULT_BENCHMARK))
  if run is None:
    log.info('Protocol: %s (%s average); the run records none.',
             chosen.selection, chosen.benchmark)
  elif chosen != run:
    log.warning(
        'Protocol: %s (%s average) as given, though the run records %s (%s '
        'average) in %s: the scores follow the one given, not the setup\'s.',
        chosen.selection, chosen.benchmark, run.selection, run.benchmark,
        ', '.join(found))
  else:
    log.info('Protocol: %s (%s average), as the run records (%s).',
             chosen.selection, chosen.benchmark, ', '.join(found))
  return chosen
