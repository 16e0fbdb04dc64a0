r"""The built-in training runner: `python -m hyperprompt_jax.train`.

For machines without t5x (CI, GPU boxes, laptops); gin-configured with t5x's
flags and macro names, so a t5x user reads it at once:

  python -m hyperprompt_jax.train \
    --gin_file=runs/quickstart.gin --gin.MODEL_DIR="'/tmp/quickstart'"

Macros: MODEL_DIR, MIXTURE_OR_TASK_NAME, TASK_FEATURE_LENGTHS, TRAIN_STEPS,
BATCH_SIZE, INITIAL_CHECKPOINT_PATH (a pretrained t5x checkpoint: backbone
loaded, new parameters fresh, step 0, fresh optimizer state; a trained
multi-task one: its task parameters too, grown to NUM_TASKS by
NEW_TASK_INIT), TASK_PARAMS_PATH (an exported artifact of task parameters
placed on that backbone), TRAIN_ONLY_NEW_TASKS, SAVE_PERIOD,
KEEP_CHECKPOINTS, SEED. A run whose MODEL_DIR holds checkpoints resumes from
the newest that restores (the initial checkpoint is then ignored, as in
t5x), data position included, and refuses one written with other model or
data settings. SIGTERM / SIGINT save a checkpoint at the next step, then
exit with status 128 + the signal. One trainer per MODEL_DIR (`train.lock`).
The gin config and operative config are written to MODEL_DIR with the
run's first checkpoint.
"""

from typing import Optional, Sequence

from hyperprompt_jax.common import gin_utils


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = gin_utils.command_flags(
      'python -m hyperprompt_jax.train', __doc__, argv,
      add_flags=gin_utils.add_distributed_flags, tensorflow=True)
  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.evaluation import during_training
  from hyperprompt_jax.runner import training_loop
  # pylint: enable=g-import-not-at-top
  return training_loop.run(args, evaluation=during_training.EVALUATION)


if __name__ == '__main__':
  gin_utils.run(main)
