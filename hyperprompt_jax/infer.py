r"""Predictions per task: `python -m hyperprompt_jax.infer`.

Greedy decoding (`decoding`) of every task of a mixture (or one task) with
one checkpoint of either runner, written as JSON lines per task:

  python -m hyperprompt_jax.infer --gin_file=runs/quickstart_infer.gin \
    --gin.CHECKPOINT_PATH="'/tmp/hyperprompt_quickstart/checkpoint_1300'"

  <INFER_OUTPUT_DIR>/<task>-<step>.jsonl, one line per example:
    {"inputs": text, "targets": text, "prediction": decoded text,
     "prediction_value": the task's postprocessor on the prediction,
     "target_value": ... on the target, "task_id": id}

Macros: CHECKPOINT_PATH (one `checkpoint_<step>`), INFER_OUTPUT_DIR,
MIXTURE_OR_TASK_NAME, TASK_FEATURE_LENGTHS, INFER_SPLIT ('validation'),
INFER_BATCH_SIZE (64), INFER_NUM_EXAMPLES (None: all). Beam search is t5x's
(`t5x.infer` with this project's gin files); the built-in runner decodes
greedily, as t5x's evaluation does.
"""

from typing import Optional, Sequence

from hyperprompt_jax.common import gin_utils


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = gin_utils.command_flags(
      'python -m hyperprompt_jax.infer', __doc__, argv,
      add_flags=gin_utils.add_distributed_flags, tensorflow=True)
  from hyperprompt_jax.evaluation import inference  # pylint: disable=g-import-not-at-top
  return inference.run(args)


if __name__ == '__main__':
  gin_utils.run(main)
