"""T5's text-to-text formats for GLUE and SuperGLUE, on seqio.

The strings are T5's exactly (`t5/data/preprocessors.py`: `glue`, `stsb`), so
scores compare with published numbers. We do not depend on the `t5` package:
the one on the package index is unmaintained and its pins clash with seqio
and tensorflow-datasets.
"""

from typing import Optional, Sequence

import seqio
import tensorflow as tf

# T5's target for an unlabeled (test-split, label == -1) example.
UNLABELED_TARGET = '<unk>'


def _label_text(label: tf.Tensor, label_names: Sequence[str]) -> tf.Tensor:
  return tf.cond(
      tf.equal(label, -1),
      lambda: tf.constant(UNLABELED_TARGET),
      lambda: tf.gather(tf.constant(list(label_names)), label))


@seqio.map_over_dataset
def glue(x, benchmark_name: str, label_names: Sequence[str],
         feature_names: Optional[Sequence[str]] = None, id_key: str = 'idx'):
  """A GLUE-style classification example -> T5's text pair.

  inputs: "<benchmark> <key1>: <text1> <key2>: <text2>" with the text features
  in `feature_names` order, or sorted by name when it is None (so MNLI reads
  "mnli hypothesis: ... premise: ..."); targets: the label's name.

  Example (QQP): {'question1': 'a?', 'question2': 'b?', 'label': 1, 'idx': 3}
  -> {'inputs': 'qqp question1: a? question2: b?', 'targets': 'duplicate',
  'idx': 3}.
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
