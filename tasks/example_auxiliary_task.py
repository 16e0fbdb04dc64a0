"""A small target task with helpers, for MetaBalance.

`quickstart_rte_small`: the fixture RTE with only its first 40 training
examples, an alias of `glue_rte` (its id, score and metrics). The mixture
`quickstart_rte_small_with_glue` trains it with the other 7 fixture GLUE
tasks at proportional rates: a small task with the rest of GLUE as help
(runs/quickstart_metabalance.gin; docs/methods.md, "MetaBalance").
"""

import seqio

from hyperprompt_jax.tasks import glue
from hyperprompt_jax.tasks import registration
from hyperprompt_jax.tasks import sources
from hyperprompt_jax.tasks.features import FIXTURE_OUTPUT_FEATURES

NAME = 'quickstart_rte_small'
MIXTURE = 'quickstart_rte_small_with_glue'
TRAIN_EXAMPLES = 40


class _FirstTrainExamples(sources.FixtureDataSource):
  """A fixture whose train split is cut to its first `count` examples."""

  def __init__(self, count: int, *args, **kwargs):
    """`count` train examples; the rest as `sources.FixtureDataSource`."""
    self._count = count
    super().__init__(*args, **kwargs)

  def _examples(self, split: str):
    """The split's examples, train cut to `count`."""
    examples = super()._examples(split)
    return examples[:self._count] if split == 'train' else examples


def register() -> None:
  """Registers the task and the mixture (once)."""
  if NAME in seqio.TaskRegistry.names():
    return
  rte = next(spec for spec in glue.GLUE if spec.name == 'glue_rte')
  registration.add_task(
      NAME,
      source=_FirstTrainExamples(
          TRAIN_EXAMPLES, rte.fixture, rte.schema,
          {'train': 'train', 'validation': 'validation'}),
      preprocessors=list(rte.preprocessors) + [
          seqio.preprocessors.tokenize, seqio.CacheDatasetPlaceholder(),
          seqio.preprocessors.append_eos_after_trim],
      output_features=FIXTURE_OUTPUT_FEATURES,
      postprocess_fn=rte.postprocess_fn,
      metric_fns=rte.metric_fns,
      alias_of='glue_rte')
  glue_mixture = seqio.get_mixture_or_task('fixture_glue_proportional')
  registration.add_mixture(
      MIXTURE, [(NAME, float(TRAIN_EXAMPLES))] + [
          (t.name, glue_mixture.get_rate(t) or registration.EVAL_ONLY)
          for t in glue_mixture.tasks if t.name != 'fixture_glue_rte'])


register()
