r"""Training-step time and peak memory of each variant relative to MTL T5.

    python -m hyperprompt_jax.benchmark [--gin_file=models/t5_1_1_small.gin]
        [--batch_sizes=4,8,16] [--input_length=512] [--target_length=32]
        [--variants=adapter,hyperprompt_global,hypergrid_lg,...] [--placement=both]
        [--rounds=3] [--steps=3] [--gin.ACTIVATION_DTYPE="'float32'"]
    python -m hyperprompt_jax.benchmark --table --batch_sizes=4 \
        [--table_model=models/t5_1_1_base.gin] [--flops_batch_size=128]
    python -m hyperprompt_jax.benchmark --decode --batch_sizes=16 \
        [--target_length=32]
    python -m hyperprompt_jax.benchmark --packing --batch_sizes=8 \
        [--lengths=fixture,glue_super_glue]

For every batch size, one jit-compiled training step (`trainer.train_step`,
the built-in runner's own: forward, backward, `make_optimizer`'s Adafactor
update) is built for the MTL network and for each variant. Each variant is
its gin/variants file (one per method of `methods.REGISTRY`) over the model
of `--gin_file`, at the file's defaults, the papers' (Vanilla Adapter r 32,
HyperFormer++ r 16, t' 512, e 128, t 64, Prompt-Tuning 12 tokens, T = 8;
HyperPrompt l_enc 16, l_dec 6, r 32, t' 64, e 128, t 64, T = 8; HyperGrid
32 x 128 on `wo`, task attention conditioning, T = 16). The steps are timed
side by side in this one process, in interleaved rounds (MTL, share, ...,
then share, ..., MTL: each round starts one variant later) so drift and
position hit every variant alike; the median per-step time gives the ratio
variant / MTL. Peak memory is XLA's own
estimate for the compiled step (`compiled.memory_analysis()`: temporaries +
arguments + outputs - aliased). Hyper-prompts are computed once per step for
all tasks, so their ratio should not grow with the batch size.

`--table` prints one row per variant: the parameter ratio and the forward FLOPs
per example (XLA's cost analysis, `param_table.forward_flops`) of the
`--table_model` network, beside the step-time ratio of the `--gin_file`
network (T5.1.1-small by default) at the first batch size.

`--decode` times one incremental decode step instead (one token against the
autoregressive cache of `--target_length`, `--input_length` encoder tokens)
at the first batch size, beside MTL's: what the cache holds per task and
`encoded` (hyper-prompts, HyperGrid's decoder gates) is computed when the
cache is created, not at every step.

`--remat_microbatches` times MTL's step at the first batch size with every
NUM_MICROBATCHES in 1, 2, 4 and REMAT_POLICY in none, minimal, full, side by
side: seconds and peak memory against the plain step (1 / none), and the
temporaries' share of the peak (what the two knobs cut).

`--packing` compares real target tokens per second of packed and unpacked
rows for MTL and every variant that packs, on two length distributions, at
the first batch size (`packing_benchmark.py`).

`--mfu` measures the model FLOPs utilisation of the training step of MTL,
HyperPrompt-Global, HyperGrid-LG, the Vanilla Adapter, HyperFormer++ and
Prompt-Tuning on synthetic GLUE + SuperGLUE-like rows, on the device JAX
runs on (`mfu.py`): step time, real tokens/s, FLOPs, TFLOP/s, MFU, peak
memory, and a JSON of them (`--output_json`). It needs neither gin nor
TensorFlow (its flags are the ones marked --mfu, and --variants,
--input_length, --target_length, --steps):

    python -m hyperprompt_jax.benchmark --mfu --model=t5_1_1_base \
        --batch_size=32 --input_length=512 --target_length=32 --steps=5 \
        --warmup_steps=3 --output_json=/tmp/mfu.json

`--tpu_compile` compiles a run's training step and decode for a TPU slice
(`--topology`: a gcloud accelerator type such as v3-32, or a topology name
such as v3:4x4) on this host, with no TPU (libtpu, the `[tpu]` extra), and
prints what each device and chip would hold and do (`tpu_compile.py`): of
the run of `--gin_file` (or of each `--setups` name), or, without gin, of
the --mfu variants (--model, --variants, --forms, --batch_size,
--mesh_model).
A t5x run file (gin/t5x/) compiles t5x's own train, eval and predict steps
as t5x.train builds them (`hyperprompt_jax/t5x/steps_compile.py`; needs t5x):

    python -m hyperprompt_jax.benchmark --tpu_compile --topology=v3:4x4 \
        --gin_file=runs/hypergrid_lg_glue_super_glue.gin \
        --output_json=/tmp/tpu.json
    python -m hyperprompt_jax.benchmark --tpu_compile --topology=v3-32 \
        --gin_file=t5x/hypergrid_lg_glue_super_glue.gin
"""

import argparse
import sys
from typing import Optional, Sequence


def _add_step_time_flags(parser: argparse.ArgumentParser) -> None:
  """The step-time benchmark (the default): batches, placement, rounds."""
  parser.add_argument('--batch_sizes', default='4,8,16')
  parser.add_argument('--placement', default='both',
                      help="HyperPrompt's prompt placement (default: both)")
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=3)


def add_model_flags(parser: argparse.ArgumentParser, scope: str = '') -> None:
  """The networks measured without a run file: backbone, variants, forms,
  rows (this command's --mfu and --tpu_compile, and `compile`'s).

  Args:
    parser: the parser or argument group to add them to.
    scope: the help's prefix naming which modes read the flag.
  """
  # --variants is checked in `main` against VARIANTS and
  # hyperprompt.PLACEMENTS, which --help does not import.
  mfu_variants = ('mtl, hyperprompt_global, hypergrid_lg, adapter, '
                  'hyperformer_pp, prompt_tuning')
  parser.add_argument('--variants',
                      help='comma-separated gin/variants names (default: '
                           + (f'{mfu_variants}' if not scope else
                              'every method of methods.REGISTRY; '
                              f'{scope}{mfu_variants}') + ')')
  parser.add_argument('--input_length', type=int, default=512)
  parser.add_argument('--target_length', type=int, default=32)
  parser.add_argument('--model', default='t5_1_1_base',
                      help=f'{scope}the backbone, a gin/models file name, '
                           'e.g. t5_1_1_tiny, t5_1_1_large (default: '
                           't5_1_1_base)')
  parser.add_argument('--dtype', default='bfloat16',
                      help=f'{scope}activation dtype (default: bfloat16)')
  parser.add_argument('--batch_size', type=int, default=32,
                      help=f'{scope}rows per step (default: 32)')
  parser.add_argument('--forms', default='both',
                      help=f'{scope}both forms of the variants that have two '
                           '(T5Config.gradient_form, HyperGridConfig.'
                           'packed_form), each default, or the forms named: '
                           'both, auto, or e.g. written,grouped,pallas '
                           '(default: both)')
  parser.add_argument('--num_layers', type=int, default=None,
                      help=f"{scope}layers a stack (default: --model's); "
                           'fewer for a quick run')


def _add_side_by_side_flags(parser: argparse.ArgumentParser) -> None:
  """The other side-by-side benchmarks, each at the first batch size."""
  parser.add_argument(
      '--gated_matmul', action='store_true',
      help="only time HyperGrid's blockwise and fold routes of a gated wo "
           'at lengths 1, 8, 32, 128 and --input_length, at the first '
           'batch size')
  parser.add_argument(
      '--table', action='store_true',
      help='the variant table: parameter ratio and forward FLOPs per '
           'example of the --table_model network (at --input_length / '
           '--target_length, batch --flops_batch_size), and the step-time '
           'ratio over MTL of the --gin_file network at the first batch '
           'size')
  parser.add_argument('--table_model', default='models/t5_1_1_base.gin',
                      help='model gin file of the --table parameter and '
                           'FLOPs columns')
  parser.add_argument('--flops_batch_size', type=int, default=128,
                      help="batch of the FLOPs count (the papers' 128): "
                           'per-task parts are computed once per batch')
  parser.add_argument(
      '--decode', action='store_true',
      help='time one incremental decode step of each variant against its '
           'cache (ratio over MTL) at the first batch size')
  parser.add_argument(
      '--packing', action='store_true',
      help='real target tokens per second, packed against unpacked rows, '
           'of MTL and each variant that packs, at the first batch size')
  parser.add_argument('--lengths', default='fixture,glue_super_glue',
                      help='--packing: length distributions, of '
                           'fixture, glue_super_glue')
  parser.add_argument('--metabalance', default=None, metavar='T,T',
                      help='time the step with MetaBalance (auxiliaries '
                      "'each' and 'all') beside the plain one, for each "
                      'number of tasks T (e.g. 8,16), at the first batch '
                      'size')
  parser.add_argument('--remat_microbatches', action='store_true',
                      help='time the MTL step with NUM_MICROBATCHES 1, 2, 4 '
                      'and REMAT_POLICY none, minimal, full side by side '
                      '(seconds and peak memory against 1 / none) at the '
                      'first batch size')


def _add_memory_flags(parser: argparse.ArgumentParser) -> None:
  """--memory: the paper setups' step memory."""
  parser.add_argument('--memory', action='store_true',
                      help="each paper setup's training step at its batch: "
                      'per-device peak memory without / with full remat, '
                      'and the smallest NUM_MICROBATCHES that fits '
                      '--device_memory_gb (memory_table.py)')
  parser.add_argument('--setups', default=None,
                      help='--memory, --tpu_compile: setups to measure, '
                      'comma-separated: run file names (runs/<name>.gin), each optionally with '
                      'gin files added after a +, e.g. '
                      'hyperprompt_global_glue+models/t5_1_1_large '
                      '(default: every gin/setups/ setup)')
  parser.add_argument('--devices', type=int, default=1,
                      help='--memory: devices of data parallelism the '
                      'batch is split over (default: 1)')
  parser.add_argument('--device_memory_gb', default='80,40',
                      help='--memory: device memories to fit, GB '
                      '(default: 80,40)')


def _add_mfu_flags(parser: argparse.ArgumentParser) -> None:
  """--mfu: model FLOPs utilisation, without gin."""
  parser.add_argument(
      '--mfu', action='store_true',
      help='model FLOPs utilisation of each variant\'s training step on this '
           'device (benchmarks/mfu.py); no gin, no TensorFlow')
  add_model_flags(parser, scope='--mfu, --tpu_compile: ')
  parser.add_argument('--warmup_steps', type=int, default=3,
                      help='--mfu: untimed steps after compiling (default: '
                           '3); --steps are then timed one by one')
  parser.add_argument('--peak_tflops', type=float, default=None,
                      help="--mfu: the device's dense bf16 TFLOP/s (default: "
                           "from the device's kind; a CPU has none)")
  parser.add_argument('--output_json', default=None,
                      help='--mfu, --tpu_compile: the JSON of the figures, '
                           'rewritten after each variant or setup')
  parser.add_argument('--profile', default=None,
                      help='--mfu: variants whose step is traced after timing '
                           'and broken down by XLA op and kernel (names, or '
                           'all)')
  parser.add_argument('--profile_dir', default=None,
                      help="--mfu: where the traces go (default: "
                           "'profiles' beside --output_json)")


def _add_tpu_compile_flags(parser: argparse.ArgumentParser) -> None:
  """--tpu_compile: a step compiled for a TPU slice."""
  parser.add_argument(
      '--tpu_compile', action='store_true',
      help='compile the training step (and decode) for a TPU slice, no TPU '
           'needed (benchmarks/tpu_compile.py): per-chip memory against its '
           'HBM, FLOPs, bytes, collectives, scatters; of the run of '
           '--gin_file / --setups, or without them of the --mfu variants '
           '(python -m hyperprompt_jax.compile)')
  add_tpu_compile_flags(parser)


def add_tpu_compile_flags(parser: argparse.ArgumentParser) -> None:
  """The compile's own flags (python -m hyperprompt_jax.compile's too)."""
  parser.add_argument('--topology', default='v3:4x4',
                      help='--tpu_compile: the TPU slice, a gcloud '
                           'accelerator type (v3-32, v4-16, v5p-64, '
                           'v5litepod-16 or v5e-16, v6e-64) or a topology '
                           'name (v3:4x4, v5e:2x2, v5p:4x4x4; default: '
                           'v3:4x4)')
  parser.add_argument('--mesh_model', type=int, default=1,
                      help='--tpu_compile without gin: the model axis '
                           '(MESH_MODEL; default: 1)')
  parser.add_argument('--num_microbatches', type=int, default=None,
                      help='--tpu_compile without gin: NUM_MICROBATCHES')
  parser.add_argument('--eval_batch_size', type=int, default=None,
                      help='--tpu_compile without gin: rows of the decode '
                           'to compile too (default: none); of a t5x run '
                           "file: predict's rows (default: the run's "
                           'infer_eval batch, else 64)')


def add_flags(parser: argparse.ArgumentParser) -> None:
  """Every benchmark's flags (the ones a benchmark does not read are
  ignored)."""
  _add_step_time_flags(parser)
  _add_side_by_side_flags(parser)
  _add_memory_flags(parser)
  _add_mfu_flags(parser)
  _add_tpu_compile_flags(parser)


def _without_gin(argv: Sequence[str]) -> int:
  """`--mfu`, and `--tpu_compile` of the MFU benchmark's variants: their flags
  parsed and run without gin (an accelerator image may lack it, and these
  take no gin file)."""
  parser = argparse.ArgumentParser(
      prog='python -m hyperprompt_jax.benchmark', description=__doc__,
      formatter_class=argparse.RawTextHelpFormatter)
  add_flags(parser)
  args = parser.parse_args(argv)
  if args.tpu_compile:
    from hyperprompt_jax.benchmarks import tpu_compile  # pylint: disable=g-import-not-at-top
    return tpu_compile.run_models(args)
  from hyperprompt_jax.benchmarks import mfu  # pylint: disable=g-import-not-at-top
  return mfu.run(args)


def _uses_gin(argv: Sequence[str]) -> bool:
  return any(a.startswith(('--gin', '--setups')) for a in argv)


def compile_for_tpu(args: argparse.Namespace) -> int:
  """The compile of `args` (gin flags parsed): a t5x run file's t5x steps,
  built-in run files' steps, or without gin the MFU variants'."""
  from hyperprompt_jax.benchmarks import tpu_compile  # pylint: disable=g-import-not-at-top
  search = [p for p in args.gin_search_paths.split(',') if p]
  if not args.gin_file and not args.setups:
    return tpu_compile.run_models(args)
  if not args.setups and tpu_compile.t5x_script(args.gin_file, search):
    # t5x's own steps (imported here: the package works without t5x).
    tpu_compile.check_t5x_run(args, search)
    from hyperprompt_jax.t5x import steps_compile  # pylint: disable=g-import-not-at-top
    return steps_compile.run(args, search)
  return tpu_compile.run_gin(args)


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if '--mfu' in argv or ('--tpu_compile' in argv and not _uses_gin(argv)):
    return _without_gin(argv)
  # Imported here: gin_utils imports gin, which --mfu does without.
  from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
  args = gin_utils.command_flags(
      'python -m hyperprompt_jax.benchmark', __doc__, argv,
      add_flags=add_flags)
  if args.tpu_compile:
    return compile_for_tpu(args)
  from hyperprompt_jax.benchmarks import benchmark_suite  # pylint: disable=g-import-not-at-top
  return benchmark_suite.run(args)


if __name__ == '__main__':
  if '--mfu' in sys.argv[1:] or ('--tpu_compile' in sys.argv[1:]
                                 and not _uses_gin(sys.argv[1:])):
    try:
      sys.exit(main())
    except ValueError as e:  # a usage mistake: one line, as gin_utils.run
      print(f'error: {e}', file=sys.stderr)
      sys.exit(2)
  from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
  gin_utils.run(main)
