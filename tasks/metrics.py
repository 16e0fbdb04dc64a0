"""T5's GLUE / SuperGLUE metrics on scikit-learn and scipy.

seqio metric functions `fn(targets, predictions) -> {name: value}`; names and
scaling (x100) are T5's (`t5/evaluation/metrics.py`), so result files read the
same as T5's and t5x's.
"""

import collections
import re
import string

import numpy as np
import scipy.stats
import sklearn.metrics


def accuracy(targets, predictions):
  """Accuracy, x100."""
  return {'accuracy': 100 * sklearn.metrics.accuracy_score(targets,
                                                           predictions)}


def matthews_corrcoef(targets, predictions):
  """CoLA's metric, x100."""
  return {'matthews_corrcoef':
              100 * sklearn.metrics.matthews_corrcoef(targets, predictions)}


def f1_score_with_invalid(targets, predictions):
  """Binary F1 x100; a prediction outside {0, 1} counts as wrong."""
  targets = np.asarray(targets)
  predictions = np.array(predictions)
  invalid = (predictions != 0) & (predictions != 1)
  predictions[invalid] = 1 - targets[invalid]
  return {'f1': 100 * sklearn.metrics.f1_score(targets, predictions)}


def pearson_corrcoef(targets, predictions):
  """STS-B's Pearson correlation, x100."""
  return {'pearson_corrcoef':
              100 * scipy.stats.pearsonr(targets, predictions)[0]}


def spearman_corrcoef(targets, predictions):
  """STS-B's Spearman correlation, x100."""
  return {'spearman_corrcoef':
              100 * scipy.stats.spearmanr(targets, predictions)[0]}


def mean_multiclass_f1(num_classes: int):
  """CB's `mean_<n>class_f1`: the unweighted mean of per-class F1, x100."""

  def fn(targets, predictions):
    f1 = sklearn.metrics.fbeta_score(
        targets, predictions, beta=1, labels=range(num_classes),
        average='macro')
    return {f'mean_{num_classes}class_f1': 100 * f1}

  return fn


def _normalize_squad(text: str) -> str:
  """SQuAD's normalisation: lower case, no punctuation or articles."""
  text = ''.join('' if ch in string.punctuation else ch for ch in text.lower())
  text = re.sub(r'\b(a|an|the)\b', ' ', text)
  return ' '.join(text.split())


def _token_f1(target: str, prediction: str) -> float:
  """F1 of the two texts' token bags."""
  pred, targ = prediction.split(), target.split()
  same = sum((collections.Counter(pred) & collections.Counter(targ)).values())
  if same == 0:
    return 0.
  precision, recall = same / len(pred), same / len(targ)
  return 2 * precision * recall / (precision + recall)


def squad(targets, predictions):
  """SQuAD exact match and token F1 x100, each the best over the answers.

  Args:
    targets: each question's list of answers.
    predictions: strings.

  Returns:
    `{'em': ..., 'f1': ...}`.
  """
  targets = [[_normalize_squad(t) for t in answers] for answers in targets]
  predictions = [_normalize_squad(p) for p in predictions]
  if len(targets) != len(predictions):
    raise ValueError('Number of targets and predictions must match.')
  em = np.mean([max(float(t == p) for t in ts)
                for ts, p in zip(targets, predictions)])
  f1 = np.mean([max(_token_f1(t, p) for t in ts)
                for ts, p in zip(targets, predictions)])
  return {'em': 100 * em, 'f1': 100 * f1}


def all_match(targets, predictions):
  """100 if every prediction equals its target, else 0."""
  return {'exact_match': 100 * float(np.array_equal(targets, predictions))}


def deduplicate_metric(metric_fn, group_key='group', value_key='value'):
  """`metric_fn` on each group's first example (ReCoRD's, once per answer)."""

  def fn(targets, predictions):
    seen, targs, preds = set(), [], []
    for targ, pred in zip(targets, predictions):
      if targ[group_key] in seen:
        continue
      seen.add(targ[group_key])
      targs.append(targ[value_key])
      preds.append(pred[value_key])
    return metric_fn(targs, preds)

  return fn


def mean_group_metric(metric_fn, group_key='group', value_key='value'):
  """The mean of `metric_fn` over groups (MultiRC's per-question match)."""

  def fn(targets, predictions):
    groups = collections.defaultdict(lambda: ([], []))
    for targ, pred in zip(targets, predictions):
      groups[targ[group_key]][0].append(targ[value_key])
      groups[targ[group_key]][1].append(pred[value_key])
    per_metric = collections.defaultdict(list)
    for targs, preds in groups.values():
      for name, value in metric_fn(targs, preds).items():
        per_metric[name].append(value)
    return {name: float(np.mean(v)) for name, v in per_metric.items()}

  return fn


def multirc_f1_over_all_answers(targets, predictions):
  """MultiRC's F1a: binary F1 (invalid predictions wrong) over every answer."""
  return f1_score_with_invalid([t['value'] for t in targets],
                               [p['value'] for p in predictions])
