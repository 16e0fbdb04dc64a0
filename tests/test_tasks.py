"""seqio tasks (GLUE half): T5's strings, postprocessors, metrics, task ids,
the feature converter, mixtures, fixtures and the TFDS source.

Expected strings and values are written by hand from T5's source
(`t5/data/preprocessors.py`, `postprocessors.py`, `evaluation/metrics.py`,
`glue_utils.py`) and from the papers' tables, never read from our code.
"""

import collections
import os
import time
from unittest import mock

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from hyperprompt_jax import tasks
from hyperprompt_jax.tasks import features
from hyperprompt_jax.tasks import fixture_data
from hyperprompt_jax.tasks import glue
from hyperprompt_jax.tasks import metrics
from hyperprompt_jax.tasks import scores
from hyperprompt_jax.tasks import sources
from hyperprompt_jax.tasks import task_ids
import seqio_helpers
import tfds_sources

LENGTHS = {'inputs': 128, 'targets': 16}
GLUE_IDS = {'cola': 0, 'sst2': 1, 'mrpc': 2, 'stsb': 3, 'qqp': 4, 'mnli': 5,
            'qnli': 6, 'rte': 7}


@pytest.fixture(autouse=True)
def _clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


# ------------------------------------------------------------ T5's strings --

@pytest.mark.parametrize('task,raw,inputs,targets', [
    ('glue_cola', {'sentence': 'John arrived.', 'label': 1, 'idx': 4},
     'cola sentence: John arrived.', 'acceptable'),
    ('glue_cola', {'sentence': 'Arrived John the.', 'label': 0, 'idx': 5},
     'cola sentence: Arrived John the.', 'unacceptable'),
    ('glue_sst2', {'sentence': 'a gorgeous film', 'label': 1, 'idx': 0},
     'sst2 sentence: a gorgeous film', 'positive'),
    ('glue_mrpc', {'sentence1': 'He said hi.', 'sentence2': 'He greeted.',
                   'label': 1, 'idx': 0},
     'mrpc sentence1: He said hi. sentence2: He greeted.', 'equivalent'),
    ('glue_qqp', {'question1': 'Why do I easily get bored of my friends?',
                  'question2': 'Why do I get bored of friends so quickly?',
                  'label': 1, 'idx': 10},
     'qqp question1: Why do I easily get bored of my friends? question2: '
     'Why do I get bored of friends so quickly?', 'duplicate'),
    # T5 sorts MNLI's features by name: hypothesis before premise.
    ('glue_mnli', {'premise': 'A dog runs.', 'hypothesis': 'A cat sleeps.',
                   'label': 2, 'idx': 0},
     'mnli hypothesis: A cat sleeps. premise: A dog runs.', 'contradiction'),
    ('glue_mnli_matched', {'premise': 'P.', 'hypothesis': 'H.', 'label': 1,
                           'idx': 0},
     'mnli hypothesis: H. premise: P.', 'neutral'),
    ('glue_mnli_mismatched', {'premise': 'P.', 'hypothesis': 'H.',
                              'label': 0, 'idx': 0},
     'mnli hypothesis: H. premise: P.', 'entailment'),
    ('glue_qnli', {'question': 'Who ran?', 'sentence': 'Ann sat.',
                   'label': 1, 'idx': 0},
     'qnli question: Who ran? sentence: Ann sat.', 'not_entailment'),
    ('glue_rte', {'sentence1': 'A b.', 'sentence2': 'C d.', 'label': 0,
                  'idx': 0},
     'rte sentence1: A b. sentence2: C d.', 'entailment'),
    # Unlabeled (test split) examples get T5's '<unk>' target.
    ('glue_rte', {'sentence1': 'A b.', 'sentence2': 'C d.', 'label': -1,
                  'idx': 0},
     'rte sentence1: A b. sentence2: C d.', '<unk>'),
    # STS-B: the score rounded to the nearest 0.2, one decimal.
    ('glue_stsb', {'sentence1': 'Three more US soldiers killed in Afghanistan',
                   'sentence2': 'NATO Soldier Killed in Afghanistan',
                   'label': np.float32(1.8), 'idx': 0},
     'stsb sentence1: Three more US soldiers killed in Afghanistan '
     'sentence2: NATO Soldier Killed in Afghanistan', '1.8'),
    ('glue_stsb', {'sentence1': 'a', 'sentence2': 'b',
                   'label': np.float32(2.53), 'idx': 0},
     'stsb sentence1: a sentence2: b', '2.6'),
    ('glue_stsb', {'sentence1': 'a', 'sentence2': 'b',
                   'label': np.float32(5.0), 'idx': 0},
     'stsb sentence1: a sentence2: b', '5.0'),
])
def test_t5_text_format(task, raw, inputs, targets):
  raw = {k: np.int64(v) if k == 'label' and isinstance(v, int) else v
         for k, v in raw.items()}
  raw['idx'] = np.int32(raw['idx'])
  (ex,) = seqio_helpers.text_examples(task, raw)
  assert ex['inputs'] == inputs
  assert ex['targets'] == targets
  assert ex['idx'] == raw['idx']


@pytest.mark.parametrize('task,text,value', [
    ('glue_cola', 'acceptable', 1), ('glue_cola', 'unacceptable', 0),
    ('glue_cola', 'acceptable!', -1), ('glue_mnli_matched', 'contradiction', 2),
    ('glue_qqp', 'duplicate', 1), ('glue_rte', 'not_entailment', 1),
    ('glue_stsb', '3.4', 3.4), ('glue_stsb', 'similar', -1.0),
])
def test_postprocessors(task, text, value):
  postprocess = seqio.get_mixture_or_task(task).postprocess_fn
  assert postprocess(text, example={}, is_target=False) == value


# ---------------------------------------------------------------- metrics --

def test_metrics_on_hand_computed_cases():
  # Pearson: deviations (-1.5,-.5,.5,1.5) and (-1.5,.5,-.5,1.5): 4 / 5.
  t, p = [1., 2., 3., 4.], [1., 3., 2., 4.]
  assert metrics.pearson_corrcoef(t, p) == {
      'pearson_corrcoef': pytest.approx(80.0)}
  assert metrics.spearman_corrcoef(t, p) == {
      'spearman_corrcoef': pytest.approx(80.0)}
  # MRPC F1: the invalid prediction (-1, unparseable text) counts as wrong:
  # predictions (1,0,0,1,0) vs (1,1,0,0,1): TP 1, FP 1, FN 2 -> 2/5.
  targets, predictions = [1, 1, 0, 0, 1], [1, 0, 0, 1, -1]
  assert metrics.f1_score_with_invalid(targets, predictions) == {
      'f1': pytest.approx(40.0)}
  assert metrics.accuracy(targets, predictions) == {
      'accuracy': pytest.approx(40.0)}
  # CoLA Matthews: TP 1, TN 2, FP 0, FN 1 -> 2 / sqrt(1*2*2*3).
  assert metrics.matthews_corrcoef([1, 1, 0, 0], [1, 0, 0, 0]) == {
      'matthews_corrcoef': pytest.approx(100 * 2 / np.sqrt(12))}


def test_glue_tasks_use_t5s_metrics():
  names = {t: sorted(k for fn in seqio.get_mixture_or_task(t).metric_fns
                     for k in fn([0, 1, 1, 0], [0, 1, 0, 0]))
           for t in ('glue_cola', 'glue_sst2', 'glue_mrpc', 'glue_qqp',
                     'glue_mnli_matched', 'glue_qnli', 'glue_rte')}
  assert names == {
      'glue_cola': ['matthews_corrcoef'], 'glue_sst2': ['accuracy'],
      'glue_mrpc': ['accuracy', 'f1'], 'glue_qqp': ['accuracy', 'f1'],
      'glue_mnli_matched': ['accuracy'], 'glue_qnli': ['accuracy'],
      'glue_rte': ['accuracy']}
  stsb = seqio.get_mixture_or_task('glue_stsb').metric_fns
  assert sorted(k for fn in stsb for k in fn([1., 2., 3.], [1., 2., 4.])) == [
      'pearson_corrcoef', 'spearman_corrcoef']


# ------------------------------------------------------ benchmark averages --

# HyperPrompt Table 8 (GLUE, T5 Base; Appendix A.4), printed AVG last.
TABLE_8 = {
    'MTL': ([49.8, 94.6, (92.5, 89.8), (90.7, 90.5), (89.2, 91.9),
             (88.8, 88.5), 93.3, 85.0], 85.5),
    'Vanilla Adapter': ([60.0, 95.4, (92.7, 89.8), (90.2, 90.2), (89.3, 91.9),
                         (88.5, 88.1), 93.5, 84.4], 86.7),
    'Share': ([56.2, 94.7, (93.0, 90.4), (90.6, 90.4), (89.2, 91.9),
               (88.7, 88.4), 93.4, 85.2], 86.4),
    'Sep': ([57.2, 94.6, (93.8, 91.4), (91.0, 90.8), (89.2, 91.9),
             (88.5, 88.4), 93.4, 86.6], 86.8),
    'Global': ([57.0, 95.2, (93.4, 90.9), (90.4, 90.2), (89.2, 92.0),
                (88.7, 88.5), 93.4, 87.1], 86.8),
}


def _seqio_results(row) -> dict:
  """A Table 8 row as seqio's evaluator reports it, task by task."""
  cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte = row
  return {
      'glue_cola': {'matthews_corrcoef': cola},
      'glue_sst2': {'accuracy': sst2},
      'glue_mrpc': {'f1': mrpc[0], 'accuracy': mrpc[1]},
      'glue_stsb': {'pearson_corrcoef': stsb[0],
                    'spearman_corrcoef': stsb[1]},
      'glue_qqp': {'f1': qqp[0], 'accuracy': qqp[1]},
      'glue_mnli_matched': {'accuracy': mnli[0]},
      'glue_mnli_mismatched': {'accuracy': mnli[1]},
      'glue_qnli': {'accuracy': qnli},
      'glue_rte': {'accuracy': rte},
  }


@pytest.mark.parametrize('model', sorted(TABLE_8))
def test_glue_average_reproduces_table_8(model):
  row, printed = TABLE_8[model]
  assert scores.benchmark_average(_seqio_results(row), 'glue') == (
      pytest.approx(printed, abs=0.05))


def test_mnli_is_scored_as_one_task():
  per_task = scores.task_scores(_seqio_results(TABLE_8['MTL'][0]))
  assert sorted(per_task) == sorted(task_ids.GLUE_TASKS)
  assert per_task['glue_mnli'] == pytest.approx((88.8 + 88.5) / 2)
  assert per_task['glue_mrpc'] == pytest.approx((92.5 + 89.8) / 2)
  results = _seqio_results(TABLE_8['MTL'][0])
  del results['glue_rte']
  with pytest.raises(ValueError, match='glue_rte'):
    scores.benchmark_average(results, 'glue')


# ------------------------------------------------------------- task ids --

def test_task_list_order_and_aliases():
  assert task_ids.run_task_list() == tuple(
      f'glue_{t}' for t in GLUE_IDS)
  assert task_ids.task_id('glue_mnli_matched') == 5
  assert task_ids.task_id('fixture_glue_mnli_mismatched') == 5
  joint = task_ids.run_task_list('glue_super_glue')
  assert joint[:8] == task_ids.run_task_list('glue')
  assert joint[8:] == (
      'super_glue_boolq', 'super_glue_cb', 'super_glue_copa',
      'super_glue_multirc', 'super_glue_record', 'super_glue_rte',
      'super_glue_wic', 'super_glue_wsc')
  for alias in ('dpr_simple', 'super_glue_wsc_simple_train',
                'fixture_dpr_simple'):
    assert task_ids.task_id(alias, joint) == 15
  assert task_ids.task_id('super_glue_boolq',
                          task_ids.run_task_list('super_glue')) == 0


def test_task_not_in_run_list_is_a_clear_error():
  gin.bind_parameter('run_task_list.benchmark', 'super_glue')
  with pytest.raises(ValueError, match=r"benchmark = 'glue'"):
    task_ids.task_id('glue_cola')
  with pytest.raises(ValueError, match='did you mean glue_cola'):
    task_ids.task_id('glue_colaa', task_ids.run_task_list('glue'))


def test_num_tasks_smaller_than_task_list_fails():
  task_ids.check_num_tasks(8)
  task_ids.check_num_tasks(16, task_ids.run_task_list('glue_super_glue'))
  with pytest.raises(ValueError, match=r'NUM_TASKS=8 .*16 tasks.*NUM_TASKS=16'):
    task_ids.check_num_tasks(8, task_ids.run_task_list('glue_super_glue'))


def _examples(name, split):
  return seqio_helpers.examples(name, split, LENGTHS)


@pytest.mark.parametrize('benchmark', ['glue', 'glue_super_glue'])
def test_every_example_carries_its_task_id(benchmark):
  gin.bind_parameter('run_task_list.benchmark', benchmark)
  for spec in glue.GLUE:
    split = 'train' if spec.rate else 'validation'
    ids = {int(ex['task_ids']) for ex in _examples(spec.fixture_name, split)}
    assert ids == {GLUE_IDS[spec.fixture[len('glue_'):]]}, spec.name


@pytest.fixture
def user_task():
  """Registers a user task into fixture_glue_proportional; undoes it."""
  mixture = seqio.MixtureRegistry.get('fixture_glue_proportional')
  rates = dict(mixture.rate_per_task_name)
  source = seqio.FunctionDataSource(
      lambda split, shuffle_files, seed=None: tf.data.Dataset.from_tensors(
          {'text': 'my text', 'label': 'yes'}).repeat(5),
      splits=('train', 'validation'))
  task = tasks.add_task(
      'my_user_task', source=source,
      preprocessors=[
          lambda ds: ds.map(lambda x: {'inputs': x['text'],
                                       'targets': x['label']}),
          seqio.preprocessors.tokenize,
          seqio.CacheDatasetPlaceholder(),
          seqio.preprocessors.append_eos_after_trim],
      output_features=tasks.FIXTURE_OUTPUT_FEATURES,
      metric_fns=[metrics.accuracy],
      mixtures={'fixture_glue_proportional': 7.0})
  yield task
  seqio.TaskRegistry.remove('my_user_task')
  task_ids._APPENDED.remove('my_user_task')  # pylint: disable=protected-access
  seqio.MixtureRegistry.remove('fixture_glue_proportional')
  tasks.add_mixture('fixture_glue_proportional', list(rates.items()))


def test_appending_a_task_keeps_ids_and_joins_the_mixture(user_task):
  before = {t: i for i, t in enumerate(task_ids.BENCHMARKS['glue_super_glue'])}
  joint = task_ids.run_task_list('glue_super_glue')
  assert {t: task_ids.task_id(t, joint) for t in before} == before
  assert task_ids.task_id('my_user_task', joint) == 16
  assert task_ids.run_task_list('glue')[8] == 'my_user_task'
  # In a GLUE run (the default list) it is task 8; its examples say so.
  assert {int(ex['task_ids']) for ex in
          _examples('my_user_task', 'train')} == {8}
  mixture = seqio.get_mixture_or_task('fixture_glue_proportional')
  assert isinstance(mixture, tasks.TaskIdsMixture)
  assert mixture.get_rate(user_task) == 7.0
  assert mixture.get_rate(
      seqio.get_mixture_or_task('fixture_glue_cola')) == 400.0
  with pytest.raises(ValueError, match='NUM_TASKS=8'):
    task_ids.check_num_tasks(8)


def test_alias_task_shares_the_id():
  task_ids.append_task('my_rte_extra', alias_of='glue_rte')
  try:
    assert task_ids.task_id('my_rte_extra') == 7
    assert task_ids.run_task_list() == task_ids.GLUE_TASKS
  finally:
    del task_ids.ALIASES['my_rte_extra']


# ------------------------------------------------------------- mixtures --

def test_mixture_rates_are_training_set_sizes():
  # TFDS glue 2.0.0 training-set sizes (T5's GLUE_WEIGHT_MAPPING, QQP from
  # the 2.0.0 source); the MNLI evaluation tasks ride along at rate 0.
  expected = {
      'glue_cola': 8_551, 'glue_sst2': 67_349, 'glue_mrpc': 3_668,
      'glue_stsb': 5_749, 'glue_qqp': 363_846, 'glue_mnli': 392_702,
      'glue_qnli': 104_743, 'glue_rte': 2_490, 'glue_mnli_matched': 0,
      'glue_mnli_mismatched': 0}
  mixture = seqio.get_mixture_or_task('glue_proportional')
  assert {t.name: mixture.get_rate(t) for t in mixture.tasks} == expected
  fixture = seqio.get_mixture_or_task('fixture_glue_proportional')
  root = sources.FIXTURES_DIR
  for t in fixture.tasks:
    folder = 'glue_mnli' if 'mnli' in t.name else t.name[len('fixture_'):]
    with open(os.path.join(root, folder, 'train.jsonl')) as f:
      lines = sum(1 for _ in f)
    want = 0 if t.name.endswith('matched') else lines
    assert fixture.get_rate(t) == want, t.name


def test_mixture_batches_pass_the_converter_with_task_ids():
  ds = seqio.get_dataset(
      'fixture_glue_proportional', LENGTHS, dataset_split='train',
      shuffle=True, seed=3, batch_size=8,
      feature_converter=tasks.TaskIdsEncDecFeatureConverter())
  seen = collections.Counter()
  for batch in ds.take(25).as_numpy_iterator():
    assert batch['task_ids'].shape == (8,)
    assert batch['task_ids'].dtype == np.int32
    assert batch['encoder_input_tokens'].shape == (8, 128)
    assert batch['decoder_target_tokens'].shape == (8, 16)
    seen.update(batch['task_ids'].tolist())
  assert set(seen) == set(range(8))  # all eight tasks, by id


def test_converter_takes_lengths_without_task_ids():
  ds = seqio.get_mixture_or_task('fixture_glue_rte').get_dataset(
      LENGTHS, split='validation', shuffle=False)
  # t5x's evaluator passes the task's lengths, which have no 'task_ids'.
  conv = tasks.TaskIdsEncDecFeatureConverter(pack=False)
  ex = next(iter(conv(ds, LENGTHS).as_numpy_iterator()))
  assert ex['task_ids'] == 7 and ex['task_ids'].shape == ()
  assert conv.get_model_feature_lengths(LENGTHS)['encoder_input_tokens'] == 128
  # Packed rows carry per-token ids instead (tests/test_packing.py).
  assert 'encoder_task_ids' in tasks.TaskIdsEncDecFeatureConverter(
      pack=True).get_model_feature_lengths(LENGTHS)


def test_plain_seqio_mixture_dropping_ids_is_a_clear_error():
  seqio.MixtureRegistry.add('plain_mix', [('fixture_glue_rte', 1.0)])
  try:
    ds = seqio.get_mixture_or_task('plain_mix').get_dataset(
        LENGTHS, split='train', shuffle=False)
    with pytest.raises(ValueError, match='add_mixture'):
      tasks.TaskIdsEncDecFeatureConverter()(ds, LENGTHS)
  finally:
    seqio.MixtureRegistry.remove('plain_mix')


# ------------------------------------------------------------- fixtures --

def test_shipped_fixtures_equal_the_generator():
  for folder, splits in fixture_data.generate().items():
    for split, examples in splits.items():
      path = os.path.join(sources.FIXTURES_DIR, folder, f'{split}.jsonl')
      with open(path) as f:
        assert f.read() == fixture_data.to_jsonl(examples), path


def test_fixtures_have_balanced_classes_and_tfds_schema():
  for task in glue.GLUE:
    name = task.fixture_name
    split = 'train' if task.rate else 'validation'
    exs = _examples(name, split)
    assert 100 <= len(exs) <= 1000
    raw = seqio.get_mixture_or_task(name).source.get_dataset(split)
    spec = raw.element_spec
    assert spec['idx'].dtype == tf.int32
    if task.label_names is None:
      assert spec['label'].dtype == tf.float32
      continue
    assert spec['label'].dtype == tf.int64
    counts = collections.Counter(ex['targets_pretokenized'] for ex in exs)
    assert sorted(counts) == sorted(n.encode() for n in task.label_names)
    majority = max(counts.values()) / len(exs)
    assert majority <= 1 / len(task.label_names) + 0.02, name


def test_fixture_source_shards_for_multi_host_input():
  source = seqio.get_mixture_or_task('fixture_glue_cola').source
  shards = [list(source.get_dataset(
      'train', shard_info=seqio.ShardInfo(index=i, num_shards=3))
                 .as_numpy_iterator()) for i in range(3)]
  assert [len(s) for s in shards] == [134, 133, 133]
  idx = sorted(int(ex['idx']) for s in shards for ex in s)
  assert idx == list(range(400))  # disjoint and complete


# ------------------------------------------------------------ TFDS source --

def test_missing_tfds_dataset_fails_fast_with_the_fix(tmp_path):
  gin.bind_parameter('tfds_data_dir.data_dir', str(tmp_path))
  start = time.time()
  with pytest.raises(FileNotFoundError) as e:
    seqio.get_mixture_or_task('glue_qnli').get_dataset(
        LENGTHS, split='validation')
  # No download retries: a real tfds.load without data takes minutes.
  assert time.time() - start < 10
  msg = str(e.value)
  assert 'glue/qnli:2.0.0' in msg and str(tmp_path) in msg
  assert 'python -m hyperprompt_jax.prepare_data' in msg
  assert 'TFDS_DATA_DIR' in msg


@pytest.fixture(scope='module')
def prepared_rte(tmp_path_factory):
  """glue/rte:2.0.0 prepared by the real TFDS builder from GLUE-format TSVs
  (the download is replaced by a local folder), plus a tiny SentencePiece
  model standing in for T5's."""
  root = tmp_path_factory.mktemp('tfds')
  rows = list(tfds_sources.RTE_ROWS)
  data_dir = root / 'data'
  builder = tfds.builder('glue/rte:2.0.0', data_dir=str(data_dir))
  with mock.patch.object(tfds.download.DownloadManager,
                         'download_and_extract',
                         return_value=tfds_sources.rte_download(root)):
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  corpus = root / 'corpus.txt'
  corpus.write_text('\n'.join(rows * 20) + '\nrte sentence1: sentence2:\n')
  spm.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(root / 'spm'), vocab_size=60,
      model_type='unigram', pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
      hard_vocab_limit=False)
  return str(data_dir), str(root / 'spm.model')


def test_prepared_tfds_task_reads_with_gin_data_dir_and_vocab(prepared_rte):
  data_dir, spm_model = prepared_rte
  gin.bind_parameter('tfds_data_dir.data_dir', data_dir)
  gin.bind_parameter('sentencepiece_model_file.path', spm_model)
  task = seqio.get_mixture_or_task('glue_rte')
  train = list(task.get_dataset(LENGTHS, split='train', shuffle=False)
               .as_numpy_iterator())
  assert sorted((ex['inputs_pretokenized'], ex['targets_pretokenized'])
                for ex in train) == [
      (b'rte sentence1: Dana sleeps in the park. sentence2: Dana sleeps.',
       b'entailment'),
      (b'rte sentence1: The cat runs home. sentence2: The dog runs.',
       b'not_entailment')]
  assert {int(ex['task_ids']) for ex in train} == {7}
  vocab = task.output_features['targets'].vocabulary
  assert vocab.sentencepiece_model_file == spm_model
  for ex in train:  # Tokenized with the gin-set model, EOS appended.
    assert vocab.decode(ex['targets'][:-1].tolist()) == (
        ex['targets_pretokenized'].decode())
    assert ex['targets'][-1] == 1
  test = list(task.get_dataset(LENGTHS, split='test', shuffle=False)
              .as_numpy_iterator())
  assert [ex['targets_pretokenized'] for ex in test] == [b'<unk>']


def test_sentencepiece_vocabularies_match_whatever_their_load_state(
    prepared_rte, tmp_path):
  """The task's vocabulary (loaded by reading data) and the model's (built
  by gin, never loaded) name the same file: seqio and t5x compare them by
  state, and t5x.train refuses to start when they differ."""
  data_dir, spm_model = prepared_rte
  gin.bind_parameter('tfds_data_dir.data_dir', data_dir)
  gin.bind_parameter('sentencepiece_model_file.path', spm_model)
  task = seqio.get_mixture_or_task('glue_rte')
  next(iter(task.get_dataset(LENGTHS, split='train', shuffle=False)))
  loaded = task.output_features['targets'].vocabulary
  assert loaded.vocab_size < 1000  # loaded, from the gin-set file (not T5's)
  fresh = features.GinSentencePieceVocabulary()
  assert loaded == fresh and fresh == loaded
  plain = seqio.SentencePieceVocabulary(spm_model, extra_ids=100)
  assert loaded == plain and fresh == plain
  assert fresh != features.GinSentencePieceVocabulary(extra_ids=10)
  assert fresh != seqio.SentencePieceVocabulary(str(tmp_path / 'other.model'),
                                                extra_ids=100)
  try:
    from t5x import utils as t5x_utils  # pylint: disable=g-import-not-at-top
  except ImportError:
    return  # t5x's own check below runs where t5x is installed
  config = t5x_utils.DatasetConfig(
      mixture_or_task_name='glue_rte', task_feature_lengths=LENGTHS,
      split='train', batch_size=2, shuffle=False, seed=0)
  model = mock.Mock(input_vocabulary=fresh, output_vocabulary=fresh)
  t5x_utils.verify_matching_vocabs(config, model)  # raises on a mismatch


def test_seqio_data_dir_override_wins(prepared_rte, tmp_path):
  data_dir, _ = prepared_rte
  gin.bind_parameter('tfds_data_dir.data_dir', str(tmp_path))  # empty
  seqio.set_tfds_data_dir_override(data_dir)  # what t5x's flag does
  try:
    assert sources.resolve_tfds_data_dir() == data_dir
    src = seqio.get_mixture_or_task('glue_rte').source
    assert src.num_input_examples('validation') == 1
  finally:
    seqio.set_tfds_data_dir_override(None)


# -------------------------------------------------------------------- gin --

@pytest.mark.parametrize('name,mixture,num_tasks,vocab', [
    ('glue', 'glue_proportional', 8, 'spm'),
    ('super_glue', 'super_glue_proportional', 8, 'spm'),
    ('glue_super_glue', 'glue_super_glue_proportional', 16, 'spm'),
    ('fixture_glue', 'fixture_glue_proportional', 8, 'bytes'),
    ('fixture_super_glue', 'fixture_super_glue_proportional', 8, 'bytes'),
    ('fixture_glue_super_glue', 'fixture_glue_super_glue_proportional', 16,
     'bytes'),
])
def test_task_gin_files(name, mixture, num_tasks, vocab):
  from hyperprompt_jax.common import gin_utils  # pylint: disable=g-import-not-at-top
  gin_utils.parse_gin(['models/t5_1_1_tiny.gin',
                       'variants/hyperprompt_share.gin', f'tasks/{name}.gin'],
                      [], [])
  assert gin.query_parameter('%MIXTURE_OR_TASK_NAME') == mixture
  assert gin.query_parameter('%NUM_TASKS') == num_tasks
  task_list = task_ids.run_task_list()
  assert len(task_list) == num_tasks
  task_ids.check_num_tasks(num_tasks)
  provider = seqio.get_mixture_or_task(mixture)
  for task in provider.tasks:  # every task of the mixture has an id
    assert 0 <= task_ids.task_id(task.name) < num_tasks
  vocabulary = provider.output_features['targets'].vocabulary
  assert isinstance(vocabulary, seqio.ByteVocabulary) == (vocab == 'bytes')


def test_refused_task_leaves_nothing_registered():
  source = seqio.FunctionDataSource(
      lambda split, shuffle_files, seed=None: tf.data.Dataset.range(1),
      splits=('train',))
  with pytest.raises(ValueError, match='not a known task'):
    tasks.add_task('my_bad_alias', source=source, preprocessors=[],
                   output_features=tasks.FIXTURE_OUTPUT_FEATURES,
                   alias_of='glue_nonexistent')
  assert 'my_bad_alias' not in seqio.TaskRegistry.names()
  assert 'my_bad_alias' not in task_ids.ALIASES


# ------------------------------------------------ refused user registrations --

def _small_task_kwargs():
  source = seqio.FunctionDataSource(
      lambda split, shuffle_files, seed=None: tf.data.Dataset.from_tensors(
          {'inputs': 'a', 'targets': 'b'}),
      splits=('train', 'validation'))
  return dict(source=source, preprocessors=[seqio.preprocessors.tokenize],
              output_features=tasks.FIXTURE_OUTPUT_FEATURES)


@pytest.fixture
def restore_fixture_mixture():
  """Puts fixture_glue_proportional and the task registry back as they were."""
  mixture = seqio.MixtureRegistry.get('fixture_glue_proportional')
  appended = list(task_ids._APPENDED)  # pylint: disable=protected-access
  before = set(seqio.TaskRegistry.names())
  yield mixture
  for name in set(seqio.TaskRegistry.names()) - before:
    seqio.TaskRegistry.remove(name)
  task_ids._APPENDED[:] = appended  # pylint: disable=protected-access
  seqio.MixtureRegistry.remove('fixture_glue_proportional')
  seqio.MixtureRegistry.add_provider('fixture_glue_proportional', mixture)


def test_add_task_with_a_mixture_typo_registers_nothing_and_can_be_retried(
    restore_fixture_mixture):
  rates = dict(restore_fixture_mixture.rate_per_task_name)
  with pytest.raises(ValueError, match='did you mean fixture_glue_proportional'):
    tasks.add_task('my_retried_task', **_small_task_kwargs(),
                   mixtures={'fixture_glue_proportional': 3.0,
                             'fixture_glue_proportionl': 3.0})
  assert 'my_retried_task' not in seqio.TaskRegistry.names()
  assert 'my_retried_task' not in task_ids.known_tasks()
  assert seqio.MixtureRegistry.get(
      'fixture_glue_proportional').rate_per_task_name == rates

  tasks.add_task('my_retried_task', **_small_task_kwargs(),
                 mixtures={'fixture_glue_proportional': 3.0})
  mixture = seqio.MixtureRegistry.get('fixture_glue_proportional')
  assert mixture.rate_per_task_name['my_retried_task'] == 3.0
  assert task_ids.known_tasks()[-1] == 'my_retried_task'


def test_add_task_refused_by_the_mixture_leaves_nothing(
    restore_fixture_mixture):
  # A task whose features differ from the mixture's: seqio refuses the
  # mixture after the task is registered; both are undone.
  kwargs = _small_task_kwargs()
  kwargs['output_features'] = {'inputs': tasks.FIXTURE_OUTPUT_FEATURES[
      'inputs']}
  with pytest.raises(ValueError, match='different output features'):
    tasks.add_task('my_odd_task', **kwargs,
                   mixtures={'fixture_glue_proportional': 3.0})
  assert 'my_odd_task' not in seqio.TaskRegistry.names()
  assert 'my_odd_task' not in task_ids.known_tasks()
  assert seqio.MixtureRegistry.get(
      'fixture_glue_proportional') is restore_fixture_mixture


_BAD_RATES = [-1, 0, 0.0, float('nan'), float('inf'), '10', True, None]


@pytest.mark.parametrize('rate', _BAD_RATES, ids=repr)
def test_bad_rates_are_refused_naming_the_task_rate_and_fix(
    rate, restore_fixture_mixture):
  def check(call):
    with pytest.raises(ValueError) as info:
      call()
    message = str(info.value)
    assert "'my_rated_task'" in message and repr(rate) in message
    assert 'positive' in message and 'EVAL_ONLY' in message

  check(lambda: tasks.add_task(
      'my_rated_task', **_small_task_kwargs(),
      mixtures={'fixture_glue_proportional': rate}))
  assert 'my_rated_task' not in seqio.TaskRegistry.names()

  tasks.add_task('my_rated_task', **_small_task_kwargs())
  check(lambda: tasks.add_to_mixture('fixture_glue_proportional',
                                     'my_rated_task', rate))
  assert seqio.MixtureRegistry.get(
      'fixture_glue_proportional') is restore_fixture_mixture
  check(lambda: tasks.add_mixture('my_rated_mixture',
                                  [('my_rated_task', rate)]))
  assert 'my_rated_mixture' not in seqio.MixtureRegistry.names()


def test_evaluation_only_tasks_join_a_mixture_at_eval_only():
  tasks.add_mixture('my_eval_mixture',
                    [('fixture_glue_rte', 2.0),
                     ('fixture_glue_mnli_matched',
                      tasks.registration.EVAL_ONLY)])
  try:
    mixture = seqio.MixtureRegistry.get('my_eval_mixture')
    rte, matched = sorted(mixture.tasks, key=lambda t: t.name)[::-1]
    assert (mixture.get_rate(rte), mixture.get_rate(matched)) == (2.0, 0.0)
  finally:
    seqio.MixtureRegistry.remove('my_eval_mixture')


def test_training_split_of_a_mixture_with_evaluation_only_tasks_is_quiet(
    caplog):
  def no_split_warnings(mixture):
    caplog.clear()
    with caplog.at_level('WARNING'):
      seqio.MixtureRegistry.get(mixture).get_dataset(
          LENGTHS, split='train', shuffle=False)
    return [r.getMessage() for r in caplog.records
            if "has no 'train' split" in r.getMessage()]

  # MNLI matched / mismatched are evaluation-only: no training split.
  assert not no_split_warnings('fixture_glue_proportional')
  # A task that should train but has no training split still warns.
  tasks.add_mixture('my_loud_mixture', [('fixture_glue_rte', 2.0),
                                        ('fixture_super_glue_wsc', 1.0)])
  try:
    assert no_split_warnings('my_loud_mixture') == [
        "Task fixture_super_glue_wsc has no 'train' split, skipping."]
  finally:
    seqio.MixtureRegistry.remove('my_loud_mixture')
