"""GLUE: T5's tasks (strings, postprocessors, metrics), on TFDS and fixtures.

Registered names (each carries its `task_ids`):

  glue_cola glue_sst2 glue_mrpc glue_stsb glue_qqp glue_mnli glue_qnli
  glue_rte                      train / validation / test (glue_mnli: train)
  glue_mnli_matched, glue_mnli_mismatched
                                validation / test, MNLI's id; scored as one
                                task, the mean of the two
  glue_proportional             T5's proportional mixture: rate = training
                                examples; the MNLI eval tasks at rate 0, so a
                                mixture evaluator scores them

and, offline, `fixture_<name>` for each task plus `fixture_glue_proportional`,
on the learnable fixture data in `tasks/fixtures/` (byte vocabulary).

WNLI is left out, as in both papers.
"""

import functools
from typing import Callable, Mapping, Optional, Sequence

from hyperprompt_jax.tasks import metrics
from hyperprompt_jax.tasks import postprocessors
from hyperprompt_jax.tasks import preprocessors
from hyperprompt_jax.tasks import registration

TFDS_VERSION = '2.0.0'
_SPLITS = {'train': 'train', 'validation': 'validation', 'test': 'test'}
_FIXTURE_SPLITS = {'train': 'train', 'validation': 'validation',
                   'test': 'test'}


def _glue(name: str, label_names: Optional[Sequence[str]],
          metric_fns: Sequence[Callable], text_features: Sequence[str],
          rate: int, config: Optional[str] = None,
          splits: Mapping[str, str] = _SPLITS,
          fixture_splits: Mapping[str, str] = _FIXTURE_SPLITS,
          ) -> registration.TaskSpec:
  """A GLUE task in T5's format; `label_names` None is STS-B (regression)."""
  config = config or name
  if label_names is None:
    text = preprocessors.stsb
    postprocess = postprocessors.string_to_float
  else:
    text = functools.partial(preprocessors.glue, benchmark_name=config,
                             label_names=tuple(label_names))
    postprocess = functools.partial(postprocessors.string_label_to_class_id,
                                    label_classes=tuple(label_names))
  schema = {f: 'string' for f in text_features}
  schema['label'] = 'float32' if label_names is None else 'int64'
  schema['idx'] = 'int32'
  return registration.TaskSpec(
      name=f'glue_{name}', tfds_name=f'glue/{config}:{TFDS_VERSION}',
      preprocessors=(text,), postprocess_fn=postprocess,
      metric_fns=tuple(metric_fns), splits=splits, schema=schema,
      fixture=f'glue_{config}', fixture_splits=fixture_splits, rate=rate,
      label_names=None if label_names is None else tuple(label_names))


_F1_ACC = (metrics.f1_score_with_invalid, metrics.accuracy)
_ACC = (metrics.accuracy,)
_NLI3 = ('entailment', 'neutral', 'contradiction')
_NLI2 = ('entailment', 'not_entailment')
_MNLI_TEXT = ('premise', 'hypothesis')

# Rates are TFDS glue 2.0.0's training-set sizes: T5's table, except QQP,
# whose 2.0.0 source has 363,846 examples (1.0.0: 363,849).
GLUE = (
    _glue('cola', ('unacceptable', 'acceptable'),
          (metrics.matthews_corrcoef,), ('sentence',), 8_551),
    _glue('sst2', ('negative', 'positive'), _ACC, ('sentence',), 67_349),
    _glue('mrpc', ('not_equivalent', 'equivalent'), _F1_ACC,
          ('sentence1', 'sentence2'), 3_668),
    _glue('stsb', None, (metrics.pearson_corrcoef, metrics.spearman_corrcoef),
          ('sentence1', 'sentence2'), 5_749),
    _glue('qqp', ('not_duplicate', 'duplicate'), _F1_ACC,
          ('question1', 'question2'), 363_846),
    _glue('mnli', _NLI3, _ACC, _MNLI_TEXT, 392_702,
          splits={'train': 'train'}, fixture_splits={'train': 'train'}),
    # Both read glue/mnli's own validation / test splits (the same data as
    # TFDS's glue/mnli_matched and glue/mnli_mismatched configs).
    _glue('mnli_matched', _NLI3, _ACC, _MNLI_TEXT, 0, config='mnli',
          splits={'validation': 'validation_matched',
                  'test': 'test_matched'},
          fixture_splits={'validation': 'validation_matched',
                          'test': 'test_matched'}),
    _glue('mnli_mismatched', _NLI3, _ACC, _MNLI_TEXT, 0, config='mnli',
          splits={'validation': 'validation_mismatched',
                  'test': 'test_mismatched'},
          fixture_splits={'validation': 'validation_mismatched',
                          'test': 'test_mismatched'}),
    _glue('qnli', _NLI2, _ACC, ('question', 'sentence'), 104_743),
    _glue('rte', _NLI2, _ACC, ('sentence1', 'sentence2'), 2_490),
)


def register_all() -> None:
  """Registers the GLUE tasks and their mixtures."""
  for spec in GLUE:
    registration.register_spec(spec)
  registration.add_mixture('glue_proportional',
                           registration.proportional_rates(GLUE))
  registration.add_mixture('fixture_glue_proportional',
                           registration.fixture_rates(GLUE))
