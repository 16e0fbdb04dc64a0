r"""Evaluating checkpoints: `python -m hyperprompt_jax.eval`.

seqio evaluation of every task of a mixture (its own metrics, T5's
postprocessors) for one `checkpoint_<step>` or a directory of them, written
by either runner (the built-in one or t5x, orbax or legacy layout):

  python -m hyperprompt_jax.eval --gin_file=runs/quickstart_eval.gin \
    --gin.CHECKPOINT_PATH="'/tmp/hyperprompt_quickstart'"

Macros (t5x's names): CHECKPOINT_PATH, EVAL_OUTPUT_DIR, MIXTURE_OR_TASK_NAME,
TASK_FEATURE_LENGTHS, plus EVAL_BATCH_SIZE, EVAL_SPLIT, MAJORITY_BASELINE,
SELECTION, SELECTION_BENCHMARK, COMPARE_TO (a paper setup of
`paper_results`: the scores printed and plotted beside the paper's).
Writes, in EVAL_OUTPUT_DIR, seqio's `inference_eval/<task>-metrics.jsonl`
(the files t5x writes), `summary.json`, `best_per_task.json` and
`task_scores.png` (`eval_summary`), and prints the per-task table with the
GLUE / SuperGLUE averages. SELECTION says which checkpoint each task is read
at, as the papers did: 'best_per_task' (HyperPrompt), 'best_average'
(HyperGrid: one checkpoint, the best SELECTION_BENCHMARK average) or 'last';
`eval_summary` cites the papers' lines. By default it is the protocol the
run records (its setup file, in MODEL_DIR/config.gin, which
both runners write), else 'best_per_task'; one given that differs is said. A checkpoint
that cannot be read is skipped and listed in `summary.json`
(`unreadable_checkpoints`); the others are still summarised, and the command
then exits with status 1.

Several runs of one setup (seeds) in one command: a list of run directories,

  --gin.CHECKPOINT_PATH="['/runs/seed0', '/runs/seed1', '/runs/seed2']"

evaluates each into EVAL_OUTPUT_DIR/<run>/ and writes the aggregate (each
task's and average's mean ± std, min, max over the runs) to
EVAL_OUTPUT_DIR/summary.json and task_scores.png.

t5x users who evaluated on TPU get the same summaries from t5x's output:

  python -m hyperprompt_jax.eval --metrics_dir=gs://.../inference_eval \
    --output_dir=/tmp/summary
  python -m hyperprompt_jax.eval --metrics_dir gs://.../seed0/eval \
    gs://.../seed1/eval gs://.../seed2/eval --output_dir=/tmp/summary
"""

import argparse
from typing import Optional, Sequence

from hyperprompt_jax.common import gin_utils


def add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('--metrics_dir', nargs='+', action='extend',
                      help="summarise t5x's evaluation output "
                      '(<task>-metrics.jsonl files) instead of evaluating; '
                      'no gin needed. Several directories (runs of one setup, '
                      'e.g. seeds): each is summarised and the runs '
                      'aggregated (mean ± std, max)')
  parser.add_argument('--output_dir', help='where --metrics_dir writes the '
                      'summary (default: the metrics directory; required for '
                      'several)')
  parser.add_argument('--selection',
                      help="with --metrics_dir: 'best_per_task' (HyperPrompt), "
                      "'best_average' (HyperGrid: one checkpoint, the best "
                      "--selection_benchmark average) or 'last' (SELECTION "
                      'with gin; see eval_summary); default: the protocol the '
                      "evaluated run records in its config.gin, else "
                      "'best_per_task'")
  parser.add_argument('--compare_to',
                      help='a paper setup (paper_results.setups(), e.g. '
                      'hyperprompt_global_glue): print and plot the scores '
                      "beside the paper's (COMPARE_TO with gin)")
  parser.add_argument('--selection_benchmark',
                      help="with --metrics_dir and --selection=best_average: "
                      "'glue', 'super_glue', 'glue_super_glue' or 'all' "
                      "(SELECTION_BENCHMARK with gin); default: the run's, "
                      "else 'glue'")
  gin_utils.add_distributed_flags(parser)


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = gin_utils.command_flags(
      'python -m hyperprompt_jax.eval', __doc__, argv,
      add_flags=add_flags, tensorflow=True)
  from hyperprompt_jax.evaluation import evaluator  # pylint: disable=g-import-not-at-top
  return evaluator.run(args)


if __name__ == '__main__':
  gin_utils.run(main)
