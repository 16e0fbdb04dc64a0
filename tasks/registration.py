"""Registering tasks and mixtures whose examples carry `task_ids`.

The project's GLUE / SuperGLUE tasks are registered through these functions,
and so are a user's:

    import seqio
    from hyperprompt_jax import tasks

    tasks.add_task(
        'my_nli',
        source=seqio.TfdsDataSource('my_nli:1.0.0'),
        preprocessors=[my_text_fn, seqio.preprocessors.tokenize,
                       seqio.CacheDatasetPlaceholder(),
                       seqio.preprocessors.append_eos_after_trim],
        output_features=tasks.DEFAULT_OUTPUT_FEATURES,
        metric_fns=[tasks.metrics.accuracy],
        mixtures={'glue_proportional': 10_000})

`my_nli` gets the next task id in every run's task list (after the
benchmark's tasks and earlier user tasks, so no existing id moves), its
examples carry it, and it joins
`glue_proportional` (re-registered with the extra task) at rate 10 000. A
task that should share another task's id and score (a second training set
for it) passes `alias_of='glue_rte'`.
"""

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import seqio
import tensorflow as tf

from hyperprompt_jax.tasks import features
from hyperprompt_jax.tasks import sources
from hyperprompt_jax.tasks import task_ids as task_ids_lib
from hyperprompt_jax.tasks.feature_converter import TASK_IDS
Rate = Union[float, Callable[[seqio.Task], float]]


class TaskIdsMixture(seqio.Mixture):
  """A `seqio.Mixture` that keeps `task_ids`.

  A plain Mixture keeps only its output features (and the `_pretokenized`
  copies) when it mixes, which would drop the ids.
  """

  def get_task_dataset(self, task: seqio.Task, output_feature_keys,
                       *args, **kwargs) -> tf.data.Dataset:
    return super().get_task_dataset(
        task, set(output_feature_keys) | {TASK_IDS}, *args, **kwargs)


def _with_task_ids(name: str, preprocessors: Sequence[Callable]) -> list:
  """Inserts the id preprocessor right after the cache placeholder (or last),
  so cached data never holds ids."""
  preprocessors = list(preprocessors)
  at = len(preprocessors)
  for i, p in enumerate(preprocessors):
    if isinstance(p, seqio.CacheDatasetPlaceholder):
      at = i + 1
  preprocessors.insert(at, task_ids_lib.task_ids_preprocessor(name))
  return preprocessors


def add_task(
    name: str,
    source: seqio.DataSource,
    preprocessors: Sequence[Callable],
    output_features: Mapping[str, seqio.Feature],
    postprocess_fn: Optional[Callable] = None,
    metric_fns: Sequence[Callable] = (),
    *,
    alias_of: Optional[str] = None,
    mixtures: Optional[Mapping[str, Rate]] = None,
    **task_kwargs,
) -> seqio.Task:
  """Registers a seqio Task whose examples carry its `task_ids`.

  Args:
    name: the seqio task name.
    source, preprocessors, output_features, postprocess_fn, metric_fns: as
      `seqio.TaskRegistry.add`; the id preprocessor is inserted after
      `seqio.CacheDatasetPlaceholder` (or appended when there is none).
    alias_of: share that task's id and score instead of getting a new id.
    mixtures: mixture name -> rate; each mixture (registered with
      `add_mixture`) is re-registered with this task added.
    **task_kwargs: passed to `seqio.TaskRegistry.add`.

  Returns:
    The registered Task.
  """
  task = seqio.TaskRegistry.add(
      name,
      source=source,
      preprocessors=_with_task_ids(name, preprocessors),
      output_features=output_features,
      postprocess_fn=postprocess_fn,
      metric_fns=list(metric_fns),
      **task_kwargs)
  # Give the id once the Task is registered, and undo the registration if
  # the id is refused: a failed call leaves neither behind.
  canonical = task_ids_lib.canonical_task(name)
  if alias_of is not None or canonical not in task_ids_lib.known_tasks():
    try:
      task_ids_lib.append_task(name, alias_of=alias_of)
    except ValueError:
      seqio.TaskRegistry.remove(name)
      raise
  for mixture, rate in (mixtures or {}).items():
    add_to_mixture(mixture, name, rate)
  return task


def add_mixture(name: str,
                tasks: Sequence[Union[str, tuple[str, Rate]]],
                default_rate: Optional[Rate] = None) -> seqio.Mixture:
  """Registers a `TaskIdsMixture` (arguments as `seqio.MixtureRegistry.add`)."""
  return seqio.MixtureRegistry.add(name, list(tasks), default_rate=default_rate,
                                   mixture_cls=TaskIdsMixture)


def add_to_mixture(mixture: str, task: str, rate: Rate) -> seqio.Mixture:
  """Re-registers mixture `mixture` with `task` added at `rate`."""
  old = seqio.MixtureRegistry.get(mixture)
  if not isinstance(old, TaskIdsMixture):
    raise ValueError(f'mixture {mixture!r} was not registered with '
                     'hyperprompt_jax.tasks.add_mixture; it would drop task '
                     'ids')
  entries = [(n, r) for n, r in old.rate_per_task_name.items() if n != task]
  seqio.MixtureRegistry.remove(mixture)
  return add_mixture(mixture, entries + [(task, rate)])


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """One benchmark task, registered twice: on TFDS and on its fixture.

  Attributes:
    name: the TFDS task's name; the fixture task is `fixture_<name>`.
    tfds_name: 'name/config:version'.
    preprocessors: the text preprocessors (raw TFDS example -> 'inputs' /
      'targets' strings); tokenization, the cache placeholder, the id and EOS
      follow.
    postprocess_fn, metric_fns: T5's.
    splits: canonical split -> TFDS split.
    schema: the TFDS feature schema (`sources.FixtureDataSource`).
    fixture: the fixture folder in `tasks/fixtures/`.
    fixture_splits: canonical split -> fixture file stem.
    rate: the proportional mixing rate (T5's number of training examples);
      0 for evaluation-only tasks.
    label_names: the class names of a classification task.
  """
  name: str
  tfds_name: str
  preprocessors: tuple[Callable, ...]
  postprocess_fn: Optional[Callable]
  metric_fns: tuple[Callable, ...]
  splits: Mapping[str, str]
  schema: Mapping[str, Any]
  fixture: str
  fixture_splits: Mapping[str, str]
  rate: float
  label_names: Optional[tuple[str, ...]] = None

  @property
  def fixture_name(self) -> str:
    return task_ids_lib.FIXTURE_PREFIX + self.name


def _fixture_train_size(task: seqio.Task) -> float:
  return float(task.source.num_input_examples('train'))


def register_spec(spec: TaskSpec) -> None:
  """Registers `spec.name` (TFDS) and `fixture_<name>` (fixture data)."""
  tail = [seqio.preprocessors.tokenize, seqio.CacheDatasetPlaceholder(),
          seqio.preprocessors.append_eos_after_trim]
  common = dict(preprocessors=list(spec.preprocessors) + tail,
                postprocess_fn=spec.postprocess_fn,
                metric_fns=spec.metric_fns)
  add_task(spec.name,
           source=sources.PreparedTfdsDataSource(spec.tfds_name, spec.splits),
           output_features=features.DEFAULT_OUTPUT_FEATURES, **common)
  add_task(spec.fixture_name,
           source=sources.FixtureDataSource(spec.fixture, spec.schema,
                                            spec.fixture_splits),
           output_features=features.FIXTURE_OUTPUT_FEATURES, **common)


def proportional_rates(specs: Sequence[TaskSpec]) -> list[tuple[str, Rate]]:
  return [(s.name, float(s.rate)) for s in specs]


def fixture_rates(specs: Sequence[TaskSpec]) -> list[tuple[str, Rate]]:
  """Each fixture's own training-set size (read when the mixture is first
  used); 0 for evaluation-only tasks."""
  return [(s.fixture_name, _fixture_train_size if s.rate else 0.)
          for s in specs]
