"""Evaluation summaries: per step, best checkpoint per task, plot and table.

One summary for both runners: `python -m hyperprompt_jax.eval` builds it
from its own evaluation, and from t5x's evaluation output (seqio's
`JSONLogger` files `<task>-metrics.jsonl`, one line
`{"step": N, "<metric>": value, ...}` per evaluation) with `--metrics_dir`.

Scores follow the papers (T5's convention, `tasks.scores`): a task's score is
the mean of its metrics, tasks sharing an id are one task (MNLI matched /
mismatched averaged, fixture tasks scored as their benchmark task), and a
benchmark's average is the mean of its task scores. The papers report the
best checkpoint per task; the best single checkpoint is the one with the
highest mean task score.

Files written to the output directory:

  summary.json       {"steps": {"<step>": {"metrics": {seqio task: {metric:
                     value}}, "task_scores": {task: score}, "averages":
                     {benchmark: average}, "mean_score": m}}, "majority":
                     {task: score} (if computed)}
  best_per_task.json {"tasks": {task: {"step": s, "score": x}},
                     "averages": {benchmark: average of the best scores},
                     "best_checkpoint": {"step": s, "mean_score": m,
                     "averages": {...}, "task_scores": {...}}}
  task_scores.png    task scores against steps
"""

import json
import math
import os
import re
from typing import Any, Mapping, Optional

from hyperprompt_jax.tasks import scores
from hyperprompt_jax.tasks import task_ids

# {step: {seqio task: {metric: value}}}
StepResults = Mapping[int, Mapping[str, Mapping[str, float]]]

SUMMARY_FILE = 'summary.json'
BEST_FILE = 'best_per_task.json'
PLOT_FILE = 'task_scores.png'
_METRICS_FILE = re.compile(r'^(?P<task>.+)-metrics\.jsonl$')


def _finite(value: float) -> float:
  # A metric of a constant prediction can be NaN (Pearson, Spearman); it
  # carries no information and scores 0, as the majority baseline does.
  value = float(value)
  return value if math.isfinite(value) else 0.0


def _averages(task_scores: Mapping[str, float]) -> dict[str, float]:
  """The averages of every benchmark whose tasks were all evaluated."""
  return {name: scores.average(task_scores, tasks)
          for name, tasks in task_ids.BENCHMARKS.items()
          if all(t in task_scores for t in tasks)}


def step_summary(results: Mapping[str, Mapping[str, float]]) -> dict:
  """One evaluation: metrics, task scores, benchmark averages."""
  metrics = {task: {k: _finite(v) for k, v in m.items()}
             for task, m in sorted(results.items()) if m}
  task_scores = scores.task_scores(metrics)
  return {
      'metrics': metrics,
      'task_scores': task_scores,
      'averages': _averages(task_scores),
      'mean_score': (sum(task_scores.values()) / len(task_scores)
                     if task_scores else float('nan')),
  }


def summarize(results: StepResults,
              majority: Optional[Mapping[str, float]] = None) -> dict:
  """The summary over steps (see the module docstring for its layout)."""
  if not results:
    raise ValueError('No evaluation results to summarise.')
  summary: dict[str, Any] = {
      'steps': {str(step): step_summary(results[step])
                for step in sorted(results)}}
  if majority is not None:
    summary['majority'] = dict(majority)
  return summary


def best_per_task(summary: Mapping[str, Any]) -> dict:
  """The best step of each task (earliest on ties), the averages of those
  best scores, and the best single checkpoint (highest mean task score)."""
  steps = sorted(summary['steps'], key=int)
  best: dict[str, dict[str, Any]] = {}
  for step in steps:
    for task, score in summary['steps'][step]['task_scores'].items():
      if task not in best or score > best[task]['score']:
        best[task] = {'step': int(step), 'score': score}
  best_scores = {task: b['score'] for task, b in best.items()}
  top = max(steps, key=lambda s: (summary['steps'][s]['mean_score'], -int(s)))
  top_summary = summary['steps'][top]
  return {
      'tasks': dict(sorted(best.items())),
      'averages': _averages(best_scores),
      'best_checkpoint': {'step': int(top),
                          'mean_score': top_summary['mean_score'],
                          'averages': top_summary['averages'],
                          'task_scores': top_summary['task_scores']},
  }


# -- t5x's evaluation output -------------------------------------------------


def read_metrics_dir(metrics_dir: str) -> dict[int, dict[str, dict]]:
  """Reads seqio `JSONLogger` files (`<task>-metrics.jsonl`) into
  `{step: {task: {metric: value}}}`.

  `metrics_dir` is the folder holding them, or the EVAL_OUTPUT_DIR / MODEL_DIR
  above its `inference_eval/`. A later line for the same step replaces an
  earlier one (a re-evaluation). Non-numeric values (text metrics) are
  skipped.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  nested = os.path.join(metrics_dir, 'inference_eval')
  if tf.io.gfile.isdir(nested):
    metrics_dir = nested
  if not tf.io.gfile.isdir(metrics_dir):
    raise FileNotFoundError(
        f'No metrics directory at {metrics_dir!r}: give the folder holding '
        "t5x's <task>-metrics.jsonl files (t5x writes them to "
        '<EVAL_OUTPUT_DIR>/inference_eval, or <MODEL_DIR>/inference_eval for '
        'evaluation during training).')
  results: dict[int, dict[str, dict]] = {}
  names = sorted(tf.io.gfile.listdir(metrics_dir))
  for name in names:
    match = _METRICS_FILE.match(name)
    if not match:
      continue
    with tf.io.gfile.GFile(os.path.join(metrics_dir, name)) as f:
      for line_number, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f'{name}:{line_number} is not JSON ({e}).') from None
        if 'step' not in record:
          raise ValueError(f'{name}:{line_number} has no "step" key.')
        step = int(record.pop('step'))
        results.setdefault(step, {})[match['task']] = {
            k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
  if not results:
    raise FileNotFoundError(
        f'{metrics_dir!r} holds no <task>-metrics.jsonl files (found '
        f'{names[:5]}{" ..." if len(names) > 5 else ""}).')
  return results


# -- outputs -------------------------------------------------------------------


def write(summary: Mapping[str, Any], output_dir: str) -> dict[str, str]:
  """Writes summary.json, best_per_task.json and the plot; returns their
  paths."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  tf.io.gfile.makedirs(output_dir)
  paths = {'summary': os.path.join(output_dir, SUMMARY_FILE),
           'best_per_task': os.path.join(output_dir, BEST_FILE),
           'plot': os.path.join(output_dir, PLOT_FILE)}
  for key, content in (('summary', summary),
                       ('best_per_task', best_per_task(summary))):
    # Written whole and renamed, so a reader never sees half a file.
    with tf.io.gfile.GFile(paths[key] + '.tmp', 'w') as f:
      json.dump(content, f, indent=1, sort_keys=True)
    tf.io.gfile.rename(paths[key] + '.tmp', paths[key], overwrite=True)
  plot(summary, paths['plot'])
  return paths


def plot(summary: Mapping[str, Any], path: str) -> None:
  """Task scores (and benchmark averages, dashed) against steps, as PNG."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  steps = sorted(summary['steps'], key=int)
  x = [int(s) for s in steps]
  tasks = sorted({t for s in steps for t in summary['steps'][s]['task_scores']})
  benchmarks = sorted({b for s in steps for b in summary['steps'][s]['averages']})
  fig, ax = plt.subplots(figsize=(10, 6))
  # 20 distinct colours for up to 20 tasks (the default cycle repeats at 10).
  colours = plt.get_cmap('tab20').colors
  for i, task in enumerate(tasks):
    y = [summary['steps'][s]['task_scores'].get(task, math.nan) for s in steps]
    ax.plot(x, y, marker='o', markersize=3, linewidth=1, label=task,
            color=colours[i % len(colours)],
            linestyle='-' if i < len(colours) else ':')
  for name, colour in zip(benchmarks, ('black', 'dimgray', 'darkred')):
    y = [summary['steps'][s]['averages'].get(name, math.nan) for s in steps]
    ax.plot(x, y, linestyle='--', linewidth=2.5, color=colour,
            label=f'{name} average')
  ax.set_xlabel('step')
  ax.set_ylabel('task score')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2, loc='center left', bbox_to_anchor=(1, 0.5))
  fig.tight_layout()
  with tf.io.gfile.GFile(path, 'wb') as f:
    fig.savefig(f, format='png', dpi=100)
  plt.close(fig)


def table(summary: Mapping[str, Any]) -> str:
  """A plain-text table: each task's score at the best single checkpoint and
  its best score over checkpoints (with the step), the majority-class score
  when known, then the benchmark averages."""
  best = best_per_task(summary)
  top = best['best_checkpoint']
  majority = summary.get('majority') or {}
  many = len(summary['steps']) > 1
  order = {t: i for i, t in enumerate(task_ids.BENCHMARKS['glue_super_glue'])}
  tasks = sorted(best['tasks'], key=lambda t: (order.get(t, len(order)), t))
  header = ['task', f'step {top["step"]}']
  if many:
    header += ['best', 'best step']
  if majority:
    header += ['majority', 'gain']
  rows = []
  for task in tasks:
    score = top['task_scores'].get(task, math.nan)
    row = [task, f'{score:.2f}']
    if many:
      row += [f'{best["tasks"][task]["score"]:.2f}',
              str(best['tasks'][task]['step'])]
    if majority:
      base = majority.get(task)
      row += (['-', '-'] if base is None
              else [f'{base:.2f}', f'{score - base:+.2f}'])
    rows.append(row)
  for name in task_ids.BENCHMARKS:
    if name in top['averages']:
      row = [f'{name} average', f'{top["averages"][name]:.2f}']
      if many:
        row += [f'{best["averages"][name]:.2f}', '']
      if majority:
        row += ['', '']
      rows.append(row)
  widths = [max(len(r[i]) for r in [header] + rows)
            for i in range(len(header))]
  lines = ['  '.join(c.ljust(w) if i == 0 else c.rjust(w)
                     for i, (c, w) in enumerate(zip(r, widths)))
           for r in [header] + rows]
  lines.insert(1, '-' * len(lines[0]))
  return '\n'.join(lines)
