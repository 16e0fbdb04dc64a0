"""T5's text-to-text formats for GLUE and SuperGLUE, on seqio.

The strings are T5's exactly (`t5/data/preprocessors.py`: `glue`, `stsb`,
`definite_pronoun_resolution_simple`, `wsc_simple`, `record`), so
scores compare with published numbers. We do not depend on the `t5` package:
the one on the package index is unmaintained and its pins clash with seqio
and tensorflow-datasets.
"""

import functools
from typing import Optional, Sequence

import seqio
import tensorflow as tf

# T5's target for an unlabeled (test-split, label == -1) example.
UNLABELED_TARGET = '<unk>'


def _label_text(label: tf.Tensor, label_names: Sequence[str]) -> tf.Tensor:
  """The label's name; UNLABELED_TARGET for -1."""
  return tf.cond(
      tf.equal(label, -1),
      lambda: tf.constant(UNLABELED_TARGET),
      lambda: tf.gather(tf.constant(list(label_names)), label))


@seqio.map_over_dataset
def glue(x, benchmark_name: str, label_names: Sequence[str],
         feature_names: Optional[Sequence[str]] = None, id_key: str = 'idx'):
  """A GLUE-style classification example -> T5's text pair.

  Example (QQP): {'question1': 'a?', 'question2': 'b?', 'label': 1, 'idx': 3}
  -> {'inputs': 'qqp question1: a? question2: b?', 'targets': 'duplicate',
  'idx': 3}.

  Args:
    x: the TFDS example.
    benchmark_name: the inputs' first word.
    label_names: the targets, by label.
    feature_names: the text features in order; None: sorted by name (so
      MNLI reads "mnli hypothesis: ... premise: ...").
    id_key: the example's id feature, kept as 'idx'.

  Returns:
    {'inputs': "<benchmark> <key1>: <text1> ...", 'targets': the label's
    name, and the id}.
  """
  keys = feature_names or sorted(set(x) - {'label', 'idx'})
  parts = [benchmark_name]
  for key in keys:
    parts += [f'{key}:', x[key]]
  joined = tf.strings.join(parts, separator=' ')
  ex = {}
  if benchmark_name == 'multirc':
    # MultiRC paragraphs carry HTML line breaks and bold markup.
    joined = tf.strings.regex_replace(joined, '<br>', ' ')
    joined = tf.strings.regex_replace(joined, '<(/)?b>', '')
    for part in ('paragraph', 'question', 'answer'):
      ex[f'idx/{part}'] = x['idx'][part]
  elif id_key:
    ex['idx'] = x[id_key]
  ex['inputs'] = joined
  ex['targets'] = _label_text(x['label'], label_names)
  return ex


@seqio.map_over_dataset
def stsb(x):
  """STS-B -> text: the score rounded to the nearest 0.2, printed "3.4".

  T5 turns the regression into a 26-way generation over 0.0, 0.2, ..., 5.0
  (`postprocessors.string_to_float` parses it back).
  """
  joined = tf.strings.join(
      ['stsb sentence1:', x['sentence1'], 'sentence2:', x['sentence2']],
      separator=' ')
  target = tf.as_string(tf.round(x['label'] * 5) / 5, precision=1)
  return {'inputs': joined, 'targets': target, 'idx': x['idx']}


@seqio.map_over_dataset
def definite_pronoun_resolution_simple(x, label: str = 'wsc:'):
  """DPR -> "wsc: <sentence with the first pronoun marked *he*>" -> referent.

  Example: {'sentence': 'Bob asked Tom if he can lend some money.',
  'pronoun': 'he', 'candidates': ['Bob', 'Tom'], 'label': 1} ->
  {'inputs': 'wsc: Bob asked Tom if *he* can lend some money.',
  'targets': 'Tom'}.
  """
  marked = tf.strings.regex_replace(
      x['sentence'],
      tf.strings.join([r' (', x['pronoun'], r')( |\.|,)']),
      r' *\1*\2',
      replace_global=False)
  return {
      'inputs': tf.strings.join([label, marked], separator=' '),
      'targets': x['candidates'][x['label']],
  }


# Two WSC texts whose span2_index does not point at the pronoun; T5 spells
# their blanked form out.
_WSC_SPECIAL_CASES = (
    ('The boy continued to whip the pony , and eventually the pony threw him '
     'over. John laughed out quite loud. "Good for him," he said. ',
     'The boy continued to whip the pony , and eventually the pony threw him '
     'over. John laughed out quite loud. "Good for X ," he said.'),
    ('When they had eventually calmed down a bit , and had gotten home, Mr. '
     'Farley put the magic pebble in an iron safe . Some day they might want '
     'to use it , but really for now, what more could they wish for?',
     'When they had eventually calmed down a bit , and had gotten home, Mr. '
     'Farley put the magic pebble in an iron safe . Some day they might want '
     'to use X , but really for now, what more could they wish for?'),
)


def _wsc_blanked(x) -> tf.Tensor:
  """The WSC text with the pronoun (word `span2_index`) replaced by 'X'."""
  words = tf.strings.split([x['text']], sep=' ').values
  index = x['span2_index']

  def blank():
    with tf.control_dependencies([
        tf.debugging.assert_greater(index, 0),
        tf.debugging.assert_less(index, tf.size(words)),
        tf.debugging.assert_equal(words[index], x['span2_text'])]):
      return tf.strings.join([
          tf.strings.reduce_join(words[:index], separator=' '), 'X',
          tf.strings.reduce_join(words[index + 1:], separator=' ')],
                             separator=' ')

  out = blank
  for text, blanked in reversed(_WSC_SPECIAL_CASES):
    out = functools.partial(
        tf.cond, tf.equal(x['text'], text),
        functools.partial(tf.constant, blanked), out)
  return out()


def wsc_simple(dataset: tf.data.Dataset, label: str = 'wsc:',
               correct_referent_only: bool = False) -> tf.data.Dataset:
  """SuperGLUE WSC -> "wsc: <text with *pronoun*>" -> the candidate referent.

  Example: {'text': 'Mitchell asked Tom if he could lend some money.',
  'span1_text': 'Tom', 'span2_text': 'he', 'span2_index': 4, ...} ->
  {'inputs': 'wsc: Mitchell asked Tom if *he* could lend some money.',
  'targets': 'Tom', 'label': ..., 'idx': ...}.

  Args:
    dataset: TFDS's WSC examples.
    label: the inputs' first word.
    correct_referent_only: keep only examples whose candidate is the
      referent (training); evaluation asks whether the model names the
      candidate (`postprocessors.wsc_simple`).

  Returns:
    The text examples.
  """

  def convert(x):
    marked = tf.strings.regex_replace(
        _wsc_blanked(x), r' X ', ' *' + x['span2_text'] + '* ')
    return {
        'inputs': tf.strings.join([label, marked], separator=' '),
        'targets': tf.reshape(x['span1_text'], []),
        'label': x.get('label', 0),
        'idx': x['idx'],
    }

  if correct_referent_only:
    dataset = dataset.filter(lambda x: tf.cast(x.get('label', False), tf.bool))
  return dataset.map(convert, num_parallel_calls=tf.data.AUTOTUNE)


def record(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """ReCoRD -> one example per answer, all answers kept for evaluation.

  inputs: "record query: <query> entities: <e1>, <e2> passage: <passage>",
  the passage's "@highlight" lines joined into sentences; each answer in
  turn is the target ('<unk>' when there is none).
  """

  def per_answer(x):
    num_answers = tf.size(x['answers'])
    copies = tf.maximum(num_answers, 1)

    def repeat(t):
      return tf.broadcast_to(t, tf.concat([[copies], tf.shape(t)], axis=0))

    ex = {k: repeat(v) for k, v in x.items() if k != 'idx'}
    ex['targets'] = tf.cond(num_answers > 0, lambda: x['answers'],
                            lambda: tf.constant([UNLABELED_TARGET]))
    ex['idx'] = {k: repeat(x['idx'][k]) for k in ('passage', 'query')}
    return ex

  def to_text(x):
    passage = tf.strings.regex_replace(
        x['passage'], r'(\.|\?|\!|\"|\')\n@highlight\n', r'\1 ')
    passage = tf.strings.regex_replace(passage, r'\n@highlight\n', '. ')
    inputs = tf.strings.join(
        ['record query:', x['query'], 'entities:',
         tf.strings.reduce_join(x['entities'], separator=', '), 'passage:',
         passage], separator=' ')
    return {
        'idx/passage': x['idx']['passage'],
        'idx/query': x['idx']['query'],
        'inputs': inputs,
        'targets': x['targets'],
        'answers': x['answers'],
    }

  dataset = dataset.map(per_answer, num_parallel_calls=tf.data.AUTOTUNE)
  return dataset.unbatch().map(to_text, num_parallel_calls=tf.data.AUTOTUNE)
