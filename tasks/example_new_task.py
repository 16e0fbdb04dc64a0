"""A task the quickstart never saw, registered the way users add theirs.

`quickstart_reviews`: two-clause reviews labelled by the *second* clause's
verdict ("the plot was dull , but in the end the cast was lovely ." ->
positive). The quickstart's backbone knows the words (the fixtures'
sentiment lists), but no fixture task asks for the second clause, and in
half the examples the first says the opposite, so reading it scores near
the majority class. Importing this module registers it with
`tasks.add_task`, which gives it the id after the run's tasks, and the
mixture `quickstart_with_reviews` of old and new tasks
(runs/quickstart_add_task*.gin; docs/task_params.md).
"""

import functools
import random

import seqio
import tensorflow as tf

from hyperprompt_jax.tasks import fixture_data
from hyperprompt_jax.tasks import metrics
from hyperprompt_jax.tasks import postprocessors
from hyperprompt_jax.tasks import preprocessors
from hyperprompt_jax.tasks import registration
from hyperprompt_jax.tasks.features import FIXTURE_OUTPUT_FEATURES

NAME = 'quickstart_reviews'
MIXTURE = 'quickstart_with_reviews'
LABELS = ('negative', 'positive')
SIZES = {'train': 400, 'validation': 100}
SEED = 20261123


def _review(rng: random.Random, label: int) -> dict:
  """Two verdicts on two subjects, the second the label; half turn."""
  second = rng.choice(fixture_data.POSITIVE if label
                      else fixture_data.NEGATIVE)
  turns = rng.random() < 0.5
  first = rng.choice(fixture_data.NEGATIVE if label == turns
                     else fixture_data.POSITIVE)
  a, b = rng.sample(fixture_data.SUBJECTS, 2)
  joint = 'but in the end' if turns else 'and in the end'
  return {'review': f'the {a} was {first} , {joint} the {b} was {second} .',
          'label': label}


def examples(split: str) -> list[dict]:
  """The split's examples, balanced, from a fixed seed."""
  rng = random.Random(f'{SEED}-{split}')
  out = [dict(_review(rng, i % 2), idx=i) for i in range(SIZES[split])]
  rng.shuffle(out)
  return out


def _dataset(split: str, shuffle_files: bool = False, seed=None
             ) -> tf.data.Dataset:
  """The split as a dataset (one small in-memory file: nothing to shuffle)."""
  del shuffle_files, seed
  rows = examples(split)
  return tf.data.Dataset.from_tensor_slices({
      'review': [r['review'] for r in rows],
      'label': tf.constant([r['label'] for r in rows], tf.int64),
      'idx': tf.constant([r['idx'] for r in rows], tf.int32)})


def register() -> None:
  """Registers the task and the evaluation mixture (once)."""
  if NAME in seqio.TaskRegistry.names():
    return
  registration.add_task(
      NAME,
      source=seqio.FunctionDataSource(_dataset, splits=tuple(SIZES),
                                      num_input_examples=SIZES),
      preprocessors=[
          functools.partial(preprocessors.glue, benchmark_name='review',
                            label_names=LABELS),
          seqio.preprocessors.tokenize, seqio.CacheDatasetPlaceholder(),
          seqio.preprocessors.append_eos_after_trim],
      output_features=FIXTURE_OUTPUT_FEATURES,
      postprocess_fn=functools.partial(
          postprocessors.string_label_to_class_id, label_classes=LABELS),
      metric_fns=[metrics.accuracy])
  quickstart = seqio.get_mixture_or_task(
      'fixture_glue_super_glue_proportional')
  registration.add_mixture(
      MIXTURE, [(t.name, quickstart.get_rate(t) or registration.EVAL_ONLY)
                for t in quickstart.tasks] + [(NAME, float(SIZES['train']))])


register()
