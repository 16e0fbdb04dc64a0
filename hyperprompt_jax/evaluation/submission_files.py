"""Test-server files: test-split predictions in the leaderboards' formats.

The command is `python -m hyperprompt_jax.leaderboard` (docs/evaluation.md,
"Test-server files").
"""

import argparse
import collections
import json
import logging
import os
from typing import Any, Mapping, Optional, Sequence

import gin
import seqio
import tensorflow as tf

from hyperprompt_jax import files
from hyperprompt_jax.common import input_pipeline
from hyperprompt_jax.common import multihost
from hyperprompt_jax.evaluation import checkpoint_job
from hyperprompt_jax.evaluation import inference
from hyperprompt_jax.model import network
from hyperprompt_jax.tasks import task_ids

log = logging.getLogger('hyperprompt_jax.leaderboard')

SUMMARY_FILE = 'leaderboard_summary.json'
_NLI3 = ('entailment', 'neutral', 'contradiction')
_NLI2 = ('entailment', 'not_entailment')

# task (fixture prefix removed) -> (file, format, label names by class id).
FILES: dict[str, tuple[str, str, Optional[tuple]]] = {
    'glue_cola': ('CoLA.tsv', 'tsv', (0, 1)),
    'glue_sst2': ('SST-2.tsv', 'tsv', (0, 1)),
    'glue_mrpc': ('MRPC.tsv', 'tsv', (0, 1)),
    'glue_stsb': ('STS-B.tsv', 'tsv_float', None),
    'glue_qqp': ('QQP.tsv', 'tsv', (0, 1)),
    'glue_mnli_matched': ('MNLI-m.tsv', 'tsv', _NLI3),
    'glue_mnli_mismatched': ('MNLI-mm.tsv', 'tsv', _NLI3),
    'glue_qnli': ('QNLI.tsv', 'tsv', _NLI2),
    'glue_rte': ('RTE.tsv', 'tsv', _NLI2),
    'glue_ax': ('AX.tsv', 'tsv', _NLI3),
    'super_glue_boolq': ('BoolQ.jsonl', 'jsonl', ('false', 'true')),
    'super_glue_cb': ('CB.jsonl', 'jsonl', ('entailment', 'contradiction',
                                            'neutral')),
    'super_glue_copa': ('COPA.jsonl', 'jsonl', (0, 1)),
    'super_glue_multirc': ('MultiRC.jsonl', 'multirc', (0, 1)),
    'super_glue_record': ('ReCoRD.jsonl', 'record', None),
    'super_glue_rte': ('RTE.jsonl', 'jsonl', _NLI2),
    'super_glue_wic': ('WiC.jsonl', 'jsonl', ('false', 'true')),
    'super_glue_wsc': ('WSC.jsonl', 'jsonl', ('False', 'True')),
    'super_glue_axb': ('AX-b.jsonl', 'jsonl', _NLI2),
    'super_glue_axg': ('AX-g.jsonl', 'jsonl', _NLI2),
}
# What each server asks for, beyond the tasks above: written when present.
REQUIRED = {
    'glue': ('CoLA.tsv', 'SST-2.tsv', 'MRPC.tsv', 'STS-B.tsv', 'QQP.tsv',
             'MNLI-m.tsv', 'MNLI-mm.tsv', 'QNLI.tsv', 'RTE.tsv', 'WNLI.tsv',
             'AX.tsv'),
    'super_glue': ('BoolQ.jsonl', 'CB.jsonl', 'COPA.jsonl', 'MultiRC.jsonl',
                   'ReCoRD.jsonl', 'RTE.jsonl', 'WiC.jsonl', 'WSC.jsonl',
                   'AX-b.jsonl', 'AX-g.jsonl'),
}


def file_task(name: str) -> Optional[str]:
  """The FILES key of a seqio task; None for a task no server takes."""
  if name.startswith(task_ids.FIXTURE_PREFIX):
    name = name[len(task_ids.FIXTURE_PREFIX):]
  return name if name in FILES else None


def _label(value: Any, labels: tuple) -> tuple[Any, bool]:
  """`(label, valid)`: the name of class `value`, or the first label."""
  if isinstance(value, bool) or not isinstance(value, int) or not (
      0 <= value < len(labels)):
    return labels[0], False
  return labels[value], True


def format_file(task: str, records: Sequence[Mapping[str, Any]]
                ) -> tuple[str, str, int]:
  """The test-server file of one task.

  Args:
    task: a FILES key.
    records: `inference.task_predictions` records (each with 'idx' and the
      postprocessed 'prediction_value').

  Returns:
    `(file name, content, number of invalid predictions)`; an invalid one
    is written as the first label.
  """
  name, kind, labels = FILES[task]
  invalid = 0
  if kind in ('tsv', 'tsv_float'):
    lines = ['index\tprediction']
    for r in sorted(records, key=lambda r: r['idx']):
      if kind == 'tsv_float':
        value = r['prediction_value']
        ok = isinstance(value, (int, float)) and 0.0 <= value <= 5.0
        if not ok and isinstance(value, (int, float)) and value != -1.0:
          value, ok = min(5.0, max(0.0, value)), True  # outside the scale
        label = f'{value:.3f}' if ok else '0.000'
      else:
        label, ok = _label(r['prediction_value'], labels)
      invalid += not ok
      lines.append(f"{r['idx']}\t{label}")
    return name, '\n'.join(lines) + '\n', invalid
  rows = []
  if kind == 'jsonl':
    for r in sorted(records, key=lambda r: r['idx']):
      label, ok = _label(r['prediction_value'], labels)
      invalid += not ok
      rows.append({'idx': r['idx'], 'label': label})
  elif kind == 'record':
    # One row per query: the example is repeated per answer in training
    # data; test queries have none, so one each.
    seen = {}
    for r in records:
      seen.setdefault(r['idx']['query'], r['prediction_value']['value'])
    rows = [{'idx': q, 'label': text} for q, text in sorted(seen.items())]
  else:  # multirc
    passages = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in records:
      label, ok = _label(r['prediction_value']['value'], labels)
      invalid += not ok
      i = r['idx']
      passages[i['paragraph']][i['question']].append(
          {'idx': i['answer'], 'label': label})
    rows = [{'idx': p, 'passage': {'questions': [
        {'idx': q, 'answers': sorted(a, key=lambda x: x['idx'])}
        for q, a in sorted(questions.items())]}}
            for p, questions in sorted(passages.items())]
  return name, ''.join(json.dumps(r) + '\n' for r in rows), invalid


@gin.configurable(denylist=['model'])
def write_files(
    model: Optional[network.Transformer] = None,
    *,
    job: checkpoint_job.CheckpointJob = gin.REQUIRED,
) -> dict[str, Any]:
  """Writes the server files of every server task of `job`'s mixture.

  Every process decodes its rows of each batch; process 0 writes the files.

  Args:
    model: the network; None builds `network.Transformer` from gin.
    job: one checkpoint, the data (split: the servers', 'test'), the output
      directory and mesh.

  Returns:
    The summary, also written as `leaderboard_summary.json`.
  """
  if not tf.io.gfile.isdir(job.checkpoint_path):
    raise FileNotFoundError(f'CHECKPOINT_PATH {job.checkpoint_path!r} does '
                            'not exist: give one checkpoint_<step> folder.')
  model = checkpoint_job.checked_model(model, job, 'LEADERBOARD_OUTPUT_DIR')
  provider = input_pipeline.get_mixture_or_task(job.mixture_or_task_name)
  tasks = [t for t in seqio.get_subtasks(provider)
           if file_task(t.name) and job.split in t.splits]
  if not tasks:
    raise ValueError(f'{job.mixture_or_task_name!r} has no GLUE / SuperGLUE '
                     f'task with a {job.split!r} split.')
  predictor = inference.checkpoint_predictor(model, job)
  tf.io.gfile.makedirs(job.output_dir)
  summary = {'checkpoint': job.checkpoint_path, 'split': job.split,
             'files': {}}
  for task in tasks:
    records = inference.task_predictions(task, predictor,
                                     job.task_feature_lengths, job.split)
    name, content, invalid = format_file(file_task(task.name), records)
    path = os.path.join(job.output_dir, name)
    if multihost.is_writer():
      files.write_atomically(path, content)
    summary['files'][name] = {'task': task.name, 'examples': len(records),
                              'invalid_predictions_replaced': invalid}
    log.info('%s: %d examples -> %s%s', task.name, len(records), path,
             f' ({invalid} invalid predictions written as the first label)'
             if invalid else '')
  summary['missing'] = {
      bench: [f for f in files if f not in summary['files']]
      for bench, files in REQUIRED.items()}
  if not multihost.is_writer():
    return summary
  path = os.path.join(job.output_dir, SUMMARY_FILE)
  files.write_atomically(path, json.dumps(summary, indent=1))
  for bench, missing in summary['missing'].items():
    if missing:
      log.info('Not written for %s (no such task in the mixture): %s.', bench,
               ', '.join(missing))
  return summary


def run(args: argparse.Namespace) -> int:
  """`python -m hyperprompt_jax.leaderboard` with its parsed flags."""
  checkpoint_job.configure(args, log)
  write_files()
  return 0

