"""Helpers for the seqio task tests."""

import numpy as np
import seqio
import tensorflow as tf


def text_examples(task_name: str, raw: dict) -> list[dict]:
  """Runs the task's first (text) preprocessor on one raw TFDS example;
  strings come back as str."""
  task = seqio.get_mixture_or_task(task_name)
  ds = task.preprocessors[0](tf.data.Dataset.from_tensors(raw))

  def decode(v):
    if isinstance(v, bytes):
      return v.decode()
    if isinstance(v, np.ndarray) and v.dtype == object:
      return [x.decode() for x in v.tolist()]
    return v

  return [{k: decode(v) for k, v in ex.items()}
          for ex in ds.as_numpy_iterator()]


def examples(name: str, split: str, lengths=None) -> list[dict]:
  ds = seqio.get_mixture_or_task(name).get_dataset(
      lengths, split=split, shuffle=False)
  return list(ds.as_numpy_iterator())
