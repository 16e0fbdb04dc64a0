"""Evaluation summaries: per step, the checkpoint selection, runs over seeds.

One summary for both runners: `python -m hyperprompt_jax.eval` builds it
from its own evaluation, or with `--metrics_dir` from t5x's (seqio's
`<task>-metrics.jsonl`, one line `{"step": N, "<metric>": value}` each).

Scores follow T5 (`tasks.scores`): a task's score is the mean of its
metrics, tasks sharing an id are one task, and a benchmark's average is the
mean of its task scores. Which checkpoint a task is read at (`select`,
`SELECTION`) is where the papers differ:

  'best_per_task'  each task at its own best checkpoint (HyperPrompt).
  'best_average'   every task at the checkpoint with the best
                   `SELECTION_BENCHMARK` average (HyperGrid).
  'last'           every task at the newest checkpoint (HyperGrid's Base
                   baselines).

Ties go to the earliest step. Runs of one setup (seeds) are aggregated
after each run's selection (`aggregate`): mean, sample standard deviation,
min and max. The papers' sections, the files written and their layout:
docs/evaluation.md, "Which checkpoint: the selection protocols" and
"Several runs of one setup".
"""

import json
import math
import os
import re
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from hyperprompt_jax import files
from hyperprompt_jax.tasks import scores
from hyperprompt_jax.tasks import task_ids

# {step: {seqio task: {metric: value}}}
StepResults = Mapping[int, Mapping[str, Mapping[str, float]]]

SUMMARY_FILE = 'summary.json'
BEST_FILE = 'best_per_task.json'
PLOT_FILE = 'task_scores.png'
_METRICS_FILE = re.compile(r'^(?P<task>.+)-metrics\.jsonl$')


def _finite(value: float) -> float:
  """`value`, or 0 for NaN (a constant prediction's correlation)."""
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


SELECTIONS = ('best_per_task', 'best_average', 'last')
# 'all': the mean score of every evaluated task, whatever its benchmark.
SELECTION_BENCHMARKS = tuple(task_ids.BENCHMARKS) + ('all',)


def check_selection(selection: str, benchmark: str) -> None:
  """Raises ValueError for an unknown protocol or benchmark."""
  if selection not in SELECTIONS:
    raise ValueError(f'SELECTION={selection!r}; expected one of '
                     f'{list(SELECTIONS)} (see eval_summary).')
  if benchmark not in SELECTION_BENCHMARKS:
    raise ValueError(f'SELECTION_BENCHMARK={benchmark!r}; expected one of '
                     f'{list(SELECTION_BENCHMARKS)}.')


def summarize(results: StepResults,
              majority: Optional[Mapping[str, float]] = None,
              selection: str = 'best_per_task',
              benchmark: str = 'glue') -> dict:
  """The summary of a run's evaluations.

  Args:
    results: `{step: {seqio task: {metric: value}}}`.
    majority: `{task: majority-class score}`, if computed.
    selection: the protocol reported (`select`).
    benchmark: the average 'best_average' picks by.

  Returns:
    `{"steps": {"<step>": step_summary}, "majority", "selection": the
    protocol's `select`, "selections": every protocol's that applies}`, as
    summary.json (docs/evaluation.md, "Evaluation").
  """
  check_selection(selection, benchmark)
  if not results:
    raise ValueError('No evaluation results to summarise.')
  summary: dict[str, Any] = {
      'steps': {str(step): step_summary(results[step])
                for step in sorted(results)}}
  if majority is not None:
    summary['majority'] = dict(majority)
  summary['selection'] = select(summary, selection, benchmark)
  summary['selections'] = {}
  for name in SELECTIONS:
    try:
      summary['selections'][name] = select(summary, name, benchmark)
    except ValueError:
      pass  # best_average without that benchmark's tasks: not applicable
  return summary


def _selection_score(step_summary_: Mapping[str, Any],
                     benchmark: str) -> Optional[float]:
  """The step's `benchmark` average ('all': mean score), or None."""
  if benchmark == 'all':
    score = step_summary_['mean_score']
    return score if math.isfinite(score) else None
  return step_summary_['averages'].get(benchmark)


def select(summary: Mapping[str, Any], selection: str = 'best_per_task',
           benchmark: str = 'glue') -> dict:
  """The scores a protocol reports (ties: the earliest step).

  Args:
    summary: `summarize`'s output (its "steps" are used).
    selection: 'best_per_task', 'best_average' or 'last'.
    benchmark: for 'best_average', the average that picks the checkpoint:
      'glue', 'super_glue', 'glue_super_glue' or 'all'.

  Returns:
    {"protocol", "benchmark" (best_average only, else None), "step" (the
    one checkpoint; None for best_per_task), "tasks": {task: {"step",
    "score"}}, "averages": {benchmark: average of those scores}, "missing":
    [tasks evaluated at some step but not at the chosen one]}.

  Raises:
    ValueError: an unknown protocol, or 'best_average' on a benchmark whose
      tasks were not all evaluated at any step.
  """
  check_selection(selection, benchmark)
  steps = sorted(summary['steps'], key=int)
  evaluated = sorted({t for s in steps
                      for t in summary['steps'][s]['task_scores']})
  step = None
  if selection == 'best_per_task':
    tasks: dict[str, dict[str, Any]] = {}
    for s in steps:
      for task, score in summary['steps'][s]['task_scores'].items():
        if task not in tasks or score > tasks[task]['score']:
          tasks[task] = {'step': int(s), 'score': score}
  else:
    if selection == 'last':
      step = steps[-1]
    else:
      candidates = [(score, -int(s), s) for s in steps if (
          score := _selection_score(summary['steps'][s], benchmark))
                    is not None]
      if not candidates:
        needed = (task_ids.BENCHMARKS[benchmark] if benchmark != 'all'
                  else ())
        raise ValueError(
            f"SELECTION='best_average' picks the checkpoint by the "
            f'{benchmark!r} average, but no step has every task of it '
            f'(missing: {sorted(set(needed) - set(evaluated))}). Set '
            'SELECTION_BENCHMARK to a benchmark the mixture covers, or '
            "'all' (the mean of every evaluated task).")
      step = max(candidates)[2]
    tasks = {task: {'step': int(step), 'score': score} for task, score in
             summary['steps'][step]['task_scores'].items()}
  return {
      'protocol': selection,
      'benchmark': benchmark if selection == 'best_average' else None,
      'step': None if step is None else int(step),
      'tasks': dict(sorted(tasks.items())),
      'averages': _averages({t: v['score'] for t, v in tasks.items()}),
      'missing': [t for t in evaluated if t not in tasks],
  }


def best_per_task(summary: Mapping[str, Any]) -> dict:
  """best_per_task.json: each task's best step, and the best checkpoint."""
  per_task = select(summary, 'best_per_task')
  top = select(summary, 'best_average', 'all')['step']
  top_summary = summary['steps'][str(top)]
  return {
      'tasks': per_task['tasks'],
      'averages': per_task['averages'],
      'best_checkpoint': {'step': top,
                          'mean_score': top_summary['mean_score'],
                          'averages': top_summary['averages'],
                          'task_scores': top_summary['task_scores']},
  }


# -- several runs of one setup -------------------------------------------------


def _stats(per_run: Mapping[str, float]) -> dict:
  """Mean, sample std (None for one run), min, max, n and the scores."""
  values = np.array(list(per_run.values()), dtype=np.float64)
  return {'mean': float(values.mean()),
          # ddof=1: the sample standard deviation (undefined for one run).
          'std': float(values.std(ddof=1)) if len(values) > 1 else None,
          'min': float(values.min()), 'max': float(values.max()),
          'n': len(values), 'runs': dict(per_run)}


def aggregate(runs: Mapping[str, Mapping[str, Any]]) -> dict:
  """Statistics over runs (seeds) of one setup, each read with its own
  selection (`summarize(...)['selection']`).

  Args:
    runs: {run name: that run's summary}.

  Returns:
    {"tasks": {task: stats}, "averages": {benchmark: stats}, "best_run":
    {benchmark: the run with the highest average}} with stats {"mean",
    "std" (ddof = 1; None for one run), "min", "max", "n" (runs that have
    it), "runs": {run: score}}. A task or average missing from some runs is
    aggregated over the runs that have it (its "n" says how many).
  """
  if not runs:
    raise ValueError('No runs to aggregate.')
  protocols = {(r['selection']['protocol'], r['selection']['benchmark'])
               for r in runs.values()}
  if len(protocols) > 1:
    raise ValueError(f'The runs were summarised with different selections '
                     f'{sorted(protocols, key=str)}; use one.')
  tasks: dict[str, dict[str, float]] = {}
  averages: dict[str, dict[str, float]] = {}
  for name, summary in runs.items():
    for task, v in summary['selection']['tasks'].items():
      tasks.setdefault(task, {})[name] = v['score']
    for bench, value in summary['selection']['averages'].items():
      averages.setdefault(bench, {})[name] = value
  return {
      'tasks': {t: _stats(v) for t, v in sorted(tasks.items())},
      'averages': {b: _stats(v) for b, v in averages.items()},
      # max() keeps the first of equal runs.
      'best_run': {b: max(v, key=v.get) for b, v in averages.items()},
  }


# -- t5x's evaluation output -------------------------------------------------


def read_metrics_dir(metrics_dir: str) -> dict[int, dict[str, dict]]:
  """Reads seqio `JSONLogger` files (`<task>-metrics.jsonl`).

  A later line for a step replaces an earlier one (a re-evaluation);
  non-numeric values (text metrics) are skipped.

  Args:
    metrics_dir: the folder holding them, or the EVAL_OUTPUT_DIR /
      MODEL_DIR above its `inference_eval/`.

  Returns:
    `{step: {task: {metric: value}}}`.
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


def _write_json(content: Any, path: str) -> None:
  """Writes `content` as indented JSON."""
  files.write_atomically(path, json.dumps(content, indent=1, sort_keys=True))


def write(summary: Mapping[str, Any], output_dir: str) -> dict[str, str]:
  """Writes summary.json, best_per_task.json and the plot; returns paths."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  tf.io.gfile.makedirs(output_dir)
  paths = {'summary': os.path.join(output_dir, SUMMARY_FILE),
           'best_per_task': os.path.join(output_dir, BEST_FILE),
           'plot': os.path.join(output_dir, PLOT_FILE)}
  _write_json(summary, paths['summary'])
  _write_json(best_per_task(summary), paths['best_per_task'])
  plot(summary, paths['plot'])
  return paths


def runs_summary(runs: Mapping[str, Mapping[str, Any]],
                 run_paths: Mapping[str, str]) -> dict:
  """The summary of several runs: each one's selection and the aggregate."""
  agg = aggregate(runs)
  first = next(iter(runs.values()))['selection']
  return {'runs': {name: {'path': run_paths[name],
                          'selection': summary['selection']}
                   for name, summary in runs.items()},
          'aggregate': agg,
          'selection': first['protocol'],
          'selection_benchmark': first['benchmark']}


def write_runs(summary: Mapping[str, Any], output_dir: str) -> dict[str, str]:
  """Writes `runs_summary`'s summary.json and its plot; returns their paths."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  tf.io.gfile.makedirs(output_dir)
  paths = {'summary': os.path.join(output_dir, SUMMARY_FILE),
           'plot': os.path.join(output_dir, PLOT_FILE)}
  _write_json(summary, paths['summary'])
  plot_runs(summary, paths['plot'])
  return paths


def _pyplot():
  """matplotlib's pyplot, on the Agg backend."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _save(fig, path: str) -> None:
  """Writes `fig` as PNG and closes it."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  with tf.io.gfile.GFile(path, 'wb') as f:
    fig.savefig(f, format='png', dpi=100)
  _pyplot().close(fig)


def _task_order(tasks) -> list[str]:
  """GLUE, then SuperGLUE in the papers' order, then other tasks by name."""
  order = {t: i for i, t in enumerate(task_ids.BENCHMARKS['glue_super_glue'])}
  return sorted(tasks, key=lambda t: (order.get(t, len(order)), t))


def plot(summary: Mapping[str, Any], path: str) -> None:
  """Plots task scores and averages against steps, the selection marked."""
  plt = _pyplot()
  steps = sorted(summary['steps'], key=int)
  x = [int(s) for s in steps]
  tasks = _task_order({t for s in steps
                       for t in summary['steps'][s]['task_scores']})
  benchmarks = sorted({b for s in steps for b in summary['steps'][s]['averages']})
  selection = summary.get('selection')
  fig, ax = plt.subplots(figsize=(10, 6))
  # 20 distinct colours for up to 20 tasks (the default cycle repeats at 10).
  colours = plt.get_cmap('tab20').colors
  for i, task in enumerate(tasks):
    y = [summary['steps'][s]['task_scores'].get(task, math.nan) for s in steps]
    colour = colours[i % len(colours)]
    ax.plot(x, y, marker='o', markersize=3, linewidth=1, label=task,
            color=colour, linestyle='-' if i < len(colours) else ':')
    if selection and selection['step'] is None and task in selection['tasks']:
      best = selection['tasks'][task]
      ax.plot([best['step']], [best['score']], marker='*', markersize=10,
              color=colour)
  for name, colour in zip(benchmarks, ('black', 'dimgray', 'darkred')):
    y = [summary['steps'][s]['averages'].get(name, math.nan) for s in steps]
    ax.plot(x, y, linestyle='--', linewidth=2.5, color=colour,
            label=f'{name} average')
  if selection:
    if selection['step'] is not None:
      ax.axvline(selection['step'], color='gray', linestyle=':')
    ax.set_title(_selection_title(selection), fontsize=9)
  ax.set_xlabel('step')
  ax.set_ylabel('task score')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2, loc='center left', bbox_to_anchor=(1, 0.5))
  fig.tight_layout()
  _save(fig, path)


def plot_runs(summary: Mapping[str, Any], path: str) -> None:
  """Plots each task's mean and std over the runs, each run's score a dot."""
  plt = _pyplot()
  agg = summary['aggregate']
  rows = [(t, agg['tasks'][t]) for t in _task_order(agg['tasks'])] + [
      (f'{b} average', agg['averages'][b]) for b in task_ids.BENCHMARKS
      if b in agg['averages']]
  runs = list(summary['runs'])
  fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 5))
  x = np.arange(len(rows))
  ax.errorbar(x, [r['mean'] for _, r in rows],
              yerr=[r['std'] or 0.0 for _, r in rows], fmt='s', color='black',
              capsize=4, label='mean ± std')
  colours = plt.get_cmap('tab10').colors
  for i, run in enumerate(runs):
    ax.plot(x + 0.15, [r['runs'].get(run, math.nan) for _, r in rows], 'o',
            markersize=4, alpha=0.7, color=colours[i % len(colours)],
            label=run)
  ax.set_xticks(x, [name for name, _ in rows], rotation=60, ha='right',
                fontsize=8)
  ax.set_ylabel('task score')
  ax.set_title(f'{len(runs)} runs; ' + _selection_title(
      next(iter(summary['runs'].values()))['selection'], step=False),
               fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  _save(fig, path)


_PROTOCOL_NAMES = {'best_per_task': 'each task at its best checkpoint',
                   'best_average': 'one checkpoint, the best {} average',
                   'last': 'every task at the last checkpoint'}


def _selection_title(selection: Mapping[str, Any], step: bool = True) -> str:
  """The protocol in words, with the step if `step`."""
  text = f"{selection['protocol']}: " + _PROTOCOL_NAMES[
      selection['protocol']].format(selection['benchmark'])
  if step and selection['step'] is not None:
    text += f" (step {selection['step']})"
  return text


def _format(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  """Aligned columns, the first left-aligned, a rule under the header."""
  widths = [max(len(r[i]) for r in [header, *rows])
            for i in range(len(header))]
  lines = ['  '.join(c.ljust(w) if i == 0 else c.rjust(w)
                     for i, (c, w) in enumerate(zip(r, widths)))
           for r in [header, *rows]]
  lines.insert(1, '-' * len(lines[0]))
  return '\n'.join(lines)


def table(summary: Mapping[str, Any]) -> str:
  """A plain-text table of the selected scores and steps.

  With the majority-class scores when known, the benchmark averages, then
  the averages every other protocol would report.
  """
  selection = summary['selection']
  majority = summary.get('majority') or {}
  header = ['task', 'score', 'step']
  if majority:
    header += ['majority', 'gain']
  rows = []
  for task in _task_order(selection['tasks']):
    score = selection['tasks'][task]['score']
    row = [task, f'{score:.2f}', str(selection['tasks'][task]['step'])]
    if majority:
      base = majority.get(task)
      row += (['-', '-'] if base is None
              else [f'{base:.2f}', f'{score - base:+.2f}'])
    rows.append(row)
  for name in task_ids.BENCHMARKS:
    if name in selection['averages']:
      rows.append([f'{name} average', f"{selection['averages'][name]:.2f}",
                   ''] + ['', ''] * bool(majority))
  lines = [_selection_title(selection), _format(header, rows)]
  if selection['missing']:
    lines.append(f"Not evaluated at step {selection['step']}: "
                 f"{', '.join(selection['missing'])}.")
  if len(summary['steps']) > 1:
    for name, other in summary.get('selections', {}).items():
      if name != selection['protocol'] and other['averages']:
        lines.append(f'{_selection_title(other)}: ' + ', '.join(
            f'{b} {v:.2f}' for b, v in other['averages'].items()))
  return '\n'.join(lines)


def runs_table(summary: Mapping[str, Any]) -> str:
  """A plain-text table of each run's scores, their mean ± std and max."""
  runs = list(summary['runs'])
  agg = summary['aggregate']
  header = ['task', *runs, 'mean ± std', 'max']

  def row(name, stats):
    std = '' if stats['std'] is None else f" ± {stats['std']:.2f}"
    return [name, *(f"{stats['runs'][r]:.2f}" if r in stats['runs'] else '-'
                    for r in runs),
            f"{stats['mean']:.2f}{std}", f"{stats['max']:.2f}"]

  rows = [row(t, agg['tasks'][t]) for t in _task_order(agg['tasks'])]
  rows += [row(f'{b} average', agg['averages'][b]) for b in task_ids.BENCHMARKS
           if b in agg['averages']]
  steps = {r: summary['runs'][r]['selection']['step'] for r in runs}
  if None not in steps.values():  # one checkpoint per run: say which
    rows.append(['step', *(str(steps[r]) for r in runs), '', ''])
  selection = summary['runs'][runs[0]]['selection']
  return '\n'.join([f'{len(runs)} runs; '
                    f'{_selection_title(selection, step=False)}',
                    _format(header, rows)])
