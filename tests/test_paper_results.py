"""The papers' results shipped as data: every number where the paper's table
prints it (the tables' text is in tests/testdata/paper_results/), every
printed average the mean of its tasks (or a listed exception), and the
comparison a run prints beside them."""

import json
import pathlib
import re

import numpy as np
import pytest

from hyperprompt_jax import eval as eval_command
from hyperprompt_jax.evaluation import paper_results
from hyperprompt_jax.tasks import task_ids

TABLES = pathlib.Path(__file__).resolve().parent / 'testdata' / 'paper_results'

# Each paper's column header of a task, as its tables print it. HyperGrid's
# SuperGLUE header prints CB in the Cyrillic letters "СВ" (kept verbatim in
# its table's text).
COLUMNS = {
    'HyperPrompt': {
        'glue_cola': 'CoLA', 'glue_sst2': 'SST-2', 'glue_mrpc': 'MRPC',
        'glue_stsb': 'SST-B', 'glue_qqp': 'QQP', 'glue_mnli': 'MNLI',
        'glue_qnli': 'QNLI', 'glue_rte': 'RTE', 'super_glue_boolq': 'BoolQ',
        'super_glue_cb': 'CB', 'super_glue_copa': 'COPA',
        'super_glue_multirc': 'MultiRC', 'super_glue_record': 'ReCoRD',
        'super_glue_rte': 'RTE', 'super_glue_wic': 'WIC',
        'super_glue_wsc': 'WSC', 'average': 'AVG'},
    'HyperGrid Transformers': {
        'glue_cola': 'CoLA', 'glue_sst2': 'SST', 'glue_mrpc': 'MR',
        'glue_stsb': 'STS', 'glue_qqp': 'QQP', 'glue_mnli': 'MNLI',
        'glue_qnli': 'QNLI', 'glue_rte': 'RTE', 'super_glue_boolq': 'BQ',
        'super_glue_cb': '\u0421\u0412', 'super_glue_copa': 'CP',
        'super_glue_multirc': 'MultiRC', 'super_glue_record': 'Record',
        'super_glue_rte': 'RTE', 'super_glue_wic': 'WiC',
        'super_glue_wsc': 'WSC', 'average': 'Avg'},
}
# The order of a two-number cell "a/b" (both papers print the same).
CELL_ORDER = {
    'glue_mrpc': ('f1', 'accuracy'), 'glue_qqp': ('f1', 'accuracy'),
    'glue_stsb': ('pearson_corrcoef', 'spearman_corrcoef'),
    'glue_mnli': ('matched_accuracy', 'mismatched_accuracy'),
    'super_glue_cb': ('mean_3class_f1', 'accuracy'),
    'super_glue_multirc': ('f1', 'exact_match'),
    'super_glue_record': ('f1', 'em'),
}


def _label(text):
  """A row label without the text extraction's LaTeX and spacing:
  '$\\mathrm{HGT}\\left(LG\\right)$' and 'HGT(LG)' read alike, as do
  'T5 [†] (SOTA)' and 'T5† (SOTA)'."""
  text = re.sub(r'\\(mathrm|left|right)', '', text)
  return re.sub(r'[\s${}\[\]]', '', text)


def _table(paper, table):
  """{row label: {column header: cell}} of one table's text, and its
  caption."""
  name = f"{paper.lower().replace(' ', '_')}_{table.lower().replace(' ', '_')}"
  lines = [l for l in (TABLES / f'{name}.txt').read_text(
      encoding='utf-8').splitlines() if l and not l.startswith('# ')]
  header = lines[0].split('\t')
  rows = {}
  for line in lines[1:-1]:
    cells = line.split('\t')
    if cells[0]:  # not HyperGrid's "Our Single-Model Approaches" separator
      assert len(cells) == len(header), (name, line)
      rows[_label(cells[0])] = dict(zip(header, cells))
  return rows, lines[-1]


def _numbers(cell):
  return [float(x) for x in re.findall(r'\d+\.\d+', cell)]


@pytest.mark.parametrize('setup', paper_results.setups())
def test_every_number_is_in_its_table(setup):
  record = paper_results.get(setup)
  paper = record['source'].split(',')[0]
  columns = COLUMNS[paper]
  assert record['paper'].startswith(paper + ' (')
  cited = {v['table'] for v in record['tasks'].values()} | {
      v['table'] for v in record['printed_averages'].values()}
  for table in cited:  # the source names every table its numbers come from
    assert re.search(rf'\b{table.split()[1]}\b', record['source']), (
        setup, table, record['source'])
  for task, v in record['tasks'].items():
    rows, caption = _table(paper, v['table'])
    # The excerpt's caption names the table it is cited as.
    assert caption.startswith(v['table'] + ':'), (setup, caption)
    cell = rows[_label(record['row'])][columns[task]]
    order = CELL_ORDER[task] if len(v['metrics']) > 1 else tuple(v['metrics'])
    assert sorted(order) == sorted(v['metrics']), (setup, task)
    assert _numbers(cell) == [v['metrics'][m] for m in order], (
        setup, task, cell)
  for bench, v in record['printed_averages'].items():
    rows, _ = _table(paper, v['table'])
    cell = rows[_label(record['row'])][columns['average']]
    assert float(cell) == v['value'], (setup, bench, cell)


def test_every_table_row_is_a_setup():
  """Each row of the shipped tables is transcribed, and only once."""
  cited = {}
  for setup in paper_results.setups():
    record = paper_results.get(setup)
    paper = record['source'].split(',')[0]
    for v in record['tasks'].values():
      cited.setdefault((paper, v['table'], _label(record['row'])), set()).add(
          setup)
  for path in sorted(TABLES.glob('*.txt')):
    paper = ('HyperPrompt' if path.name.startswith('hyperprompt_')
             else 'HyperGrid Transformers')
    table = 'Table ' + path.stem.rsplit('_', 1)[1]
    rows, _ = _table(paper, table)
    for row in rows:
      assert len(cited.get((paper, table, row), ())) == 1, (path.name, row)


@pytest.mark.parametrize('setup', paper_results.setups())
def test_printed_averages_are_the_mean_of_the_task_scores(setup):
  """The papers' rule: a task's score is the mean of its metrics (MNLI's
  two accuracies one task), the average the mean of the 8 task scores;
  printed to one decimal. The exceptions are listed with their reason."""
  record = paper_results.get(setup)
  known = paper_results.known_mismatches().get(setup, {})
  for bench, printed in record['printed_averages'].items():
    tasks = task_ids.BENCHMARKS[bench]
    assert set(tasks) <= set(record['tasks'])
    # Recomputed here from the metrics, independently of the module.
    mean = np.mean([np.mean(list(record['tasks'][t]['metrics'].values()))
                    for t in tasks])
    matches = abs(mean - printed['value']) <= 0.05 + 1e-9
    assert matches != (bench in known), (setup, bench, mean, printed)
    assert paper_results.averages(setup)[bench] == pytest.approx(mean)


def test_the_known_mismatches_name_real_setups():
  for setup, benches in paper_results.known_mismatches().items():
    assert set(benches) <= set(paper_results.get(setup)['printed_averages'])


def test_a_worked_example_from_the_paper():
  # HyperPrompt, Table 9, MTL: (82.6 + (93.4+93.5)/2 + 65.7 +
  # (76.7+39.7)/2 + (80.9+80.2)/2 + 85.6 + 70.5 + 81.4) / 8 = 77.25.
  assert paper_results.averages('mtl_super_glue')['super_glue'] == (
      pytest.approx(77.25))
  assert paper_results.task_scores('hyperprompt_global_glue')[
      'glue_mnli'] == pytest.approx((88.7 + 88.5) / 2)


def test_compare_by_hand(tmp_path):
  ours = {'glue_cola': 60.0, 'glue_rte': 80.0, 'super_glue_cb': 90.0}
  got = paper_results.compare(ours, {'glue': 86.0}, 'hyperprompt_global_glue')
  # Table 8, HyperPrompt: CoLA 57.0, RTE 87.1, average 86.8 as printed.
  assert got['tasks']['glue_cola'] == {'ours': 60.0, 'paper': 57.0,
                                       'delta': pytest.approx(3.0)}
  assert got['tasks']['glue_rte']['delta'] == pytest.approx(-7.1)
  assert got['tasks']['glue_sst2'] == {'ours': None, 'paper': 95.2,
                                       'delta': None}
  assert got['averages']['glue']['delta'] == pytest.approx(-0.8)
  assert got['only_ours'] == ['super_glue_cb']
  assert 'glue_qqp' in got['only_paper']
  text = paper_results.compare_table(got)
  assert 'glue_cola' in text and '+3.00' in text and 'Table 8' in text
  paper_results.plot_compare(got, str(tmp_path / 'c.png'))
  assert (tmp_path / 'c.png').read_bytes()[:4] == b'\x89PNG'


def test_unknown_setup_names_the_close_ones():
  with pytest.raises(ValueError, match='Did you mean hyperprompt_global_glue'):
    paper_results.get('hyperprompt_globl_glue')


def test_metrics_dir_compare_to(tmp_path, capsys):
  metrics = tmp_path / 'inference_eval'
  metrics.mkdir()
  (metrics / 'glue_rte-metrics.jsonl').write_text(
      '{"step": 100, "accuracy": 80.0}\n')
  assert eval_command.main([f'--metrics_dir={metrics}',
                        f'--output_dir={tmp_path / "out"}',
                        '--compare_to=hyperprompt_global_glue']) == 0
  written = json.loads((tmp_path / 'out' / 'compare_to_paper.json')
                       .read_text())
  assert written['tasks']['glue_rte']['delta'] == pytest.approx(80 - 87.1)
  assert (tmp_path / 'out' / paper_results.PLOT_FILE).exists()
  assert 'Compared with hyperprompt_global_glue' in capsys.readouterr().out
  with pytest.raises(ValueError, match='No paper results'):
    eval_command.main([f'--metrics_dir={metrics}',
                   f'--output_dir={tmp_path / "out2"}', '--compare_to=x'])
