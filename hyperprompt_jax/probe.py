r"""The attention probe of HyperPrompt's Fig. 3 / §A.3: `python -m
hyperprompt_jax.probe`.

For each checkpoint of a directory (either runner, either layout) and each
task of a mixture, it runs the evaluation examples through the network
once, teacher-forced (the decoder reads the targets, as in training; not
autoregressive decoding), with the attention probabilities sown
(`layers.PROBE_COLLECTION`; a normal call traces nothing of it), and
reports, per stack ('encoder' self-attention, 'decoder' self-attention,
'cross' attention), layer and head, averaged over the real (non-padding)
query tokens of the examples:

  prompt_mass    the share of attention on the prompt columns: the
                 hyper-prompts prepended to the keys (HyperPrompt), or the
                 soft-prompt positions of the encoder input (Prompt-Tuning;
                 encoder and cross attention); None without prompts (MTL);
  entropy        of the attention distribution over every key column,
                 prompts included (nats);
  token_entropy  of the distribution over the token columns alone,
                 renormalised without the prompts: the paper's entropy
                 ("re-normalizing the softmax distribution after removing
                 hyper-prompts", HyperPrompt, Appendix A.3), comparable
                 with MTL's.

The paper's per-layer mass is "averaged ... across 100 validation examples
and each attention head in a layer, and summed across each query"
(HyperPrompt, Appendix A.3): the mean over heads here times the number of
queries. It plots the encoder, for MRPC, HyperPrompt-Global against MTL
(HyperPrompt, Sec. 4.6, Fig. 3).

  python -m hyperprompt_jax.probe --gin_file=runs/quickstart_probe.gin

Macros (t5x's names): CHECKPOINT_PATH, MIXTURE_OR_TASK_NAME,
TASK_FEATURE_LENGTHS, plus PROBE_OUTPUT_DIR, PROBE_SPLIT ('validation'),
PROBE_NUM_EXAMPLES (100, the paper's), PROBE_BATCH_SIZE (8). Writes
`probe.json` and, per stack, `probe_<stack>.png` (mass and entropy by layer,
one line per task, a column per checkpoint).
"""

from typing import Optional, Sequence

from hyperprompt_jax.common import gin_utils


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = gin_utils.command_flags(
      'python -m hyperprompt_jax.probe', __doc__, argv,
      add_flags=gin_utils.add_distributed_flags, tensorflow=True)
  from hyperprompt_jax.evaluation import attention_probe  # pylint: disable=g-import-not-at-top
  return attention_probe.run(args)


if __name__ == '__main__':
  gin_utils.run(main)
