"""seqio tasks (SuperGLUE half): T5's strings, postprocessors and metrics,
WSC's training variants, the SuperGLUE / joint mixtures and fixtures.

Expected values are written by hand from T5's source and the papers' tables.
"""

import collections

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf

from hyperprompt_jax import tasks
from hyperprompt_jax.tasks import metrics
from hyperprompt_jax.tasks import scores
from hyperprompt_jax.tasks import super_glue
from hyperprompt_jax.tasks import task_ids

import seqio_helpers

LENGTHS = {'inputs': 128, 'targets': 16}


@pytest.fixture(autouse=True)
def _joint_task_list():
  gin.clear_config()
  gin.bind_parameter('run_task_list.benchmark', 'glue_super_glue')
  yield
  gin.clear_config()


def _one(task, raw):
  (ex,) = seqio_helpers.text_examples(task, raw)
  return ex


# ------------------------------------------------------------ T5's strings --

@pytest.mark.parametrize('task,raw,inputs,targets', [
    ('super_glue_boolq',
     {'question': 'is the sky blue', 'passage': 'The sky is blue.',
      'label': 1, 'idx': 0},
     'boolq passage: The sky is blue. question: is the sky blue', 'True'),
    ('super_glue_cb', {'premise': 'P.', 'hypothesis': 'H.', 'label': 1,
                       'idx': 0},
     'cb hypothesis: H. premise: P.', 'contradiction'),
    ('super_glue_copa',
     {'premise': 'My body cast a shadow over the grass.',
      'choice1': 'The sun was rising.', 'choice2': 'The grass was cut.',
      'question': 'cause', 'label': 0, 'idx': 0},
     'copa choice1: The sun was rising. choice2: The grass was cut. premise: '
     'My body cast a shadow over the grass. question: cause', 'choice1'),
    ('super_glue_rte', {'premise': 'P.', 'hypothesis': 'H.', 'label': 1,
                        'idx': 0},
     'rte hypothesis: H. premise: P.', 'not_entailment'),
    ('super_glue_wic',
     {'word': 'bank', 'sentence1': 'I sat on the bank.',
      'sentence2': 'The bank lent me money.', 'start1': 13, 'end1': 17,
      'start2': 4, 'end2': 8, 'label': 0, 'idx': 0},
     'wic sentence1: I sat on the bank. sentence2: The bank lent me money. '
     'word: bank', 'False'),
    ('super_glue_boolq', {'question': 'q', 'passage': 'p', 'label': -1,
                          'idx': 0},
     'boolq passage: p question: q', '<unk>'),
])
def test_t5_text_format(task, raw, inputs, targets):
  ex = _one(task, {**raw, 'label': np.int64(raw['label'])})
  assert (ex['inputs'], ex['targets']) == (inputs, targets)


def test_multirc_strips_html_and_keeps_the_three_ids():
  ex = _one('super_glue_multirc', {
      'paragraph': '<b>Sent 1: </b>Tom ran.<br><b>Sent 2: </b>He won.<br>',
      'question': 'Who won?', 'answer': 'Tom', 'label': np.int64(1),
      'idx': {'paragraph': 3, 'question': 7, 'answer': 1}})
  assert ex['inputs'] == ('multirc question: Who won? answer: Tom paragraph: '
                          'Sent 1: Tom ran. Sent 2: He won. ')
  assert ex['targets'] == 'True'
  assert (ex['idx/paragraph'], ex['idx/question'], ex['idx/answer']) == (
      3, 7, 1)


def _record(answers):
  return {
      'passage': 'Obama met Biden.\n@highlight\nThey talked\n@highlight\n'
                 'Biden left',
      'query': '@placeholder was happy.',
      'entities': tf.constant(['Obama', 'Biden']),
      'answers': tf.constant(answers, tf.string),
      'idx': {'passage': 1, 'query': 2}}


RECORD_INPUTS = ('record query: @placeholder was happy. entities: Obama, Biden '
                 'passage: Obama met Biden. They talked. Biden left')


def test_record_makes_one_example_per_answer():
  exs = seqio_helpers.text_examples('super_glue_record',
                                    _record(['Obama', 'Biden']))
  assert [ex['inputs'] for ex in exs] == [RECORD_INPUTS] * 2
  assert [ex['targets'] for ex in exs] == ['Obama', 'Biden']
  for ex in exs:
    assert ex['answers'] == ['Obama', 'Biden']
    assert (ex['idx/passage'], ex['idx/query']) == (1, 2)


def test_record_without_answers_has_one_unk_example():
  exs = seqio_helpers.text_examples('super_glue_record', _record([]))
  assert [(ex['inputs'], ex['targets'], ex['answers']) for ex in exs] == [
      (RECORD_INPUTS, '<unk>', [])]


def _wsc(text, span1, span1_index, span2, span2_index, label):
  return {'text': text, 'span1_text': span1, 'span1_index': span1_index,
          'span2_text': span2, 'span2_index': span2_index,
          'label': np.int64(label), 'idx': 0}


def test_wsc_simple_marks_the_pronoun_and_targets_the_candidate():
  raw = _wsc('Mitchell asked Tom if he could lend some money.', 'Tom', 2,
             'he', 4, 1)
  for task in ('super_glue_wsc', 'super_glue_wsc_simple_train'):
    ex = _one(task, raw)
    assert ex['inputs'] == ('wsc: Mitchell asked Tom if *he* could lend some '
                            'money.')
    assert ex['targets'] == 'Tom'
  # Training keeps only candidates that are the referent; eval keeps all.
  wrong = dict(raw, label=np.int64(0), span1_text='Mitchell')
  assert seqio_helpers.text_examples('super_glue_wsc_simple_train',
                                     wrong) == []
  assert _one('super_glue_wsc', wrong)['targets'] == 'Mitchell'


def test_wsc_special_case_text_from_t5():
  text = ('The boy continued to whip the pony , and eventually the pony threw '
          'him over. John laughed out quite loud. "Good for him," he said. ')
  ex = _one('super_glue_wsc', _wsc(text, 'John', 13, 'him', 17, 0))
  assert ex['inputs'] == (
      'wsc: The boy continued to whip the pony , and eventually the pony '
      'threw him over. John laughed out quite loud. "Good for *him* ," he '
      'said.')


def test_dpr_marks_the_first_pronoun_and_targets_the_referent():
  ex = _one('dpr_simple', {
      'sentence': 'Bob asked Tom if he can lend some money.',
      'pronoun': 'he', 'candidates': tf.constant(['Bob', 'Tom']),
      'label': np.int64(1)})
  assert ex['inputs'] == 'wsc: Bob asked Tom if *he* can lend some money.'
  assert ex['targets'] == 'Tom'


# ---------------------------------------------------------- postprocessors --

def _post(task, text, **example):
  return seqio.get_mixture_or_task(task).postprocess_fn(
      text, example=example, is_target=False)


def test_postprocessors():
  assert _post('super_glue_boolq', 'True') == 1
  assert _post('super_glue_cb', 'neutral') == 2
  assert _post('super_glue_copa', 'choice2') == 1
  multirc = seqio.get_mixture_or_task('super_glue_multirc').postprocess_fn
  assert multirc('True', example={'idx/question': 7}, is_target=True) == {
      'value': 1, 'group': 7}
  assert multirc('Maybe', example={}, is_target=False) == {'value': -1}
  record = seqio.get_mixture_or_task('super_glue_record').postprocess_fn
  assert record('Obama', example={}, is_target=False) == {'value': 'Obama'}
  assert record(b'Obama', example={
      'answers': [b'Obama', b'Barack Obama'], 'idx/passage': 1,
      'idx/query': 2}, is_target=True) == {
          'value': ['Obama', 'Barack Obama'], 'group': (1, 2)}
  wsc = seqio.get_mixture_or_task('super_glue_wsc').postprocess_fn
  ex = {'targets_pretokenized': b'the fuzzy bunny', 'label': 1}
  assert wsc('The bunny', example=ex, is_target=False) == 1  # subset
  assert wsc('a fuzzy bunny rabbit', example=ex, is_target=False) == 1
  assert wsc('the cat', example=ex, is_target=False) == 0
  assert wsc("bunny's", example=ex, is_target=False) == 0  # possessive
  assert wsc(' the ', example=ex, is_target=False) == -1  # nothing left
  assert wsc('whatever', example=ex, is_target=True) == 1


# ----------------------------------------------------------------- metrics --

def test_multirc_grouped_exact_match_and_f1a():
  targets = [{'value': 1, 'group': 0}, {'value': 0, 'group': 0},
             {'value': 1, 'group': 1}, {'value': 1, 'group': 1}]
  predictions = [{'value': 1}, {'value': 0}, {'value': 1}, {'value': 0}]
  got = {}
  for fn in seqio.get_mixture_or_task('super_glue_multirc').metric_fns:
    got.update(fn(targets, predictions))
  # Question 0 all right, question 1 not: EM 50. F1a: TP 2, FN 1 -> 4/5.
  assert got == {'exact_match': pytest.approx(50.0), 'f1': pytest.approx(80.0)}


def test_record_max_over_answers_once_per_query():
  targets = [{'value': ['Obama', 'Barack Obama'], 'group': (0, 0)},
             {'value': ['Obama', 'Barack Obama'], 'group': (0, 0)},
             {'value': ['Biden'], 'group': (0, 1)}]
  predictions = [{'value': 'obama.'}, {'value': 'xyz'},
                 {'value': 'Joe Biden'}]
  (fn,) = seqio.get_mixture_or_task('super_glue_record').metric_fns
  # Query (0, 0) counted once: 'obama' matches 'Obama' (normalised).
  # Query (0, 1): no exact match; token F1 of 'joe biden' vs 'biden' = 2/3.
  assert fn(targets, predictions) == {
      'em': pytest.approx(50.0), 'f1': pytest.approx(100 * (1 + 2 / 3) / 2)}


def test_cb_macro_f1_and_accuracy():
  targets, predictions = [0, 0, 1, 2, 2], [0, 1, 1, 2, 0]
  got = {}
  for fn in seqio.get_mixture_or_task('super_glue_cb').metric_fns:
    got.update(fn(targets, predictions))
  # Per class F1: 1/2, 2/3, 2/3.
  assert got == {'mean_3class_f1': pytest.approx(100 * (0.5 + 4 / 3) / 3),
                 'accuracy': pytest.approx(60.0)}
  assert metrics.mean_multiclass_f1(3)([0, 1, 2], [0, 1, 2]) == {
      'mean_3class_f1': pytest.approx(100.0)}


# ------------------------------------------------------- averages, mixtures --

TABLE_9_MTL = {
    'super_glue_boolq': {'accuracy': 82.6},
    'super_glue_cb': {'mean_3class_f1': 93.4, 'accuracy': 93.5},
    'super_glue_copa': {'accuracy': 65.7},
    'super_glue_multirc': {'f1': 76.7, 'exact_match': 39.7},
    'super_glue_record': {'f1': 80.9, 'em': 80.2},
    'super_glue_rte': {'accuracy': 85.6},
    'super_glue_wic': {'accuracy': 70.5},
    'super_glue_wsc': {'accuracy': 81.4},
}


def test_super_glue_average_reproduces_table_9():
  # (82.6 + 93.45 + 65.7 + 58.2 + 80.55 + 85.6 + 70.5 + 81.4) / 8 = 77.25.
  average = scores.benchmark_average(TABLE_9_MTL, 'super_glue')
  assert average == pytest.approx(77.25, abs=1e-9)
  assert average == pytest.approx(77.2, abs=0.05 + 1e-9)


def test_mixture_rates_are_t5s():
  expected = {
      'dpr_simple': 1_322, 'super_glue_wsc_simple_train': 259,
      'super_glue_wsc': 0, 'super_glue_boolq': 9_427, 'super_glue_cb': 250,
      'super_glue_copa': 400, 'super_glue_multirc': 27_243,
      'super_glue_record': 138_854, 'super_glue_rte': 2_490,
      'super_glue_wic': 5_428}
  mixture = seqio.get_mixture_or_task('super_glue_proportional')
  assert {t.name: mixture.get_rate(t) for t in mixture.tasks} == expected
  joint = seqio.get_mixture_or_task('glue_super_glue_proportional')
  rates = {t.name: joint.get_rate(t) for t in joint.tasks}
  assert len(rates) == 10 + 10
  assert rates['glue_qqp'] == 363_846 and rates['super_glue_record'] == 138_854


def test_wsc_training_variants_carry_wscs_id():
  for name, split in (('fixture_super_glue_wsc', 'validation'),
                      ('fixture_super_glue_wsc_simple_train', 'train'),
                      ('fixture_dpr_simple', 'train')):
    ids = {int(ex['task_ids'])
           for ex in seqio_helpers.examples(name, split, LENGTHS)}
    assert ids == {15}, name
  gin.bind_parameter('run_task_list.benchmark', 'super_glue')
  ids = {int(ex['task_ids']) for ex in seqio_helpers.examples(
      'fixture_dpr_simple', 'train', LENGTHS)}
  assert ids == {7}


@pytest.mark.parametrize('mixture,num_ids', [
    ('fixture_glue_super_glue_proportional', 16),
    ('fixture_super_glue_proportional', 8)])
def test_fixture_mixture_yields_all_task_ids(mixture, num_ids):
  if num_ids == 8:
    gin.bind_parameter('run_task_list.benchmark', 'super_glue')
  ds = seqio.get_dataset(
      mixture, LENGTHS, dataset_split='train', shuffle=True, seed=5,
      batch_size=16, feature_converter=tasks.TaskIdsEncDecFeatureConverter())
  seen = collections.Counter()
  for batch in ds.take(60).as_numpy_iterator():
    assert batch['task_ids'].shape == (16,)
    seen.update(batch['task_ids'].tolist())
  assert set(seen) == set(range(num_ids))


def test_fixtures_are_balanced_and_fit_128_bytes():
  for spec in super_glue.ALL:
    split = 'train' if spec.rate else 'validation'
    exs = seqio_helpers.examples(spec.fixture_name, split)
    assert max(len(ex['inputs']) for ex in exs) <= 128, spec.name
    labels = collections.Counter(ex['targets_pretokenized'] for ex in exs)
    if spec.label_names:
      assert sorted(labels) == sorted(n.encode() for n in spec.label_names)
      assert max(labels.values()) / len(exs) <= (
          1 / len(spec.label_names) + 0.02), spec.name
  assert task_ids.task_id('fixture_super_glue_record') == 12
