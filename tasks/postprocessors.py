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
