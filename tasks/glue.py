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

import dataclasses
import functools
from typing import Callable, Mapping, Optional, Sequence

import seqio

from hyperprompt_jax.tasks import features
from hyperprompt_jax.tasks import metrics
from hyperprompt_jax.tasks import postprocessors
from hyperprompt_jax.tasks import preprocessors
from hyperprompt_jax.tasks import registration
from hyperprompt_jax.tasks import sources

TFDS_VERSION = '2.0.0'
_SPLITS = {'train': 'train', 'validation': 'validation', 'test': 'test'}


@dataclasses.dataclass(frozen=True)
class GlueTask:
  """One GLUE task in T5's format.

  Attributes:
    name: the registered task name ('glue_<config>').
    config: the TFDS `glue/<config>` it reads.
    benchmark: the word that starts T5's inputs ('mnli' for both MNLI evals).
    label_names: class names (the TFDS ClassLabel names); None for STS-B.
    metric_fns: T5's metrics for the task.
    splits: canonical split -> TFDS split.
    text_features: the TFDS text features (the fixture schema).
    train_examples: size of the TFDS training split (the mixing rate);
      0 for evaluation-only tasks.
  """
  name: str
  config: str
  benchmark: str
  label_names: Optional[tuple[str, ...]]
  metric_fns: tuple[Callable, ...]
  splits: Mapping[str, str]
  text_features: tuple[str, ...]
  train_examples: int

  @property
  def text_preprocessor(self) -> Callable:
    if self.label_names is None:
      return preprocessors.stsb
    return functools.partial(preprocessors.glue, benchmark_name=self.benchmark,
                 label_names=self.label_names)

  @property
  def postprocess_fn(self) -> Callable:
    if self.label_names is None:
      return postprocessors.string_to_float
    return functools.partial(postprocessors.string_label_to_class_id,
                 label_classes=self.label_names)

  @property
  def schema(self) -> dict:
    """TFDS feature schema: texts, ClassLabel int64 (STS-B float32), idx."""
    schema = {f: 'string' for f in self.text_features}
    schema['label'] = 'float32' if self.label_names is None else 'int64'
    schema['idx'] = 'int32'
    return schema


_F1_ACC = (metrics.f1_score_with_invalid, metrics.accuracy)
_NLI3 = ('entailment', 'neutral', 'contradiction')
_NLI2 = ('entailment', 'not_entailment')
_MNLI_TEXT = ('premise', 'hypothesis')

# Training-set sizes are TFDS glue 2.0.0's (T5's table, but QQP's 2.0.0
# source has 363,846 examples, not 1.0.0's 363,849).
GLUE = (
    GlueTask('glue_cola', 'cola', 'cola', ('unacceptable', 'acceptable'),
             (metrics.matthews_corrcoef,), _SPLITS, ('sentence',), 8_551),
    GlueTask('glue_sst2', 'sst2', 'sst2', ('negative', 'positive'),
             (metrics.accuracy,), _SPLITS, ('sentence',), 67_349),
    GlueTask('glue_mrpc', 'mrpc', 'mrpc', ('not_equivalent', 'equivalent'),
             _F1_ACC, _SPLITS, ('sentence1', 'sentence2'), 3_668),
    GlueTask('glue_stsb', 'stsb', 'stsb', None,
             (metrics.pearson_corrcoef, metrics.spearman_corrcoef), _SPLITS,
             ('sentence1', 'sentence2'), 5_749),
    GlueTask('glue_qqp', 'qqp', 'qqp', ('not_duplicate', 'duplicate'),
             _F1_ACC, _SPLITS, ('question1', 'question2'), 363_846),
    GlueTask('glue_mnli', 'mnli', 'mnli', _NLI3, (metrics.accuracy,),
             {'train': 'train'}, _MNLI_TEXT, 392_702),
    GlueTask('glue_mnli_matched', 'mnli', 'mnli', _NLI3, (metrics.accuracy,),
             {'validation': 'validation_matched', 'test': 'test_matched'},
             _MNLI_TEXT, 0),
    GlueTask('glue_mnli_mismatched', 'mnli', 'mnli', _NLI3,
             (metrics.accuracy,),
             {'validation': 'validation_mismatched',
              'test': 'test_mismatched'}, _MNLI_TEXT, 0),
    GlueTask('glue_qnli', 'qnli', 'qnli', _NLI2, (metrics.accuracy,), _SPLITS,
             ('question', 'sentence'), 104_743),
    GlueTask('glue_rte', 'rte', 'rte', _NLI2, (metrics.accuracy,), _SPLITS,
             ('sentence1', 'sentence2'), 2_490),
)
GLUE_BY_NAME = {t.name: t for t in GLUE}

# Offline fixtures: one folder per TFDS config, files named like its splits.
FIXTURE_SPLITS = {
    'glue_mnli': {'train': 'train'},
    'glue_mnli_matched': {'validation': 'validation_matched'},
    'glue_mnli_mismatched': {'validation': 'validation_mismatched'},
}


def _preprocessors(task: GlueTask) -> list:
  return [
      task.text_preprocessor,
      seqio.preprocessors.tokenize,
      seqio.CacheDatasetPlaceholder(),
      seqio.preprocessors.append_eos_after_trim,
  ]


def register_glue(task: GlueTask) -> seqio.Task:
  return registration.add_task(
      task.name,
      source=sources.PreparedTfdsDataSource(
          f'glue/{task.config}:{TFDS_VERSION}', task.splits),
      preprocessors=_preprocessors(task),
      output_features=features.DEFAULT_OUTPUT_FEATURES,
      postprocess_fn=task.postprocess_fn,
      metric_fns=task.metric_fns)


def register_fixture(task: GlueTask) -> seqio.Task:
  splits = FIXTURE_SPLITS.get(
      task.name, {'train': 'train', 'validation': 'validation'})
  return registration.add_task(
      f'fixture_{task.name}',
      source=sources.FixtureDataSource(f'glue_{task.config}', task.schema,
                                       splits),
      preprocessors=_preprocessors(task),
      output_features=features.FIXTURE_OUTPUT_FEATURES,
      postprocess_fn=task.postprocess_fn,
      metric_fns=task.metric_fns)


def proportional_rates(tasks: Sequence[GlueTask]) -> list[tuple[str, float]]:
  return [(t.name, float(t.train_examples)) for t in tasks]


def _fixture_train_size(task: seqio.Task) -> float:
  return float(task.source.num_input_examples('train'))


def fixture_rates(tasks: Sequence[GlueTask]) -> list[tuple[str, object]]:
  """Rates of the fixture mixture: each fixture's own training-set size
  (read when the mixture is first used); 0 for evaluation-only tasks."""
  return [(f'fixture_{t.name}', _fixture_train_size if t.train_examples
           else 0.) for t in tasks]


def register_all() -> None:
  for task in GLUE:
    register_glue(task)
    register_fixture(task)
  registration.add_mixture('glue_proportional', proportional_rates(GLUE))
  registration.add_mixture('fixture_glue_proportional', fixture_rates(GLUE))
