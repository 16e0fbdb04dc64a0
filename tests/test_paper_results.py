"""The papers' results shipped as data: every number where its seed line
says it is, every printed average the mean of its tasks (or a listed
exception), and the comparison a run prints beside them."""

import glob
import json
import pathlib
import re

import numpy as np
import pytest

from hyperprompt_jax import eval as eval_command
from hyperprompt_jax.evaluation import paper_results
from hyperprompt_jax.tasks import task_ids

SEEDS = pathlib.Path(__file__).resolve().parents[2] / 'shared' / 'seeds'


def _seed_lines(seed):
  found = glob.glob(str(SEEDS / f'{seed}_*.txt'))
  if not found:
    pytest.skip(f'the seeds are not beside the checkout ({SEEDS})')
  return pathlib.Path(found[0]).read_text().split('\n')


def _numbers(line):
  return [float(x) for x in re.findall(r'\d+\.\d+', line)]


@pytest.mark.parametrize('setup', paper_results.setups())
def test_every_number_is_on_its_seed_line(setup):
  record = paper_results.get(setup)
  lines = _seed_lines(record['seed'])
  for task, v in record['tasks'].items():
    on_line = _numbers(lines[v['line'] - 1])
    for metric, value in v['metrics'].items():
      assert value in on_line, (setup, task, metric, v['line'])
  for bench, v in record['printed_averages'].items():
    line = lines[v['line'] - 1]
    # HyperPrompt prints AVG last; HyperGrid prints Avg after #params.
    cell = line.split('\t')[-1 if record['seed'] == '000' else 2]
    assert float(cell) == v['value'], (setup, bench, line)
    # The table's caption, after its rows in both seeds, names the table
    # the number is cited from.
    caption = next(l for l in lines[v['line']:] if l.startswith('Table '))
    assert caption.startswith(v['table'] + ':'), (setup, caption)


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
  # HyperPrompt Table 9, MTL [000 L392]: (82.6 + (93.4+93.5)/2 + 65.7 +
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
