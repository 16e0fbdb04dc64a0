r"""Hugging Face T5 checkpoints in and out: `python -m hyperprompt_jax.convert`.

From transformers (T5, T5.1.1, LM-adapted, Flan-T5, mT5: config.json +
model.safetensors, sharded or not) to a t5x-layout checkpoint_0 that every
method starts from as INITIAL_CHECKPOINT_PATH, and the model's gin file
(model.gin, also printed):

  python -m hyperprompt_jax.convert --from_hf=/data/flan-t5-base \
    --output_dir=/tmp/flan_t5_base_t5x

To transformers: a checkpoint's T5 backbone as config.json +
model.safetensors (T5ForConditionalGeneration.from_pretrained loads it); the
model comes from gin, as for export_task_params. Prompt-Tuning's prompts go
beside it as PEFT adapters; a task-conditioned method's parameters (which
transformers cannot run) to the project's task_params.npz:

  python -m hyperprompt_jax.convert --to_hf \
    --gin_file=runs/quickstart_model.gin \
    --checkpoint_path=/tmp/hyperprompt_quickstart/checkpoint_1300 \
    --output_dir=/tmp/quickstart_hf

Neither direction needs PyTorch or transformers.
"""

from typing import Optional, Sequence

from hyperprompt_jax.common import gin_utils


def add_flags(parser) -> None:
  parser.add_argument('--from_hf',
                      help='a transformers T5 directory to convert to a '
                      't5x-layout checkpoint')
  parser.add_argument('--to_hf', action='store_true',
                      help='convert --checkpoint_path (read as the gin '
                      'model) to a transformers directory')
  parser.add_argument('--checkpoint_path',
                      help='--to_hf: the checkpoint_<step> folder (either '
                      'runner, either layout)')
  parser.add_argument('--output_dir',
                      help='where the checkpoint (or transformers files) '
                      'are written')
  parser.add_argument('--step', type=int, default=0,
                      help='--from_hf: the step of the checkpoint written '
                      '(default: %(default)s)')
  parser.add_argument('--sentencepiece_model',
                      help="--from_hf: checked against config.json's "
                      "vocab_size (default: the directory's spiece.model); "
                      '--to_hf: copied beside the weights as spiece.model')


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = gin_utils.command_flags(
      'python -m hyperprompt_jax.convert', __doc__, argv,
      add_flags=add_flags)
  from hyperprompt_jax.huggingface import conversion  # pylint: disable=g-import-not-at-top
  return conversion.run(args)


if __name__ == '__main__':
  gin_utils.run(main)
