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

`my_nli` gets the next task id in every run's task list (so no existing id
moves), its examples carry it, and it joins `glue_proportional` at rate
10 000. A task that shares another's id and score (a second training set
for it) passes `alias_of='glue_rte'`.

A rate is a positive number (T5's: the task's number of training examples)
or a function of the Task; a task that a mixture evaluates but never trains
on takes rate `EVAL_ONLY`. Every argument is checked before anything is
registered, so a refused call leaves nothing behind and can be retried.
"""

import dataclasses
import difflib
import logging
import math
import numbers
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import seqio
import tensorflow as tf

from hyperprompt_jax.tasks import features
from hyperprompt_jax.tasks import sources
from hyperprompt_jax.tasks import task_ids as task_ids_lib
from hyperprompt_jax.tasks.feature_converter import TASK_IDS
Rate = Union[float, Callable[[seqio.Task], float]]


class _EvalOnlyRate(float):
  """Rate 0 given on purpose (a plain 0 is refused as a likely mistake)."""


# The rate of a task that a mixture evaluates but never samples for training
# (T5's rate 0 for MNLI matched / mismatched and WSC): seqio's mixture
# evaluator scores every task of the mixture.
EVAL_ONLY = _EvalOnlyRate(0.)

# seqio's warning for each task of a mixture that lacks the requested split.
_SEQIO_NO_SPLIT = "Task %s has no '%s' split, skipping."


class _DropNoSplitWarnings(logging.Filter):
  """Drops seqio's no-split warning for the tasks `names`, keeping them."""

  def __init__(self, names: set[str]):
    """Drops the warnings of the tasks `names`."""
    super().__init__()
    self.names = names
    self.dropped = []

  def filter(self, record: logging.LogRecord) -> bool:
    """Whether to log `record`; a dropped one's task is kept in `dropped`."""
    if (record.msg == _SEQIO_NO_SPLIT and record.args
        and record.args[0] in self.names):
      self.dropped.append(record.args[0])
      return False
    return True


class TaskIdsMixture(seqio.Mixture):
  """A `seqio.Mixture` that keeps `task_ids`.

  A plain Mixture keeps only its output features (and the `_pretokenized`
  copies) when it mixes, which would drop the ids.
  """

  def get_task_dataset(self, task: seqio.Task, output_feature_keys,
                       *args, **kwargs) -> tf.data.Dataset:
    """seqio's task dataset, keeping `task_ids`."""
    return super().get_task_dataset(
        task, set(output_feature_keys) | {TASK_IDS}, *args, **kwargs)

  def get_dataset(self, *args, **kwargs) -> tf.data.Dataset:
    """seqio's dataset; eval-only tasks' missing splits are logged once."""
    # A task that trains (rate > 0) and lacks the split still warns.
    quiet = _DropNoSplitWarnings({
        name for name, rate in self.rate_per_task_name.items()
        if isinstance(rate, _EvalOnlyRate)})
    absl_logger = logging.getLogger('absl')
    absl_logger.addFilter(quiet)
    try:
      dataset = super().get_dataset(*args, **kwargs)
    finally:
      absl_logger.removeFilter(quiet)
    if quiet.dropped:
      logging.getLogger(__name__).info(
          'Mixture %s: evaluation-only tasks not sampled (no such split): '
          '%s', self.name, ', '.join(quiet.dropped))
    return dataset


def _check_rate(task: str, mixture: str, rate: Any) -> None:
  """Refuses a rate that is not a positive finite number or a function."""
  if callable(rate) or isinstance(rate, _EvalOnlyRate):
    return
  if (isinstance(rate, numbers.Real) and not isinstance(rate, bool)
      and math.isfinite(rate) and rate > 0):
    return
  raise ValueError(
      f'task {task!r} in mixture {mixture!r}: rate {rate!r} is not a '
      'positive finite number. Give the task its share of training examples '
      '(T5 uses its number of training examples, e.g. 10_000) or a function '
      'of the Task; for a task the mixture should only evaluate, pass '
      'hyperprompt_jax.tasks.registration.EVAL_ONLY.')


def _task_ids_mixture(name: str) -> TaskIdsMixture:
  """The registered TaskIdsMixture `name`, or an error naming the fix."""
  if name not in seqio.MixtureRegistry.names():
    close = difflib.get_close_matches(name, seqio.MixtureRegistry.names(),
                                      n=3)
    hint = (f'did you mean {", ".join(close)}?' if close else
            'register it first with hyperprompt_jax.tasks.add_mixture.')
    raise ValueError(f'mixture {name!r} is not registered: {hint}')
  mixture = seqio.MixtureRegistry.get(name)
  if not isinstance(mixture, TaskIdsMixture):
    raise ValueError(f'mixture {name!r} was not registered with '
                     'hyperprompt_jax.tasks.add_mixture; it would drop task '
                     'ids')
  return mixture


def _restore_mixtures(old: Mapping[str, seqio.Mixture]) -> None:
  """Registers the mixtures `old` again, as they were."""
  for name, mixture in old.items():
    seqio.MixtureRegistry.remove(name)
    seqio.MixtureRegistry.add_provider(name, mixture)


def _with_task_ids(name: str, preprocessors: Sequence[Callable]) -> list:
  """`preprocessors` with the id's after the cache placeholder (or last).

  So cached data never holds ids.
  """
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
  # Check what can be checked before registering anything.
  mixtures = dict(mixtures or {})
  for mixture, rate in mixtures.items():
    _task_ids_mixture(mixture)
    _check_rate(name, mixture, rate)
  task = seqio.TaskRegistry.add(
      name,
      source=source,
      preprocessors=_with_task_ids(name, preprocessors),
      output_features=output_features,
      postprocess_fn=postprocess_fn,
      metric_fns=list(metric_fns),
      **task_kwargs)
  # The mixtures, then the id (last: `append_task` refuses before it changes
  # anything); on a failure, the registrations made so far are undone, so a
  # failed call leaves nothing behind.
  old = {}
  try:
    for mixture, rate in mixtures.items():
      old[mixture] = seqio.MixtureRegistry.get(mixture)
      add_to_mixture(mixture, name, rate)
    canonical = task_ids_lib.canonical_task(name)
    if alias_of is not None or canonical not in task_ids_lib.known_tasks():
      task_ids_lib.append_task(name, alias_of=alias_of)
  except Exception:
    _restore_mixtures(old)
    seqio.TaskRegistry.remove(name)
    raise
  return task


def add_mixture(name: str,
                tasks: Sequence[Union[str, tuple[str, Rate]]],
                default_rate: Optional[Rate] = None) -> seqio.Mixture:
  """Registers a `TaskIdsMixture`, which keeps `task_ids`.

  Args:
    name: the mixture's name.
    tasks: task names, or `(name, rate)`: each rate a positive number,
      `EVAL_ONLY` or a function of the Task.
    default_rate: the rate of tasks given without one.

  Returns:
    The registered mixture.
  """
  tasks = list(tasks)
  for entry in tasks:
    if isinstance(entry, tuple):
      task, rate = entry
      _check_rate(getattr(task, 'name', task), name, rate)
  if default_rate is not None:
    _check_rate('(default_rate)', name, default_rate)
  return _register_mixture(name, tasks, default_rate)


def _register_mixture(name: str, tasks: Sequence[Any],
                      default_rate: Optional[Rate] = None) -> seqio.Mixture:
  """`seqio.MixtureRegistry.add` of a `TaskIdsMixture`, unchecked."""
  return seqio.MixtureRegistry.add(name, list(tasks), default_rate=default_rate,
                                   mixture_cls=TaskIdsMixture)


def add_to_mixture(mixture: str, task: str, rate: Rate) -> seqio.Mixture:
  """Re-registers `mixture` with `task` added at `rate`.

  On a failure the mixture is left as it was.

  Returns:
    The new mixture.
  """
  old = _task_ids_mixture(mixture)
  _check_rate(task, mixture, rate)
  # The other entries were checked when they were added.
  entries = [(n, r) for n, r in old.rate_per_task_name.items() if n != task]
  seqio.MixtureRegistry.remove(mixture)
  try:
    return _register_mixture(mixture, entries + [(task, rate)])
  except Exception:
    _restore_mixtures({mixture: old})
    raise


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
    """The fixture task's name."""
    return task_ids_lib.FIXTURE_PREFIX + self.name


def _fixture_train_size(task: seqio.Task) -> float:
  """The fixture's training examples."""
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
  """T5's proportional rates of the TFDS tasks; `EVAL_ONLY` for rate 0."""
  return [(s.name, float(s.rate) if s.rate else EVAL_ONLY) for s in specs]


def fixture_rates(specs: Sequence[TaskSpec]) -> list[tuple[str, Rate]]:
  """Each fixture's training-set size as its rate; `EVAL_ONLY` for rate 0."""
  return [(s.fixture_name, _fixture_train_size if s.rate else EVAL_ONLY)
          for s in specs]
