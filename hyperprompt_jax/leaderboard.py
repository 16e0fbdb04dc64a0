r"""GLUE and SuperGLUE test-server files: `python -m hyperprompt_jax.leaderboard`.

Decodes the `test` split of every task of a mixture with one checkpoint and
writes the files the two leaderboards take, one per task, the labels mapped
back from T5's strings (the task's postprocessor, then the label names the
servers use):

  GLUE (gluebenchmark.com, zip the TSVs): `<Task>.tsv` with the header
  `index<TAB>prediction`: CoLA, SST-2, MRPC, QQP (0 / 1), STS-B (a float,
  clipped to [0, 5]), MNLI-m, MNLI-mm and AX ('entailment' / 'neutral' /
  'contradiction'), QNLI, RTE ('entailment' / 'not_entailment').
  SuperGLUE (super.gluebenchmark.com, zip the files): `<Task>.jsonl`, one
  `{"idx": i, "label": ...}` a line: BoolQ, WiC ('true' / 'false'), CB (its
  three names), COPA (0 / 1), RTE, AX-b, AX-g ('entailment' /
  'not_entailment'), WSC ('True' / 'False'), ReCoRD (the answer text, `idx`
  the query's), MultiRC (a line per paragraph: `{"idx": p, "passage":
  {"questions": [{"idx": q, "answers": [{"idx": a, "label": 0 / 1}]}]}}`).

Rows are in `idx` order, one per test example. A prediction that is no
valid label (the postprocessor's -1) is written as the task's first label
(0.0 for STS-B), counted in `leaderboard_summary.json` and the log. The
servers also want files this project cannot produce from its tasks: WNLI
(neither paper trains it; HyperGrid copies T5's numbers: HyperGrid
Transformers, Table 5's footnote) and the
diagnostics AX / AX-b / AX-g, which are MNLI / RTE models' predictions on
other data: register them as tasks aliased to `glue_mnli` /
`super_glue_rte` (`tasks.add_task(..., alias_of=...)`) named `glue_ax`,
`super_glue_axb`, `super_glue_axg` and they are written too; the summary
lists what is missing.

  python -m hyperprompt_jax.leaderboard --gin_file=runs/quickstart_leaderboard.gin

Macros: CHECKPOINT_PATH (one checkpoint_<step>), LEADERBOARD_OUTPUT_DIR,
MIXTURE_OR_TASK_NAME, TASK_FEATURE_LENGTHS, LEADERBOARD_BATCH_SIZE.
"""

from typing import Optional, Sequence

from hyperprompt_jax.common import gin_utils


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = gin_utils.command_flags(
      'python -m hyperprompt_jax.leaderboard', __doc__, argv,
      add_flags=gin_utils.add_distributed_flags, tensorflow=True)
  from hyperprompt_jax.evaluation import submission_files  # pylint: disable=g-import-not-at-top
  return submission_files.run(args)


if __name__ == '__main__':
  gin_utils.run(main)
