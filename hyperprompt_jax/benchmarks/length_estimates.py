"""Estimated example lengths of T5's proportional GLUE + SuperGLUE mixture,
for benchmarks whose rows should look like training's without the data
(`packing_benchmark`'s 'glue_super_glue' stream, `mfu`'s synthetic rows).
Light (numpy only): the MFU benchmark runs without TensorFlow or seqio.

The mixture's rates are the training-set sizes (`tasks/glue.py`,
`tasks/super_glue.py`: their task modules need TensorFlow, so the sizes
are written here too and tests/test_benchmark.py holds them equal). Input
lengths are drawn from a log-normal (sigma `LENGTH_SIGMA`, an assumption)
around per-task means that are estimates, not measurements of tokenised
data (no GLUE data or SentencePiece model is available offline): each
task's mean characters per training example (the TFDS / Hugging Face
`dataset_infos.json` train `num_bytes` / `num_examples`, less ~30 bytes of
labels and ids) at ~4.3 characters per SentencePiece piece, plus T5's
field prefixes and EOS; targets are the label words' pieces plus EOS.
"""

import numpy as np

# Task -> (training examples, mean input pieces, target pieces).
GLUE_SUPER_GLUE = {
    'glue_cola': (8551, 14, 3), 'glue_sst2': (67349, 18, 2),
    'glue_mrpc': (3668, 64, 4), 'glue_stsb': (5749, 37, 4),
    'glue_qqp': (363846, 37, 4), 'glue_mnli': (392702, 48, 4),
    'glue_qnli': (104743, 60, 5), 'glue_rte': (2490, 84, 5),
    'super_glue_boolq': (9427, 156, 2), 'super_glue_cb': (250, 84, 4),
    'super_glue_copa': (400, 35, 2), 'super_glue_multirc': (27243, 397, 2),
    'super_glue_record': (138854, 300, 5), 'super_glue_rte': (2490, 84, 5),
    'super_glue_wic': (5428, 30, 2), 'super_glue_wsc': (0, 33, 4),
}
LENGTH_SIGMA = 0.5  # the log-normal spread of input lengths


def sample_glue_super_glue(rng: np.random.Generator, count: int
                           ) -> list[tuple[int, int, int]]:
  """`count` examples' `(input length, target length, task index)` drawn
  from the proportional mixture (the index into `GLUE_SUPER_GLUE`)."""
  names = list(GLUE_SUPER_GLUE)
  rates = np.array([GLUE_SUPER_GLUE[n][0] for n in names], np.float64)
  out = []
  for task in rng.choice(len(names), size=count, p=rates / rates.sum()):
    _, mean, target = GLUE_SUPER_GLUE[names[task]]
    # A log-normal with this mean: mu = log(mean) - sigma^2 / 2.
    length = rng.lognormal(np.log(mean) - LENGTH_SIGMA**2 / 2, LENGTH_SIGMA)
    out.append((max(2, int(round(length))), target, int(task)))
  return out
