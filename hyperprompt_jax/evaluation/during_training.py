"""Evaluation during training (t5x's `eval_period`).

The built-in runner decodes the validation sets of the run's tasks every
EVAL_PERIOD steps and at the last step with `eval`'s predictor, seqio
evaluator and scores, so with every example a step's scores are those
`python -m hyperprompt_jax.eval` writes for its checkpoint. Process 0
writes seqio's `MODEL_DIR/inference_eval/<task>-metrics.jsonl` (as t5x's
train does), `MODEL_DIR/eval_during_training.jsonl` (a line per evaluation)
and TensorBoard scalars. The checkpoint that scores best by KEEP_BEST_BY is
kept beside the last KEEP_CHECKPOINTS (`KeepBest`). Files and macros:
docs/operations.md, "Evaluation during training".
"""

import json
import logging
import math
import os
import time
from typing import Any, Mapping, Optional

import jax
import seqio
import tensorflow as tf
from orbax.checkpoint import checkpoint_managers

from hyperprompt_jax import files
from hyperprompt_jax.common import input_pipeline
from hyperprompt_jax.common import multihost
from hyperprompt_jax.evaluation import eval_summary
from hyperprompt_jax.evaluation import evaluator
from hyperprompt_jax.evaluation import predictor as predictor_lib
from hyperprompt_jax.model import network
from hyperprompt_jax.runner import training_loop
from hyperprompt_jax.tasks import feature_converter
from hyperprompt_jax.tasks import task_ids

log = logging.getLogger('hyperprompt_jax.train')

SCORES_FILE = 'eval_during_training.jsonl'
SPLIT = 'validation'
AVERAGE = 'average'  # every evaluated task's mean (eval's 'all')


def average_names() -> dict[str, str]:
  """KEEP_BEST_BY's averages: `{'glue_average': 'glue', ...}`."""
  names = {f'{b}_average': b for b in task_ids.BENCHMARKS}
  names[AVERAGE] = 'all'
  return names


def check_settings(eval_period, examples_per_task, keep_best_by,
                   batch_size) -> None:
  """Raises ValueError, naming the macro and a fix, on an unusable setting.

  KEEP_BEST_BY's name is checked against the run's tasks by `check_tasks`.
  """
  # Correlation metrics (STS-B's Pearson, Spearman) need two examples.
  for macro, value, minimum in (('EVAL_PERIOD', eval_period, 1),
                                ('EVAL_EXAMPLES_PER_TASK', examples_per_task,
                                 2)):
    if value is not None and (isinstance(value, bool)
                              or not isinstance(value, int)
                              or value < minimum):
      raise ValueError(
          f'{macro} must be None ({"off" if minimum == 1 else "every example"}'
          f') or an integer >= {minimum}, got {value!r}: e.g. '
          f'--gin.{macro}=100.')
  if (isinstance(batch_size, bool) or not isinstance(batch_size, int)
      or batch_size < 1):
    raise ValueError(f'EVAL_BATCH_SIZE must be an integer >= 1, got '
                     f'{batch_size!r}.')
  if keep_best_by is not None:
    if not isinstance(keep_best_by, str) or not keep_best_by:
      raise ValueError(f'KEEP_BEST_BY must be None or a quoted name, got '
                       f"{keep_best_by!r}: e.g. --gin.KEEP_BEST_BY="
                       "\"'glue_average'\".")
    if eval_period is None:
      raise ValueError(
          f'KEEP_BEST_BY={keep_best_by!r} needs scores: set EVAL_PERIOD '
          '(e.g. to SAVE_PERIOD), or KEEP_BEST_BY = None.')


def _best_score(summary: Mapping[str, Any], keep_best_by: str
                ) -> Optional[float]:
  """The score KEEP_BEST_BY reads in one evaluation's summary."""
  averages = average_names()
  if keep_best_by in averages:
    benchmark = averages[keep_best_by]
    value = (summary['mean_score'] if benchmark == 'all'
             else summary['averages'].get(benchmark))
  else:
    value = summary['task_scores'].get(keep_best_by)
  return value if value is not None and math.isfinite(value) else None


def check_tasks(mixture_or_task_name: str,
                keep_best_by: Optional[str]) -> None:
  """Raises ValueError on nothing to evaluate, or KEEP_BEST_BY unscored."""
  tasks = input_pipeline.eval_tasks(mixture_or_task_name, SPLIT)
  if keep_best_by is None:
    return
  covered = {task_ids.canonical_task(t.name) for t in tasks}
  averages = {name for name, b in average_names().items()
              if b == 'all' or all(t in covered
                                   for t in task_ids.BENCHMARKS[b])}
  if keep_best_by not in covered | averages:
    raise ValueError(
        f'KEEP_BEST_BY={keep_best_by!r} is neither a task evaluated in '
        f'this run {sorted(covered)} nor an average it has '
        f'{sorted(averages)}: name one of them.')


class KeepBest(checkpoint_managers.PreservationPolicy):
  """orbax preservation policy keeping the checkpoint of `best_step()`."""

  def __init__(self, best_step):
    self._best_step = best_step

  def should_preserve(self, checkpoints, *, context):
    """Marks the best step's checkpoint."""
    del context
    best = self._best_step()
    return [info.step == best for info in checkpoints]


class TrainingEvaluator:
  """Scores the run's validation sets for `train`.

  Args:
    model: the network.
    mixture_or_task_name: the run's mixture: its tasks with a validation
      split and metrics are scored.
    task_feature_lengths: {'inputs': L_in, 'targets': L_out}; the targets'
      length is the most tokens decoded.
    mesh: the run's device mesh.
    model_dir: where the scores are written (process 0).
    batch_size: examples per decode call (EVAL_BATCH_SIZE, as `eval`).
    examples_per_task: the first this many examples of each task (None:
      all; then the scores equal `eval`'s of the same checkpoint).
    keep_best_by: a task or average name (None: no best tracked).
    use_cached_tasks: read seqio's offline cache.

  The mixture and KEEP_BEST_BY are the caller's to check first
  (`check_tasks`: `train` does, before it locks MODEL_DIR).
  """

  def __init__(self, model: network.Transformer, mixture_or_task_name: str,
               task_feature_lengths: Mapping[str, int],
               mesh: jax.sharding.Mesh, model_dir: str, batch_size: int = 64,
               examples_per_task: Optional[int] = None,
               keep_best_by: Optional[str] = None,
               use_cached_tasks: bool = False):
    self.keep_best_by = keep_best_by
    self.examples_per_task = examples_per_task
    self.path = os.path.join(model_dir, SCORES_FILE)
    self.predictor, _ = predictor_lib.make_predictor(
        model, task_feature_lengths, mesh, batch_size)
    # Every process scores the same predictions; process 0 writes them.
    metrics_dir = None
    if multihost.is_writer():
      metrics_dir = os.path.join(model_dir, evaluator.METRICS_SUBDIR)
      tf.io.gfile.makedirs(metrics_dir)
    self.evaluator = seqio.Evaluator(
        mixture_or_task_name,
        feature_converter=feature_converter.TaskIdsEncDecFeatureConverter(
            pack=False),
        eval_split=SPLIT, use_cached=use_cached_tasks,
        sequence_length=dict(task_feature_lengths),
        num_examples=examples_per_task,
        # seqio's metric lines only (no predictions), as `eval` writes them.
        logger_cls=([evaluator.json_logger_cls(0)] if metrics_dir else []),
        log_dir=metrics_dir, async_compute_metrics=False)
    self.scores: dict[int, dict[str, Any]] = {}  # step -> its line

  # -- the record of earlier evaluations -------------------------------------

  def resume(self, start: int) -> None:
    """Reads the scores of evaluations up to `start`, for a resumed run.

    Later steps' lines (their checkpoints are gone) are dropped from the
    file and from seqio's metric files.
    """
    lines = []
    if tf.io.gfile.exists(self.path):
      with tf.io.gfile.GFile(self.path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    self.scores = {line['step']: line for line in lines
                   if line['step'] <= start}
    later = sorted({line['step'] for line in lines} - set(self.scores))
    if later and multihost.is_writer():
      self._write_all()
      metrics_dir = os.path.join(os.path.dirname(self.path),
                                 evaluator.METRICS_SUBDIR)
      for task in self.evaluator.eval_tasks:
        for step in later:
          evaluator.drop_step(
              os.path.join(metrics_dir, f'{task.name}-metrics.jsonl'), step)

  def evaluated(self, step: int) -> bool:
    """Whether `step` was evaluated."""
    return step in self.scores

  def best(self) -> Optional[dict[str, Any]]:
    """{'by', 'step', 'score'} of the best evaluation so far, or None."""
    if self.keep_best_by is None:
      return None
    best, scores = None, self.scores
    for step in sorted(scores):
      score = _best_score(scores[step], self.keep_best_by)
      if score is not None and (best is None or score > best['score']):
        best = {'by': self.keep_best_by, 'step': step, 'score': score}
    return best

  def best_step(self) -> Optional[int]:
    """The best evaluation's step, or None."""
    best = self.best()
    return best and best['step']

  # -- evaluating --------------------------------------------------------------

  def evaluate(self, step: int, params: Any) -> dict[str, Any]:
    """Scores `params` at `step`.

    Args:
      step: the train step.
      params: the train state's parameters, on the mesh.

    Returns:
      The line written to the scores file: `eval_summary.step_summary` with
      the step, the examples per task, the seconds and the best so far.
    """
    tick = time.time()
    self.predictor.set_params(params)
    try:
      metrics, _ = self.evaluator.evaluate(
          compute_metrics=True, step=step,
          predict_fn=self.predictor.predict_fn)
      results = metrics.result()
    finally:
      # The train step donates the state: hold no reference to it.
      self.predictor.params = None
    summary = eval_summary.step_summary(results)
    line = {'step': step, 'examples_per_task': self.examples_per_task,
            **summary, 'seconds': round(time.time() - tick, 3)}
    # A new dict, not an insertion: orbax reads `best_step` from the thread
    # that finishes an asynchronous save.
    self.scores = {**self.scores, step: line}
    line['best'] = self.best()
    if multihost.is_writer():
      self._write_all()
    return line

  def _write_all(self) -> None:
    """Rewrites the scores file whole (GCS cannot append)."""
    files.write_atomically(self.path, ''.join(
        json.dumps(self.scores[step]) + '\n' for step in sorted(self.scores)))

  def close(self) -> None:
    """Closes the seqio evaluator."""
    self.evaluator.close()


def scalars(line: Mapping[str, Any]) -> dict[str, float]:
  """TensorBoard scalars of one evaluation (`eval/<task>`, ...)."""
  out = {f'eval/{task}': score for task, score in line['task_scores'].items()}
  out.update({f'eval/{b}_average': v for b, v in line['averages'].items()})
  if math.isfinite(line['mean_score']):
    out[f'eval/{AVERAGE}'] = line['mean_score']
  for task, metrics in line['metrics'].items():
    out.update({f'eval/{task}/{k}': v for k, v in metrics.items()})
  out['eval/seconds'] = line['seconds']
  return out


def progress(line: Mapping[str, Any]) -> str:
  """The log line of one evaluation."""
  parts = [f'{b} average {v:.2f}' for b, v in line['averages'].items()]
  if not parts:
    parts = [f'mean score {line["mean_score"]:.2f}']
  best = line.get('best')
  if best:
    parts.append(f'best {best["by"]} {best["score"]:.2f} at step '
                 f'{best["step"]}')
  return (f'eval at step {line["step"]}: {len(line["task_scores"])} tasks, '
          + ', '.join(parts) + f' ({line["seconds"]:.1f}s)')


# What the train command hands the built-in runner's step loop.
EVALUATION = training_loop.Evaluation(
    check_settings=check_settings, check_tasks=check_tasks,
    evaluator=TrainingEvaluator, keep_best=KeepBest, scalars=scalars,
    progress=progress)
