"""The real joint mixture (`glue_super_glue_proportional`, gin/tasks/
glue_super_glue.gin) end to end on TFDS data, through both runners.

The 17 TFDS datasets are prepared by TFDS's own builders from a few
hand-written rows in each dataset's raw format (tests/tfds_sources.py; the
download replaced by local files), not from the project's fixtures, and a
tiny SentencePiece model trained on those rows is the tasks' vocabulary,
given by gin (`features.sentencepiece_model_file.path`). Then:

- built-in runner: `python -m hyperprompt_jax.train` trains a tiny
  HyperPrompt-Global model on the mixture (packed rows), `eval` scores the
  16 tasks on the validation splits, `leaderboard` writes the 17 test-server
  files, one row per test example written;
- t5x (where it is importable): `t5x.train` (which refuses to start when the
  model's and the tasks' vocabularies differ) and `t5x.eval`, whose metrics
  `hyperprompt_jax.eval --metrics_dir` summarises, then the test-server
  files from the t5x checkpoint.

Expectations (task names, file names, row counts, input strings) are
written by hand from the rows in tests/tfds_sources.py.
"""

import importlib.util
import json
import os
import pathlib
import re

import pytest

from hyperprompt_jax import paths
import conftest
import multiprocess
import tfds_sources

# Short rows: the model and the data are tiny; this is about the plumbing.
LENGTHS = "{'inputs': 64, 'targets': 8}"
SETUP = ['--gin_file=models/t5_1_1_tiny.gin',
         '--gin_file=variants/hyperprompt_global.gin',
         '--gin_file=tasks/glue_super_glue.gin']
SPM_VOCAB_SIZE = 256  # + T5's 100 sentinels: inside the tiny model's 384
MODEL_VOCAB_SIZE = 384  # gin/models/t5_1_1_tiny.gin

GLUE_TASKS = ['glue_cola', 'glue_sst2', 'glue_mrpc', 'glue_stsb', 'glue_qqp',
              'glue_mnli', 'glue_qnli', 'glue_rte']
SUPER_GLUE_TASKS = ['super_glue_boolq', 'super_glue_cb', 'super_glue_copa',
                    'super_glue_multirc', 'super_glue_record',
                    'super_glue_rte', 'super_glue_wic', 'super_glue_wsc']
# seqio evaluation tasks (MNLI's two validation sets) -> the validation
# examples written in tfds_sources (MultiRC: one per answer; ReCoRD: one
# per query with its answer).
VALIDATION_EXAMPLES = {
    'glue_cola': 2, 'glue_sst2': 2, 'glue_mrpc': 2, 'glue_stsb': 2,
    'glue_qqp': 2, 'glue_mnli_matched': 2, 'glue_mnli_mismatched': 3,
    'glue_qnli': 2, 'glue_rte': 2, 'super_glue_boolq': 2, 'super_glue_cb': 2,
    'super_glue_copa': 2, 'super_glue_multirc': 4, 'super_glue_record': 2,
    'super_glue_rte': 2, 'super_glue_wic': 2, 'super_glue_wsc': 2}
# The servers' file names (gluebenchmark.com's TSVs, super.gluebenchmark.com's
# JSON lines) -> rows: one per test example written (MultiRC: a row per
# paragraph, ReCoRD: per query).
GLUE_FILES = {'CoLA.tsv': 3, 'SST-2.tsv': 2, 'MRPC.tsv': 2, 'STS-B.tsv': 3,
              'QQP.tsv': 2, 'MNLI-m.tsv': 2, 'MNLI-mm.tsv': 3, 'QNLI.tsv': 2,
              'RTE.tsv': 3}
SUPER_GLUE_FILES = {'BoolQ.jsonl': 2, 'CB.jsonl': 3, 'COPA.jsonl': 2,
                    'MultiRC.jsonl': 2, 'ReCoRD.jsonl': 3, 'RTE.jsonl': 2,
                    'WiC.jsonl': 2, 'WSC.jsonl': 2}
# glue/rte's dev.tsv rows in T5's format.
RTE_VALIDATION_INPUTS = [
    'rte sentence1: A dog eats food. sentence2: Tom reads a long book.',
    'rte sentence1: Tom reads a long book. sentence2: The sun is very hot '
    'today.']
# Words T5's formats add to the raw text (the SentencePiece corpus).
T5_WORDS = ('cola sst2 mrpc stsb qqp mnli qnli rte boolq cb copa multirc '
            'record wic wsc: sentence: sentence1: sentence2: question: '
            'question1: question2: premise: hypothesis: passage: paragraph: '
            'answer: query: entities: word: choice1: choice2: acceptable '
            'unacceptable positive negative equivalent not_equivalent '
            'duplicate not_duplicate entailment not_entailment neutral '
            'contradiction True False <unk> *he* *it* *she*')


def _run(module: str, *args: str, timeout: int = 900) -> str:
  return conftest.run_module(module, *args, timeout=timeout)


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
  """(data dir, SentencePiece model): the 17 datasets prepared by TFDS's
  builders from raw files, and a tiny SentencePiece model of their text.
  Made once for the test session (`multiprocess.made_once`: xdist's workers
  that run this module's tests share it)."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top

  def make(root):
    sources = tfds_sources.write_sources(root / 'download')
    tfds_sources.prepare_all(sources, str(root / 'tensorflow_datasets'))
    corpus = root / 'corpus.txt'
    corpus.write_text(sources.corpus() + '\n' + T5_WORDS + '\n',
                      encoding='utf-8')
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(root / 'spm'),
        vocab_size=SPM_VOCAB_SIZE, model_type='unigram', pad_id=0, eos_id=1,
        unk_id=2, bos_id=-1, hard_vocab_limit=False)

  root = multiprocess.made_once(tmp_path_factory.getbasetemp(),
                                'real_mixture', make)
  model = str(root / 'spm.model')
  pieces = spm.SentencePieceProcessor(model_file=model).vocab_size()
  assert pieces + 100 <= MODEL_VOCAB_SIZE
  return str(root / 'tensorflow_datasets'), model


def _vocab(spm_model: str) -> str:
  return ('--gin.hyperprompt_jax.tasks.features.sentencepiece_model_file.'
          f"path='{spm_model}'")


def test_the_mixtures_datasets_are_prepared_by_tfds(prepared):
  """Each of the 17 datasets the mixture reads is prepared in the data dir
  with the splits and example counts of the raw files written."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from hyperprompt_jax.tasks import prepare  # pylint: disable=g-import-not-at-top
  data_dir, _ = prepared
  names = [d.tfds_name for d in prepare.datasets_of(
      'glue_super_glue_proportional')]
  assert sorted(names) == sorted(tfds_sources.DATASETS)
  assert all(prepare.is_prepared(n, data_dir) for n in names)
  counts = {n: {s: v.num_examples for s, v in
                tfds.builder(n, data_dir=data_dir).info.splits.items()}
            for n in ('glue/mnli:2.0.0', 'glue/mrpc:2.0.0',
                      'super_glue/multirc:1.0.2', 'super_glue/record:1.0.2',
                      'definite_pronoun_resolution:1.1.0')}
  assert counts == {
      'glue/mnli:2.0.0': {'train': 4, 'validation_matched': 2,
                          'validation_mismatched': 3, 'test_matched': 2,
                          'test_mismatched': 3},
      # MRPC's dev ids pick 2 of the train file's 6 rows.
      'glue/mrpc:2.0.0': {'train': 4, 'validation': 2, 'test': 2},
      # One example per answer: paragraphs x 2 questions x 2 answers.
      'super_glue/multirc:1.0.2': {'train': 8, 'validation': 4, 'test': 8},
      'super_glue/record:1.0.2': {'train': 3, 'validation': 2, 'test': 3},
      'definite_pronoun_resolution:1.1.0': {'train': 3, 'test': 2}}


# ------------------------------------------------------ built-in runner --

@pytest.fixture(scope='module')
def builtin_run(prepared, tmp_path_factory):
  """A tiny HyperPrompt-Global model trained 2 steps on the real mixture
  by the built-in runner; its MODEL_DIR. Trained once for the test session
  (`multiprocess.made_once`: xdist's workers share it; the tests only read
  it)."""
  data_dir, spm_model = prepared

  def make(root):
    _run('hyperprompt_jax.train', '--gin_file=runs/train.gin', *SETUP,
         f"--gin.MODEL_DIR='{root / 'run'}'",
         f"--gin.TFDS_DATA_DIR='{data_dir}'", _vocab(spm_model),
         '--gin.TRAIN_STEPS=2', '--gin.SAVE_PERIOD=2', '--gin.BATCH_SIZE=4',
         '--gin.PACK=True', '--gin.LOG_PERIOD=1',
         f'--gin.TASK_FEATURE_LENGTHS={LENGTHS}')

  return multiprocess.made_once(tmp_path_factory.getbasetemp(),
                                'real_mixture_builtin', make) / 'run'


def _config_records(config: pathlib.Path, spm_model: str) -> None:
  text = re.sub(r'\\\n\s*', '', config.read_text())  # gin's line breaks
  assert "MIXTURE_OR_TASK_NAME = 'glue_super_glue_proportional'" in text
  assert f"sentencepiece_model_file.path = '{spm_model}'" in text


def test_builtin_runner_trains_on_the_real_mixture(prepared, builtin_run):
  """train: a checkpoint at step 2, the run's config naming the real
  mixture and the gin-set SentencePiece model."""
  assert (builtin_run / 'checkpoint_2').is_dir()
  _config_records(builtin_run / 'config.gin', prepared[1])


def _check_validation_inferences(out: pathlib.Path, spm_model: str,
                                 step: int) -> None:
  """Each evaluation task decoded its validation examples (counts written
  by hand), RTE's inputs in T5's format and tokenized with `spm_model`."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  inferences = out / 'inference_eval'
  counts = {}
  for task in VALIDATION_EXAMPLES:
    lines = (inferences / f'{task}-{step:06d}.jsonl').read_text().splitlines()
    counts[task] = len(lines)
  assert counts == VALIDATION_EXAMPLES
  rte = [json.loads(line)['input'] for line in
         (inferences / f'glue_rte-{step:06d}.jsonl').read_text().splitlines()]
  assert sorted(ex['inputs_pretokenized'] for ex in rte) == (
      RTE_VALIDATION_INPUTS)
  assert {ex['task_ids'] for ex in rte} == {7}
  processor = spm.SentencePieceProcessor(model_file=spm_model)
  for ex in rte:
    want = processor.encode(ex['inputs_pretokenized']) + [1]  # EOS
    if isinstance(ex['inputs'], list):
      assert ex['inputs'] == want
    else:  # seqio abbreviates longer arrays: shape, first and last 5 ids
      ids = ', '.join(map(str, want[:5])) + ' ... ' + ', '.join(
          map(str, want[-5:]))
      assert ex['inputs'] == (
          f'ndarray(shape=({len(want)},), dtype=int32); summary: {ids}')


def _check_summary(summary_dir: pathlib.Path, stdout: str, step: int) -> None:
  """The summary scores the 16 tasks (MNLI's two sets as one)."""
  assert 'glue_super_glue average' in stdout
  summary = json.loads((summary_dir / 'summary.json').read_text())
  assert list(summary['steps']) == [str(step)]
  scores = summary['steps'][str(step)]['task_scores']
  assert sorted(scores) == sorted(GLUE_TASKS + SUPER_GLUE_TASKS)
  for task in GLUE_TASKS + SUPER_GLUE_TASKS:
    assert task in stdout


def test_builtin_eval_scores_the_16_tasks(prepared, builtin_run, tmp_path):
  """eval: every validation example of the 17 evaluation tasks decoded,
  16 task scores and the three benchmark averages."""
  data_dir, spm_model = prepared
  out = tmp_path / 'eval'
  stdout = _run('hyperprompt_jax.eval', '--gin_file=runs/eval.gin', *SETUP,
                f"--gin.CHECKPOINT_PATH='{builtin_run}'",
                f"--gin.EVAL_OUTPUT_DIR='{out}'",
                f"--gin.TFDS_DATA_DIR='{data_dir}'", _vocab(spm_model),
                '--gin.EVAL_BATCH_SIZE=4',
                f'--gin.TASK_FEATURE_LENGTHS={LENGTHS}')
  _check_validation_inferences(out, spm_model, 2)
  _check_summary(out, stdout, 2)
  for average in ('glue average', 'super_glue average'):
    assert average in stdout


def _check_server_files(out: pathlib.Path) -> None:
  """The 17 files the two servers take, one row per test example written,
  in idx order; the summary names WNLI and the diagnostics as missing."""
  written = sorted(p.name for p in out.iterdir()
                   if p.name != 'leaderboard_summary.json')
  assert written == sorted({**GLUE_FILES, **SUPER_GLUE_FILES})
  for name, rows in GLUE_FILES.items():
    lines = (out / name).read_text().splitlines()
    assert lines[0] == 'index\tprediction', name
    assert [int(line.split('\t')[0]) for line in lines[1:]] == list(
        range(rows)), name
  for name, rows in SUPER_GLUE_FILES.items():
    lines = [json.loads(line) for line in (out / name).read_text()
             .splitlines()]
    assert [line['idx'] for line in lines] == list(range(rows)), name
  # MultiRC: each paragraph's 2 questions with their 2 answers.
  for paragraph in (json.loads(line) for line in
                    (out / 'MultiRC.jsonl').read_text().splitlines()):
    questions = paragraph['passage']['questions']
    assert [q['idx'] for q in questions] == [0, 1]
    assert all([a['idx'] for a in q['answers']] == [0, 1] for q in questions)
  stsb = (out / 'STS-B.tsv').read_text().splitlines()[1:]
  assert all(0.0 <= float(line.split('\t')[1]) <= 5.0 for line in stsb)
  summary = json.loads((out / 'leaderboard_summary.json').read_text())
  assert summary['split'] == 'test'
  assert summary['files']['MultiRC.jsonl']['examples'] == 8
  assert summary['missing'] == {
      'glue': ['WNLI.tsv', 'AX.tsv'],
      'super_glue': ['AX-b.jsonl', 'AX-g.jsonl']}


def _leaderboard(checkpoint, out, data_dir, spm_model) -> None:
  _run('hyperprompt_jax.leaderboard', *SETUP, '--gin_file=runs/leaderboard.gin',
       f"--gin.CHECKPOINT_PATH='{checkpoint}'",
       f"--gin.LEADERBOARD_OUTPUT_DIR='{out}'",
       f"--gin.TFDS_DATA_DIR='{data_dir}'", _vocab(spm_model),
       '--gin.LEADERBOARD_BATCH_SIZE=4',
       f'--gin.TASK_FEATURE_LENGTHS={LENGTHS}')


def test_builtin_leaderboard_writes_the_17_server_files(
    prepared, builtin_run, tmp_path):
  """leaderboard: the GLUE and SuperGLUE servers' files of the test splits,
  from the built-in runner's checkpoint."""
  data_dir, spm_model = prepared
  _leaderboard(builtin_run / 'checkpoint_2', tmp_path / 'out', data_dir,
               spm_model)
  _check_server_files(tmp_path / 'out')


# ------------------------------------------------------------------ t5x --

T5X = importlib.util.find_spec('t5x') is not None
needs_t5x = pytest.mark.skipif(not T5X, reason='t5x is not installed')
T5X_GIN = [f'--gin_search_paths={paths.gin_dir()}']


@pytest.fixture(scope='module')
def t5x_run(prepared, tmp_path_factory):
  """The same model trained 2 steps by t5x.train (t5x/train.gin, the data
  dir by t5x's --tfds_data_dir, VOCABULARY as t5x/model.gin binds it: the
  gin-set SentencePiece model); its MODEL_DIR."""
  data_dir, spm_model = prepared
  model_dir = tmp_path_factory.mktemp('t5x') / 'run'
  _run('t5x.train', *T5X_GIN, '--gin_file=t5x/train.gin', *SETUP,
       f'--tfds_data_dir={data_dir}', _vocab(spm_model),
       f"--gin.MODEL_DIR='{model_dir}'", '--gin.INITIAL_CHECKPOINT_PATH=None',
       '--gin.TRAIN_STEPS=2', '--gin.SAVE_PERIOD=2', '--gin.BATCH_SIZE=4',
       '--gin.RANDOM_SEED=0', '--gin.PACK=True',
       '--gin.__main__.train.train_eval_dataset_cfg=None',
       f'--gin.TASK_FEATURE_LENGTHS={LENGTHS}')
  return model_dir


@needs_t5x
def test_t5x_trains_on_the_real_mixture(prepared, t5x_run):
  """t5x.train starts (the model's and the tasks' SentencePiece
  vocabularies match) and saves step 2; its config records the mixture and
  the gin-set model file."""
  assert (t5x_run / 'checkpoint_2').is_dir()
  _config_records(t5x_run / 'config.gin', prepared[1])


@needs_t5x
def test_t5x_eval_and_summary_of_the_16_tasks(prepared, t5x_run, tmp_path):
  """t5x.eval decodes every validation example of the 17 evaluation tasks;
  `hyperprompt_jax.eval --metrics_dir` scores the 16 tasks."""
  data_dir, spm_model = prepared
  out = tmp_path / 'eval'
  _run('t5x.eval', *T5X_GIN, '--gin_file=t5x/eval.gin', *SETUP,
       f'--tfds_data_dir={data_dir}', _vocab(spm_model),
       f"--gin.CHECKPOINT_PATH='{t5x_run / 'checkpoint_2'}'",
       "--gin.utils.RestoreCheckpointConfig.mode='specific'",
       f"--gin.EVAL_OUTPUT_DIR='{out}'", '--gin.EVAL_BATCH_SIZE=4',
       f'--gin.TASK_FEATURE_LENGTHS={LENGTHS}')
  _check_validation_inferences(out, spm_model, 2)
  metrics = sorted(p.name[:-len('-metrics.jsonl')]
                   for p in (out / 'inference_eval').glob('*-metrics.jsonl'))
  assert metrics == sorted(VALIDATION_EXAMPLES)
  summary_dir = tmp_path / 'summary'
  stdout = _run('hyperprompt_jax.eval', f'--metrics_dir={out}',
                f'--output_dir={summary_dir}')
  _check_summary(summary_dir, stdout, 2)


@needs_t5x
def test_t5x_checkpoint_writes_the_17_server_files(prepared, t5x_run,
                                                   tmp_path):
  """leaderboard reads the t5x checkpoint and writes the same 17 files."""
  data_dir, spm_model = prepared
  _leaderboard(t5x_run / 'checkpoint_2', tmp_path / 'out', data_dir,
               spm_model)
  _check_server_files(tmp_path / 'out')
