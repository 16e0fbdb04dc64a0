"""The papers' own per-task results, and a run's scores beside them.

`paper_results.json` holds each setup's dev results transcribed from the
papers' tables, with citations ("source": paper, section, table(s); "row":
the table row; "table" on every task and printed average): HyperPrompt
(ICML 2022), Appendix A.4, Tables 8-11, and HyperGrid (ICLR 2021), Sec.
3.1.1, Tables 1-2. Setup names are gin/setups/'s where one exists. A task's
score is the mean of its printed metrics, a benchmark's average the mean of
its 8 task scores (`tasks.scores`); printed averages this does not
reproduce are listed with the reason under "known_mismatches"
(tests/test_paper_results.py checks both). `--compare_to=<setup>` prints
and plots a run's scores beside them (docs/evaluation.md, "Beside the
papers' numbers").
"""

import difflib
import functools
import json
import math
import os
from typing import Any, Mapping

from hyperprompt_jax.tasks import task_ids

DATA_FILE = os.path.join(os.path.dirname(__file__), 'paper_results.json')
PLOT_FILE = 'compare_to_paper.png'


@functools.cache
def _data() -> dict[str, Any]:
  with open(DATA_FILE, encoding='utf-8') as f:
    return json.load(f)


def setups() -> list[str]:
  """Every setup with the papers' numbers."""
  return sorted(_data()['setups'])


def get(setup: str) -> dict[str, Any]:
  """One setup's record, or a ValueError suggesting close names.

  Its paper, source, row, model, split, tasks (each with its metrics and
  table) and printed averages (each with its value and table).
  """
  known = _data()['setups']
  if setup not in known:
    close = difflib.get_close_matches(setup, known, n=3)
    hint = f' Did you mean {", ".join(close)}?' if close else ''
    raise ValueError(f'No paper results for {setup!r}.{hint} Known: '
                     f'{", ".join(sorted(known))}.')
  return known[setup]


def known_mismatches() -> dict[str, dict[str, str]]:
  """{setup: {benchmark: why}}: printed averages the cells do not give."""
  return _data()['known_mismatches']


def task_scores(setup: str) -> dict[str, float]:
  """{task: the mean of its printed metrics}."""
  return {task: sum(v['metrics'].values()) / len(v['metrics'])
          for task, v in get(setup)['tasks'].items()}


def averages(setup: str) -> dict[str, float]:
  """{benchmark: the mean of its task scores} for each printed benchmark."""
  scores = task_scores(setup)
  return {bench: sum(scores[t] for t in task_ids.BENCHMARKS[bench]) / len(
      task_ids.BENCHMARKS[bench]) for bench in get(setup)['printed_averages']}


def compare(scores: Mapping[str, float], run_averages: Mapping[str, float],
            setup: str) -> dict[str, Any]:
  """A run's task scores and averages beside the paper's.

  Args:
    scores: the run's {task: score} (canonical task names, e.g. a
      summary's selected scores).
    run_averages: the run's {benchmark: average}.
    setup: the paper setup (`setups()`).

  Returns:
    {"setup", "paper", "source", "row", "model", "tables", "tasks": {task:
    {"ours", "paper", "delta"}}, "averages": {benchmark: {"ours", "paper"
    (as printed), "delta"}}, "only_paper": [tasks], "only_ours": [tasks]};
    a side missing a number has None there.
  """
  record = get(setup)
  paper = task_scores(setup)

  def row(ours, theirs):
    delta = (None if ours is None or theirs is None else ours - theirs)
    return {'ours': ours, 'paper': theirs, 'delta': delta}

  tasks = {t: row(scores.get(t), paper.get(t))
           for t in _order(set(paper) | set(scores))}
  benches = {b: row(run_averages.get(b), v['value'])
             for b, v in record['printed_averages'].items()}
  tables = sorted({v['table'] for v in record['tasks'].values()})
  return {'setup': setup, 'paper': record['paper'],
          'source': record['source'], 'row': record['row'],
          'model': record['model'], 'tables': tables, 'tasks': tasks,
          'averages': benches,
          'only_paper': sorted(set(paper) - set(scores)),
          'only_ours': sorted(set(scores) - set(paper))}


def _order(tasks) -> list[str]:
  order = {t: i for i, t in enumerate(task_ids.BENCHMARKS['glue_super_glue'])}
  return sorted(tasks, key=lambda t: (order.get(t, len(order)), t))


def _cell(x) -> str:
  return '-' if x is None else f'{x:.2f}'


def compare_table(comparison: Mapping[str, Any]) -> str:
  """Aligned plain text: task, ours, paper, delta; averages; a citation."""
  header = ['task', 'ours', 'paper', 'delta']
  rows = [[t, _cell(v['ours']), _cell(v['paper']),
           '-' if v['delta'] is None else f"{v['delta']:+.2f}"]
          for t, v in comparison['tasks'].items()]
  rows += [[f'{b} average', _cell(v['ours']), _cell(v['paper']),
            '-' if v['delta'] is None else f"{v['delta']:+.2f}"]
           for b, v in comparison['averages'].items()]
  widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
  lines = ['  '.join(c.ljust(w) if i == 0 else c.rjust(w)
                     for i, (c, w) in enumerate(zip(r, widths)))
           for r in [header, *rows]]
  lines.insert(1, '-' * len(lines[0]))
  lines.append(f"Paper: {comparison['source']}, row "
               f"\"{comparison['row']}\" ({comparison['model']}); averages "
               f"as printed.")
  return '\n'.join([f"Compared with {comparison['setup']}:", *lines])


def plot_compare(comparison: Mapping[str, Any], path: str) -> None:
  """Ours and the paper's score per task (bars), the delta written above."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  rows = list(comparison['tasks'].items()) + [
      (f'{b} avg', v) for b, v in comparison['averages'].items()]
  fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows) + 2), 4.5))
  for i, (name, v) in enumerate(rows):
    for offset, key, colour in ((-0.2, 'paper', 'lightgray'),
                                (0.2, 'ours', 'tab:blue')):
      if v[key] is not None:
        ax.bar(i + offset, v[key], width=0.4, color=colour,
               label=key if i == 0 else None)
    if v['delta'] is not None:
      top = max(v['ours'], v['paper'])
      ax.text(i, top + 1, f"{v['delta']:+.1f}", ha='center', fontsize=7,
              color='tab:green' if v['delta'] >= 0 else 'tab:red')
  ax.set_xticks(range(len(rows)), [n for n, _ in rows], rotation=60,
                ha='right', fontsize=8)
  finite = [v[k] for _, v in rows for k in ('ours', 'paper')
            if v[k] is not None and math.isfinite(v[k])]
  ax.set_ylim(min(finite + [0]) - 5, max(finite + [100]) + 8)
  ax.set_ylabel('task score')
  ax.set_title(f"ours vs {comparison['setup']} ({comparison['paper']})",
               fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  with tf.io.gfile.GFile(path, 'wb') as f:
    fig.savefig(f, format='png', dpi=100)
  plt.close(fig)
