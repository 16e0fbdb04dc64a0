r"""A run compiled for a TPU slice from this host, before it is launched.

    python -m hyperprompt_jax.compile --topology=v3-32 \
        --gin_file=runs/hyperprompt_global_glue.gin [--output_json=/tmp/tpu.json]
    python -m hyperprompt_jax.compile --topology=v3-32 \
        --gin_file=t5x/hypergrid_lg_glue_super_glue.gin [--gin.MESH_MODEL=2]
    python -m hyperprompt_jax.compile --topology=v3:4x4 \
        --setups=mtl_glue,hyperprompt_global_glue
    python -m hyperprompt_jax.compile --topology=v5e:2x2 \
        --model=t5_1_1_base --variants=hyperprompt_global,hypergrid_lg --batch_size=32

The training command's run file, compiled as that command steps it: a
built-in run file (`runs/`) gives the `RunSettings` and network that
`python -m hyperprompt_jax.train` makes of it, and its train step
(`trainer.train_step`) and decode are compiled; a t5x run file (`t5x/`)
gives t5x's own train, eval and predict steps as `python -m t5x.train`
builds them (t5x installed). `--setups` names several built-in run files;
without gin, the MFU benchmark's variants are compiled (`--model`,
`--variants`, `--forms`, `--batch_size`, `--mesh_model`).

`--topology` is the slice as gcloud names it (v3-32, v4-32, v5litepod-16,
v6e-64) or a `jax.experimental.topologies` name (v3:4x4). libtpu compiles
for it with no TPU (the `[tpu]` extra; one process at a time). Printed per
program: memory per device and per chip against the HBM, FLOPs, bytes
accessed, collectives (docs/performance.md, "On a TPU slice").
`python -m hyperprompt_jax.benchmark --tpu_compile` is the same command.
"""

import argparse
from typing import Optional, Sequence

from hyperprompt_jax import benchmark


def add_flags(parser: argparse.ArgumentParser) -> None:
  """The slice, the run's files (gin_utils adds --gin_file / --gin.X=Y),
  and without gin the MFU benchmark's variants."""
  benchmark.add_tpu_compile_flags(parser)
  parser.add_argument('--setups', default=None,
                      help='built-in run files to compile, comma-separated '
                      '(runs/<name>.gin), each optionally with gin files '
                      'added after a +, e.g. '
                      'hyperprompt_global_glue+models/t5_1_1_large')
  parser.add_argument('--output_json', default=None,
                      help='the JSON of the figures, rewritten after each '
                      'program')
  models = parser.add_argument_group(
      'without gin: the MFU benchmark\'s variants')
  benchmark.add_model_flags(models)


def main(argv: Optional[Sequence[str]] = None) -> int:
  # Imported here: --help answers before gin_utils imports gin.
  from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
  args = gin_utils.command_flags('python -m hyperprompt_jax.compile',
                                 __doc__, argv, add_flags=add_flags)
  return benchmark.compile_for_tpu(args)


if __name__ == '__main__':
  from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
  gin_utils.run(main)
