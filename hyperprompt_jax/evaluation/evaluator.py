"""Evaluation of checkpoints by each paper's protocol.

`evaluate` scores every checkpoint of one or more runs with seqio's
evaluator and writes the summaries (`eval_summary`); `summarize_metrics_dir`
does the same from t5x's metrics files. The command is
`python -m hyperprompt_jax.eval` (docs/evaluation.md).
"""

import argparse
import collections
import dataclasses
import json
import logging
import math
import os
import time
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

import gin
import scipy.stats
import seqio
import tensorflow as tf

from hyperprompt_jax import files
from hyperprompt_jax import paths
from hyperprompt_jax.checkpointing import checkpoints
from hyperprompt_jax.checkpointing import run_record
from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.common import input_pipeline
from hyperprompt_jax.common import multihost
from hyperprompt_jax.evaluation import checkpoint_job
from hyperprompt_jax.evaluation import eval_summary
from hyperprompt_jax.evaluation import paper_results
from hyperprompt_jax.evaluation import predictor as predictor_lib
from hyperprompt_jax.evaluation import run_config
from hyperprompt_jax.model import network
from hyperprompt_jax.tasks import feature_converter
from hyperprompt_jax.tasks import scores
from hyperprompt_jax.tasks import task_ids

log = logging.getLogger('hyperprompt_jax.eval')
METRICS_SUBDIR = 'inference_eval'  # where t5x's evaluator logs, too


def _targets(task: seqio.Task, dataset: tf.data.Dataset) -> list[Any]:
  """The postprocessed targets of an evaluation dataset (as seqio scores)."""
  out = []
  for example in dataset.as_numpy_iterator():
    text = example['targets_pretokenized']
    text = text.decode('utf-8') if isinstance(text, bytes) else text
    out.append(task.postprocess_fn(text, example=example, is_target=True))
  return out


def _unlabelled(targets: Sequence[Any]) -> bool:
  """Whether no target has a label (-1, or ReCoRD's no answer)."""
  def missing(t):
    t = t['value'] if isinstance(t, Mapping) else t
    return (isinstance(t, (list, tuple)) and not t) or (
        isinstance(t, (int, float)) and t == -1)
  return all(missing(t) for t in targets)


def check_labelled(evaluator: seqio.Evaluator, split: str
                   ) -> dict[str, list[Any]]:
  """Each task's postprocessed targets of `split`.

  Args:
    evaluator: seqio's evaluator of the mixture.
    split: its split, for the message.

  Returns:
    `{task: targets}`.

  Raises:
    ValueError: naming the tasks whose split has no labels (GLUE and
      SuperGLUE test splits), which would fail in the metrics or score noise.
  """
  targets = {task.name: _targets(task,
                                 evaluator.cached_task_datasets[task.name])
             for task in evaluator.eval_tasks}
  blank = sorted(name for name, t in targets.items() if t and _unlabelled(t))
  if blank:
    raise ValueError(
        f'The {split!r} split of {", ".join(blank)} has no labels (the GLUE '
        'and SuperGLUE test labels are hidden): score it on the benchmark '
        'servers with the files of `python -m hyperprompt_jax.leaderboard`, '
        "or evaluate EVAL_SPLIT='validation'.")
  return targets


def _majority_values(targets: Sequence[Any]) -> list[Any]:
  """The most frequent target value(s), all on ties (dicts: their `value`)."""
  def values(t):
    if isinstance(t, Mapping):
      t = t['value']
    return t if isinstance(t, (list, tuple)) else [t]
  counts = collections.Counter(
      v.decode() if isinstance(v, bytes) else v
      for t in targets for v in values(t))
  top = max(counts.values())
  tied = [v for v, c in counts.items() if c == top]
  return ([{'value': v} for v in tied] if isinstance(targets[0], Mapping)
          else tied)


def majority_score(task: seqio.Task, targets: Sequence[Any]) -> float:
  """The majority-class baseline's task score (on a tie, the higher)."""
  best = -math.inf
  for prediction in _majority_values(targets):
    metrics = {}
    with warnings.catch_warnings():
      # A constant prediction has no correlation (STS-B): NaN, scored 0.
      warnings.simplefilter('ignore', scipy.stats.ConstantInputWarning)
      for fn in task.predict_metric_fns:
        metrics.update(fn(list(targets), [prediction] * len(targets)))
    best = max(best, scores.task_score(
        {k: v if math.isfinite(v) else 0.0 for k, v in metrics.items()}))
  return best


def run_names(paths: Sequence[str]) -> list[str]:
  """A short name per run directory: its folder's, or `run<i>` on a clash."""
  names = []
  for path in paths:
    parts = [p for p in path.rstrip('/').split('/') if p]
    if len(parts) > 1 and parts[-1] == METRICS_SUBDIR:
      parts = parts[:-1]
    names.append(parts[-1] if parts else path)
  if len(set(names)) < len(names):
    names = [f'run{i}' for i in range(len(paths))]
  return names


def _as_paths(checkpoint_path: Union[str, Sequence[str]]) -> list[str]:
  """One path or a list of them, as a list."""
  paths_ = ([checkpoint_path] if isinstance(checkpoint_path, str)
            else list(checkpoint_path))
  if not paths_ or not all(isinstance(p, str) and p for p in paths_):
    raise ValueError(
        f'CHECKPOINT_PATH={checkpoint_path!r}: give a path, or a list of run '
        "directories: --gin.CHECKPOINT_PATH=\"['/runs/seed0', '/runs/seed1']\"")
  return paths_


def _check_selection_covered(selection: str, benchmark: str,
                             tasks: Sequence[seqio.Task]) -> None:
  """Refuses 'best_average' over a benchmark the mixture does not cover."""
  eval_summary.check_selection(selection, benchmark)
  if selection != 'best_average' or benchmark == 'all':
    return
  covered = {task_ids.canonical_task(t.name) for t in tasks}
  missing = [t for t in task_ids.BENCHMARKS[benchmark] if t not in covered]
  if missing:
    raise ValueError(
        f"SELECTION='best_average' with SELECTION_BENCHMARK={benchmark!r} "
        f'needs every task of {benchmark!r}; the mixture lacks {missing}. '
        "Set SELECTION_BENCHMARK to one the mixture covers, or 'all'.")


@gin.configurable(denylist=['model'])
def evaluate(
    model: Optional[network.Transformer] = None,
    *,
    job: checkpoint_job.CheckpointJob = gin.REQUIRED,
    majority_baseline: bool = False,
    selection: Optional[str] = None,
    selection_benchmark: Optional[str] = None,
    compare_to: Optional[str] = None,
    use_cached_tasks: bool = False,
    write_n_results: Optional[int] = None,
) -> dict[str, Any]:
  """Evaluates the checkpoint(s) of `job` on every task of its mixture.

  Args:
    model: the network; None builds `network.Transformer` from gin.
    job: the checkpoints, data, output directory and mesh. Its
      `checkpoint_path` is a `checkpoint_<step>` folder or a folder of them;
      or a list of such folders, runs (seeds) of one setup: each is
      evaluated into `output_dir/<run>/` and the runs are aggregated. Its
      `output_dir` takes the metrics, summaries and the plot.
    majority_baseline: also score the majority-class baseline per task.
    selection: which checkpoint each task is read at: 'best_per_task',
      'best_average' or 'last' (`eval_summary.select`); None: the protocol
      the run records (`run_config`), else 'best_per_task'.
    selection_benchmark: the average 'best_average' picks by (None: the
      run's, else 'glue').
    compare_to: a paper setup (`paper_results`) to print and plot the
      selected scores (several runs: their means) beside.
    use_cached_tasks: read seqio's offline cache.
    write_n_results: predictions per task kept in seqio's inference files
      (None: all).

  Returns:
    The summary (`eval_summary.summarize`; for several runs,
    `eval_summary.runs_summary`).
  """
  run_paths = _as_paths(job.checkpoint_path)
  selection, selection_benchmark = dataclasses.astuple(
      run_config.resolve(selection, selection_benchmark, run_paths))
  eval_summary.check_selection(selection, selection_benchmark)
  if compare_to is not None:
    paper_results.get(compare_to)  # an unknown setup fails before the work
  found = {path: checkpoints.find_checkpoints(path) for path in run_paths}
  model = checkpoint_job.checked_model(model, job, 'EVAL_OUTPUT_DIR')
  tasks = input_pipeline.eval_tasks(job.mixture_or_task_name, job.split)
  _check_selection_covered(selection, selection_benchmark, tasks)
  predictor, abstract_params = predictor_lib.make_predictor(
      model, job.task_feature_lengths, job.mesh(), job.batch_size)
  names = run_names(run_paths)

  def make_evaluator(output_dir):
    # Every process scores the same predictions; process 0 writes them.
    metrics_dir = None
    if multihost.is_writer():
      metrics_dir = os.path.join(output_dir, METRICS_SUBDIR)
      tf.io.gfile.makedirs(metrics_dir)
    return seqio.Evaluator(
        job.mixture_or_task_name,
        feature_converter=feature_converter.TaskIdsEncDecFeatureConverter(
            pack=False),
        eval_split=job.split,
        use_cached=use_cached_tasks,
        sequence_length=dict(job.task_feature_lengths),
        logger_cls=([json_logger_cls(write_n_results)] if metrics_dir
                    else []),
        log_dir=metrics_dir,
        async_compute_metrics=False)

  summaries = {}
  majority = targets = None
  for name, path in zip(names, run_paths):
    output_dir = (job.output_dir if len(run_paths) == 1
                  else os.path.join(job.output_dir, name))
    evaluator = make_evaluator(output_dir)
    if targets is None:  # before any checkpoint is read
      targets = check_labelled(evaluator, job.split)
    if majority_baseline and majority is None:
      majority = _majority_scores(evaluator.eval_tasks, targets)
    log.info('Evaluating %d checkpoint(s) of %s on %d tasks (%s split).',
             len(found[path]), path, len(tasks), job.split)
    results, unreadable = _evaluate_checkpoints(
        found[path], path, predictor, abstract_params, evaluator)
    summary = eval_summary.summarize(results, majority, selection,
                                     selection_benchmark)
    if unreadable:
      summary['unreadable_checkpoints'] = unreadable
    if multihost.is_writer():
      written = eval_summary.write(summary, output_dir)
      print(eval_summary.table(summary))
      log.info('Wrote %s', ', '.join(written.values()))
    if unreadable:
      log.error('%d checkpoint(s) of %s could not be read and are missing '
                'from the summary: %s (listed in summary.json under '
                'unreadable_checkpoints).', len(unreadable), path,
                ', '.join(f'checkpoint_{s}' for s in unreadable))
    summaries[name] = summary
  return _finish(summaries, dict(zip(names, run_paths)), job.output_dir,
                 compare_to)


def _finish(summaries: Mapping[str, Mapping[str, Any]],
            run_paths: Mapping[str, str], output_dir: str,
            compare_to: Optional[str]) -> dict:
  """One run's summary or several runs' aggregate, and the paper's beside."""
  if len(summaries) == 1:
    summary = next(iter(summaries.values()))
  elif multihost.is_writer():
    summary = _write_runs(summaries, run_paths, output_dir)
  else:
    summary = eval_summary.runs_summary(summaries, run_paths)
  if compare_to is not None and multihost.is_writer():
    compare_with_paper(summary, compare_to, output_dir)
  return summary


def compare_with_paper(summary: Mapping[str, Any], setup: str,
                       output_dir: str) -> dict:
  """Prints and writes the selected scores beside a paper setup's.

  Args:
    summary: `evaluate`'s summary; several runs: their means.
    setup: a `paper_results` setup.
    output_dir: gets compare_to_paper.json and its plot.

  Returns:
    The comparison (`paper_results.compare`).
  """
  if 'aggregate' in summary:
    agg = summary['aggregate']
    scores_ = {t: v['mean'] for t, v in agg['tasks'].items()}
    averages = {b: v['mean'] for b, v in agg['averages'].items()}
  else:
    scores_ = {t: v['score'] for t, v in summary['selection']['tasks'].items()}
    averages = summary['selection']['averages']
  comparison = paper_results.compare(scores_, averages, setup)
  print(paper_results.compare_table(comparison))
  path = os.path.join(output_dir, 'compare_to_paper.json')
  files.write_atomically(path, json.dumps(comparison, indent=1))
  paper_results.plot_compare(
      comparison, os.path.join(output_dir, paper_results.PLOT_FILE))
  return comparison


def _write_runs(summaries: Mapping[str, Mapping[str, Any]],
                run_paths: Mapping[str, str], output_dir: str) -> dict:
  """The aggregate of several runs' summaries: written, printed, returned."""
  summary = eval_summary.runs_summary(summaries, run_paths)
  unreadable = {name: s['unreadable_checkpoints']
                for name, s in summaries.items()
                if s.get('unreadable_checkpoints')}
  if unreadable:
    summary['unreadable_checkpoints'] = unreadable
  written = eval_summary.write_runs(summary, output_dir)
  print(eval_summary.runs_table(summary))
  log.info('Wrote %s', ', '.join(written.values()))
  return summary


def _majority_scores(tasks: Sequence[seqio.Task],
                     targets: Mapping[str, Sequence[Any]]
                     ) -> dict[str, float]:
  """Each task's majority-class score, averaged as the model's are."""
  majority = {task.name: majority_score(task, targets[task.name])
              for task in tasks}
  return scores.task_scores({t: {'score': s} for t, s in majority.items()})


def _evaluate_checkpoints(found: Sequence[tuple[int, str]], run_path: str,
                          predictor: predictor_lib.Predictor, abstract_params,
                          evaluator: seqio.Evaluator):
  """`({step: results}, {step: error})`; unreadable checkpoints are skipped."""
  results, unreadable = {}, {}
  for step, path in found:
    tick = time.time()
    error = None
    # Whose parameters it holds: refused on every process alike (one
    # record).
    run_record.check_checkpoint(path, predictor.model.config,
                                task_ids.run_task_list())
    try:
      params, _ = checkpoints.restore_params(path, abstract_params)
    except checkpoints.CheckpointMismatchError:
      raise  # another model's checkpoint: every one would fail alike
    except Exception as e:  # pylint: disable=broad-except
      error = checkpoints.error_summary(e)
    # A damaged checkpoint (a save cut short, a truncated copy) is reported
    # and the others evaluated; skipped by every process if one cannot read
    # it.
    if not multihost.all_true(error is None):
      if multihost.all_true(not tf.io.gfile.exists(path)):
        # Not damaged: a training run beside this eval removed it (its
        # KEEP_CHECKPOINTS), as it may.
        log.warning('checkpoint_%d was deleted while eval ran (the training '
                    'run keeps only KEEP_CHECKPOINTS), skipped.', step)
        continue
      unreadable[str(step)] = error or 'another process could not read it'
      log.error('checkpoint_%d cannot be read, skipped (%s).', step,
                unreadable[str(step)])
      continue
    predictor.set_params(params)
    metrics, _ = evaluator.evaluate(compute_metrics=True, step=step,
                                    predict_fn=predictor.predict_fn)
    results[step] = metrics.result()
    log.info('checkpoint_%d evaluated in %.1fs.', step, time.time() - tick)
  evaluator.close()
  if not results:
    raise ValueError(
        f'None of the {len(found)} checkpoint(s) in {run_path} can be read: '
        + '; '.join(f'checkpoint_{s}: {e}' for s, e in unreadable.items()))
  return results, unreadable


def json_logger_cls(write_n_results: Optional[int]):
  """seqio's JSONLogger keeping `write_n_results` predictions per task.

  A step evaluated again replaces its line of `<task>-metrics.jsonl`, where
  seqio would append a second.
  """

  class JSONLogger(seqio.JSONLogger):

    def __init__(self, output_dir):
      super().__init__(output_dir, write_n_results=write_n_results)

    def __call__(self, task_name, step, metrics, *args, **kwargs):
      if metrics:  # seqio writes a metrics line only then
        drop_step(os.path.join(self.output_dir,
                                f'{task_name}-metrics.jsonl'),
                   -1 if step is None else step)  # seqio's step for None
      super().__call__(task_name, step, metrics, *args, **kwargs)

  return JSONLogger


def drop_step(metrics_file: str, step: int) -> None:
  """Removes the lines of `step` from a JSON-lines metrics file."""
  if not tf.io.gfile.exists(metrics_file):
    return
  with tf.io.gfile.GFile(metrics_file) as f:
    lines = f.read().splitlines(keepends=True)
  kept = [line for line in lines if _line_step(line) != step]
  if len(kept) == len(lines):
    return
  # Rewritten whole, as seqio writes it (GCS cannot append).
  files.write_atomically(metrics_file, ''.join(kept))


def _line_step(line: str) -> Optional[int]:
  """The "step" of a metrics line; None for other lines."""
  try:
    record = json.loads(line)
  except ValueError:
    return None  # not a metrics line: kept
  return record.get('step') if isinstance(record, dict) else None


def summarize_metrics_dir(metrics_dirs: Union[str, Sequence[str]],
                          output_dir: str, selection: Optional[str] = None,
                          selection_benchmark: Optional[str] = None,
                          compare_to: Optional[str] = None) -> dict:
  """Summarises t5x's evaluation output (`--metrics_dir`).

  Args:
    metrics_dirs: t5x's `inference_eval` directory, or one per run; the run
      is the one t5x's eval config there names.
    output_dir: gets the summaries; several runs: each in
      `output_dir/<run>/`, and their aggregate.
    selection: as `evaluate`'s.
    selection_benchmark: as `evaluate`'s.
    compare_to: as `evaluate`'s.

  Returns:
    The summary, or several runs' aggregate.
  """
  metrics_dirs = _as_paths(metrics_dirs)
  selection, selection_benchmark = dataclasses.astuple(run_config.resolve(
      selection, selection_benchmark,
      [run_config.evaluated_run(d) for d in metrics_dirs]))
  eval_summary.check_selection(selection, selection_benchmark)
  if compare_to is not None:
    paper_results.get(compare_to)
  paths.check_writable_dir(output_dir, '--output_dir')
  read = {name: eval_summary.read_metrics_dir(d)
          for name, d in zip(run_names(metrics_dirs), metrics_dirs)}
  summaries = {}
  for name, results in read.items():
    summary = eval_summary.summarize(results, None, selection,
                                     selection_benchmark)
    written = eval_summary.write(
        summary, output_dir if len(read) == 1
        else os.path.join(output_dir, name))
    print(eval_summary.table(summary))
    log.info('Wrote %s', ', '.join(written.values()))
    summaries[name] = summary
  return _finish(summaries, dict(zip(read, metrics_dirs)), output_dir,
                 compare_to)


def run(args: argparse.Namespace) -> int:
  """`python -m hyperprompt_jax.eval` with its parsed flags."""
  if args.metrics_dir:
    gin_utils.log_to_stdout(log)
    if len(args.metrics_dir) > 1 and not args.output_dir:
      raise ValueError('Several --metrics_dir need an --output_dir for '
                       'their aggregate.')
    summarize_metrics_dir(args.metrics_dir,
                          args.output_dir or args.metrics_dir[0],
                          args.selection, args.selection_benchmark,
                          args.compare_to)
    return 0
  checkpoint_job.configure(args, log)
  summary = evaluate()
  # Non-zero when a checkpoint was skipped, so scripts notice.
  return 1 if summary.get('unreadable_checkpoints') else 0

