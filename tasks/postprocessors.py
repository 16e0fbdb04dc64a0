"""T5's postprocessors: decoded text (or a target) -> the value a metric reads.

seqio calls them as `fn(text, example=..., is_target=...)`; the example's
strings are bytes.
"""

from typing import Sequence


def string_to_float(string, default=-1., **unused_kwargs) -> float:
  """'3.4' -> 3.4; text that is not a number -> `default` (T5's -1)."""
  try:
    return float(string)
  except ValueError:
    return default


def string_label_to_class_id(string_label, label_classes: Sequence[str],
                             default=-1, **unused_kwargs) -> int:
  """The index of `string_label` in `label_classes`, or `default` (-1)."""
  if string_label in label_classes:
    return list(label_classes).index(string_label)
  return default


def multirc(string_label, example=None, is_target=False) -> dict:
  """{'value': 'False' / 'True' as 0 / 1}; targets add 'group', the question."""
  out = {'value': string_label_to_class_id(string_label,
                                           label_classes=('False', 'True'))}
  if is_target:
    out['group'] = example['idx/question']
  return out


def record(answer, example=None, is_target=False) -> dict:
  """{'value': text}; a target's holds all answers, and 'group' its query.

  ReCoRD evaluates each query once, against all of its answers.
  """
  if is_target:
    return {
        'value': [_text(a) for a in example['answers']],
        'group': (example['idx/passage'], example['idx/query']),
    }
  return {'value': answer}


_DETERMINERS = frozenset((
    'a', 'an', 'few', 'her', 'his', 'each', 'every', 'many', 'much', 'my',
    'our', 'some', 'that', 'the', 'their', 'these', 'this', 'those', 'which',
    'whose', 'your'))


def _text(s) -> str:
  """`s` as text (bytes decoded)."""
  return s.decode('utf-8') if isinstance(s, bytes) else str(s)


def wsc_simple(prediction, example=None, is_target=False) -> int:
  """WSC: 1 if the predicted referent names the candidate, else 0.

  Capitalisation and determiners are ignored, either word set may contain
  the other, and a possessive matches only a possessive; an empty
  prediction is -1. Targets are the example's label.
  """
  if is_target:
    return example['label']

  def clean(s):
    s = _text(s).strip().lower()
    return ' '.join(w for w in s.split(' ') if w not in _DETERMINERS)

  prediction = clean(prediction)
  if not prediction:
    return -1  # An empty prediction must not match a 0 label by accident.
  referent = clean(example['targets_pretokenized'])
  if ("'" in prediction) != ("'" in referent):
    return 0  # "Bob" is not "Bob's hat".
  predicted, actual = set(prediction.split(' ')), set(referent.split(' '))
  return int(predicted.issubset(actual) or actual.issubset(predicted))
