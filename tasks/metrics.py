"""T5's GLUE / SuperGLUE metrics on scikit-learn and scipy.

seqio metric functions `fn(targets, predictions) -> {name: value}`; names and
scaling (x100) are T5's (`t5/evaluation/metrics.py`), so result files read the
same as T5's and t5x's.
"""

import numpy as np
import scipy.stats
import sklearn.metrics


def accuracy(targets, predictions):
  return {'accuracy': 100 * sklearn.metrics.accuracy_score(targets,
                                                           predictions)}


def matthews_corrcoef(targets, predictions):
  """CoLA's metric, x100."""
  return {'matthews_corrcoef':
              100 * sklearn.metrics.matthews_corrcoef(targets, predictions)}


def f1_score_with_invalid(targets, predictions):
  """Binary F1 x100; a prediction outside {0, 1} (unparseable text) counts
  as wrong: it is replaced by the opposite of its target."""
  targets = np.asarray(targets)
  predictions = np.array(predictions)
  invalid = (predictions != 0) & (predictions != 1)
  predictions[invalid] = 1 - targets[invalid]
  return {'f1': 100 * sklearn.metrics.f1_score(targets, predictions)}


def pearson_corrcoef(targets, predictions):
  return {'pearson_corrcoef':
              100 * scipy.stats.pearsonr(targets, predictions)[0]}


def spearman_corrcoef(targets, predictions):
  return {'spearman_corrcoef':
              100 * scipy.stats.spearmanr(targets, predictions)[0]}


def mean_multiclass_f1(num_classes: int):
  """Unweighted mean of the per-class F1 over `num_classes` classes, x100
  (CB's metric), named `mean_<n>class_f1`."""

  def fn(targets, predictions):
    f1 = sklearn.metrics.fbeta_score(
        targets, predictions, beta=1, labels=range(num_classes),
        average='macro')
    return {f'mean_{num_classes}class_f1': 100 * f1}

  return fn
