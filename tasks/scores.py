"""Task scores and benchmark averages, the papers' way (T5's convention).

A task's score is the mean of its metrics (MRPC: mean of F1 and accuracy);
tasks that share an id are one task (MNLI = mean of the matched and mismatched
scores; WSC's training variants); a benchmark's average is the mean of its
tasks' scores. Example, HyperPrompt Table 8, MTL: (49.8 + 94.6 + (92.5+89.8)/2
+ (90.7+90.5)/2 + (89.2+91.9)/2 + (88.8+88.5)/2 + 93.3 + 85.0) / 8 = 85.46.
"""

from typing import Mapping, Sequence

import numpy as np

from hyperprompt_jax.tasks import task_ids

Results = Mapping[str, Mapping[str, float]]  # seqio task -> metric -> value


def task_score(metrics: Mapping[str, float]) -> float:
  """The mean of one evaluated task's metrics."""
  if not metrics:
    raise ValueError('a task with no metrics has no score')
  return float(np.mean([float(v) for v in metrics.values()]))


def task_scores(results: Results) -> dict[str, float]:
  """seqio results -> {canonical task: score}, tasks sharing an id averaged."""
  grouped: dict[str, list[float]] = {}
  for name, metrics in results.items():
    if not metrics:
      continue  # Tasks without metrics (test splits) are not scored.
    grouped.setdefault(task_ids.canonical_task(name), []).append(
        task_score(metrics))
  return {name: float(np.mean(s)) for name, s in grouped.items()}


def benchmark_average(results: Results, benchmark: str = 'glue') -> float:
  """The average of a benchmark's task scores.

  Args:
    results: seqio results holding every task of the benchmark.
    benchmark: 'glue', 'super_glue' or 'glue_super_glue'.

  Returns:
    The mean of its task scores.
  """
  if benchmark not in task_ids.BENCHMARKS:
    raise ValueError(f'benchmark={benchmark!r}; expected one of '
                     f'{sorted(task_ids.BENCHMARKS)}')
  return average(task_scores(results), task_ids.BENCHMARKS[benchmark])


def average(scores: Mapping[str, float], tasks: Sequence[str]) -> float:
  """The mean score of `tasks`, each of which must have one."""
  missing = [t for t in tasks if t not in scores]
  if missing:
    raise ValueError(f'no score for {missing}; the average needs every task '
                     f'of {list(tasks)}')
  return float(np.mean([scores[t] for t in tasks]))
