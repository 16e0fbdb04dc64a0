"""SuperGLUE: T5's tasks on TFDS and fixtures, and the SuperGLUE mixtures.

T5's strings, postprocessors and metrics; the mixtures are SuperGLUE's and
the joint GLUE + SuperGLUE one.

Registered names (each carries its `task_ids`):

  super_glue_boolq super_glue_cb super_glue_copa super_glue_multirc
  super_glue_record super_glue_rte super_glue_wic
                          train / validation / test
  super_glue_wsc          T5's wsc-simple evaluation (validation / test): the
                          model names the pronoun's referent
  super_glue_wsc_simple_train, dpr_simple
                          T5's WSC training sets (WSC's correct referents and
                          DPR), with WSC's id
  super_glue_proportional T5's proportional SuperGLUE mixture
  glue_super_glue_proportional
                          GLUE + SuperGLUE, proportional (HyperGrid's
                          setting; T5 has no such mixture)

and `fixture_<name>` for each task plus `fixture_super_glue_proportional`
and `fixture_glue_super_glue_proportional` (offline, byte vocabulary).
"""

import functools
from typing import Callable, Mapping, Optional, Sequence

from hyperprompt_jax.tasks import glue
from hyperprompt_jax.tasks import metrics
from hyperprompt_jax.tasks import postprocessors
from hyperprompt_jax.tasks import preprocessors
from hyperprompt_jax.tasks import registration

TFDS_VERSION = '1.0.2'
DPR_TFDS_NAME = 'definite_pronoun_resolution:1.1.0'
_SPLITS = {'train': 'train', 'validation': 'validation', 'test': 'test'}
_FIXTURE_SPLITS = {'train': 'train', 'validation': 'validation',
                   'test': 'test'}
_BOOL = ('False', 'True')
_ACC = (metrics.accuracy,)


def _spec(name: str, text: Callable, postprocess: Optional[Callable],
          metric_fns: Sequence[Callable], schema: Mapping, rate: float,
          label_names: Optional[Sequence[str]] = None, config: str = '',
          splits: Mapping[str, str] = _SPLITS,
          fixture_splits: Mapping[str, str] = _FIXTURE_SPLITS,
          fixture: str = '') -> registration.TaskSpec:
  """A SuperGLUE task's spec (`config`: its TFDS config, default `name`)."""
  config = config or name
  return registration.TaskSpec(
      name=f'super_glue_{name}',
      tfds_name=f'super_glue/{config}:{TFDS_VERSION}',
      preprocessors=(text,), postprocess_fn=postprocess,
      metric_fns=tuple(metric_fns), splits=splits, schema=schema,
      fixture=fixture or f'super_glue_{name}', fixture_splits=fixture_splits, rate=rate,
      label_names=None if label_names is None else tuple(label_names))


def _classification(name: str, label_names: Sequence[str],
                    metric_fns: Sequence[Callable], text_features: dict,
                    rate: float,
                    feature_names: Optional[Sequence[str]] = None,
                    postprocess: Optional[Callable] = None,
                    idx='int32') -> registration.TaskSpec:
  """A task in T5's `glue` format: "<name> <key>: <text> ..." -> label."""
  text = functools.partial(
      preprocessors.glue, benchmark_name=name, label_names=tuple(label_names),
      feature_names=None if feature_names is None else tuple(feature_names))
  postprocess = postprocess or functools.partial(
      postprocessors.string_label_to_class_id, label_classes=tuple(label_names))
  schema = {**text_features, 'label': 'int64', 'idx': idx}
  return _spec(name, text, postprocess, metric_fns, schema, rate, label_names)


def _strings(*names: str) -> dict:
  """A schema of string features."""
  return {n: 'string' for n in names}


_WSC_SCHEMA = {**_strings('text', 'span1_text', 'span2_text'),
               'span1_index': 'int32', 'span2_index': 'int32',
               'label': 'int64', 'idx': 'int32'}

# Rates: T5's SUPER_GLUE_WEIGHT_MAPPING (training examples after T5's
# preprocessing: ReCoRD one per answer, WSC's correct referents only).
SUPER_GLUE = (
    _classification('boolq', _BOOL, _ACC, _strings('question', 'passage'),
                    9_427),
    _classification('cb', ('entailment', 'contradiction', 'neutral'),
                    (metrics.mean_multiclass_f1(3), metrics.accuracy),
                    _strings('premise', 'hypothesis'), 250),
    _classification('copa', ('choice1', 'choice2'), _ACC,
                    _strings('premise', 'choice1', 'choice2', 'question'),
                    400),
    _classification('multirc', _BOOL,
                    (metrics.multirc_f1_over_all_answers,
                     metrics.mean_group_metric(metrics.all_match)),
                    _strings('paragraph', 'question', 'answer'), 27_243,
                    feature_names=('question', 'answer', 'paragraph'),
                    postprocess=postprocessors.multirc,
                    idx={'paragraph': 'int32', 'question': 'int32',
                         'answer': 'int32'}),
    _spec('record', preprocessors.record, postprocessors.record,
          (metrics.deduplicate_metric(metrics.squad),),
          {**_strings('passage', 'query'), 'entities': ['string'],
           'answers': ['string'], 'idx': {'passage': 'int32',
                                          'query': 'int32'}}, 138_854),
    _classification('rte', ('entailment', 'not_entailment'), _ACC,
                    _strings('premise', 'hypothesis'), 2_490),
    _classification('wic', _BOOL, _ACC,
                    {**_strings('word', 'sentence1', 'sentence2'),
                     'start1': 'int32', 'start2': 'int32', 'end1': 'int32',
                     'end2': 'int32'}, 5_428,
                    feature_names=('sentence1', 'sentence2', 'word')),
    _spec('wsc', functools.partial(preprocessors.wsc_simple,
                                   correct_referent_only=False),
          postprocessors.wsc_simple, _ACC, _WSC_SCHEMA, 0,
          config='wsc.fixed', splits={'validation': 'validation',
                                      'test': 'test'},
          fixture_splits={'validation': 'validation', 'test': 'test'}),
    _spec('wsc_simple_train', functools.partial(preprocessors.wsc_simple,
                                                correct_referent_only=True),
          None, (), _WSC_SCHEMA, 259, config='wsc.fixed',
          splits={'train': 'train'}, fixture_splits={'train': 'train'},
          fixture='super_glue_wsc'),
)

DPR = registration.TaskSpec(
    name='dpr_simple', tfds_name=DPR_TFDS_NAME,
    preprocessors=(preprocessors.definite_pronoun_resolution_simple,),
    postprocess_fn=None, metric_fns=_ACC, splits={'train': 'train'},
    schema={**_strings('sentence', 'pronoun'), 'candidates': ['string'],
            'label': 'int64'},
    fixture='dpr', fixture_splits={'train': 'train'}, rate=1_322)

ALL = SUPER_GLUE + (DPR,)


def register_all() -> None:
  """Registers the SuperGLUE tasks, DPR and their mixtures."""
  for spec in ALL:
    registration.register_spec(spec)
  joint = glue.GLUE + ALL
  for name, specs in (('super_glue_proportional', ALL),
                      ('glue_super_glue_proportional', joint)):
    registration.add_mixture(name, registration.proportional_rates(specs))
    registration.add_mixture(f'fixture_{name}',
                             registration.fixture_rates(specs))
