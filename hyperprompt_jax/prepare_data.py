r"""Preparing the TFDS data of a run: `python -m hyperprompt_jax.prepare_data`.

The runs never download (a missing dataset fails at once), so the TFDS
datasets their mixture reads are prepared once, with TFDS's own builders.
The mixture comes from the run's gin files (MIXTURE_OR_TASK_NAME) or
--mixture; the directory from --data_dir, else the gin files'
TFDS_DATA_DIR, else TFDS's default ($TFDS_DATA_DIR or ~/tensorflow_datasets).
glue_super_glue_proportional reads 17 datasets: 8 GLUE, 8 SuperGLUE and
definite_pronoun_resolution (docs/tasks.md lists them).

  python -m hyperprompt_jax.prepare_data --gin_file=runs/hyperprompt_glue.gin
  python -m hyperprompt_jax.prepare_data \
    --mixture=glue_super_glue_proportional --data_dir=gs://bucket/tfds \
    --prepare

Without --prepare it lists each dataset as prepared or missing and exits
with status 0 when all are prepared, 1 otherwise. --prepare builds the
missing ones (network needed: TFDS downloads each from its source) and
prints the flag that points the runs at the directory. --try_gcs lets TFDS
copy its public prepared copies from GCS instead (off unless given). On a
machine without network: prepare on one with network and copy the
directory. A t5x run file (t5x/*.gin) needs t5x to parse; without it, give
the setup's runner-neutral setup file (setups/*.gin) instead.
"""

import importlib
import importlib.util
import sys
from typing import Optional, Sequence

import gin

from hyperprompt_jax.common import gin_utils


def add_flags(parser) -> None:
  parser.add_argument('--mixture',
                      help='the seqio mixture or task whose data to prepare '
                      '(e.g. glue_super_glue_proportional: all 17 datasets); '
                      "default: the gin files' MIXTURE_OR_TASK_NAME")
  parser.add_argument('--data_dir',
                      help="TFDS's data directory, local or gs:// (default: "
                      "the gin files' TFDS_DATA_DIR, else TFDS's default)")
  action = parser.add_mutually_exclusive_group()
  action.add_argument('--list', action='store_true',
                      help='list each dataset as prepared or missing; exit '
                      'status 1 while any is missing (the default action)')
  action.add_argument('--prepare', action='store_true',
                      help="prepare the missing datasets with TFDS's builders "
                      '(network needed)')
  parser.add_argument('--try_gcs', action='store_true',
                      help="with --prepare: copy TFDS's public prepared "
                      'copies from GCS where there are some (off unless given)')


def _from_gin(args) -> tuple[Optional[str], Optional[str]]:
  """(MIXTURE_OR_TASK_NAME, the TFDS data directory) of the gin setup."""
  main = sys.modules['__main__']
  try:
    if importlib.util.find_spec('t5x') is not None and any(
        f.startswith('t5x/') for f in args.gin_file):
      # t5x's run files bind `__main__.train`: parse them as t5x.train would.
      sys.modules['__main__'] = importlib.import_module('t5x.train')
    gin_utils.parse_gin_flags(args)
  except ImportError as e:
    if importlib.util.find_spec('t5x') is not None:
      raise
    raise ValueError(
        f'{", ".join(args.gin_file)}: gin cannot read a t5x run file where '
        "t5x is not installed. Give its setup file instead "
        '(t5x/NAME.gin includes setups/NAME.gin, which both runners '
        'share), or --mixture.') from e
  finally:
    sys.modules['__main__'] = main
  try:
    mixture = gin.query_parameter('%MIXTURE_OR_TASK_NAME')
  except ValueError:
    mixture = None
  from hyperprompt_jax.tasks import sources  # pylint: disable=g-import-not-at-top
  return mixture, sources.resolve_tfds_data_dir()


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = gin_utils.command_flags(
      'python -m hyperprompt_jax.prepare_data', __doc__, argv,
      add_flags=add_flags, tensorflow=True)
  from hyperprompt_jax.tasks import prepare  # pylint: disable=g-import-not-at-top
  if args.try_gcs and not args.prepare:
    raise ValueError('--try_gcs only changes what --prepare downloads: pass '
                     'both, or neither to list the datasets.')
  mixture, data_dir = _from_gin(args) if args.gin_file else (None, None)
  mixture = args.mixture or mixture
  data_dir = args.data_dir or data_dir
  if not mixture:
    where = ('the gin files set no MIXTURE_OR_TASK_NAME' if args.gin_file
             else 'no --mixture or --gin_file given')
    raise ValueError(
        f'Which data? {where}: pass --mixture=glue_super_glue_proportional '
        '(all 17 datasets; or glue_proportional, super_glue_proportional, a '
        "task name) or the run's gin files (e.g. "
        '--gin_file=tasks/glue_super_glue.gin).')
  try:
    return prepare.run(mixture, None if data_dir is None else str(data_dir),
                       prepare_missing=args.prepare, try_gcs=args.try_gcs)
  except prepare.PrepareError as e:
    raise gin_utils.ReportedError(str(e)) from e


if __name__ == '__main__':
  gin_utils.run(main)
