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

`my_nli` gets the next task id (after GLUE, SuperGLUE and earlier user
tasks, so no existing id moves), its examples carry it, and it joins
`glue_proportional` (re-registered with the extra task) at rate 10 000. A
task that should share another task's id and score (a second training set
for it) passes `alias_of='glue_rte'`.
"""

from typing import Callable, Mapping, Optional, Sequence, Union

import seqio
import tensorflow as tf

from hyperprompt_jax.tasks import task_ids as task_ids_lib

TASK_IDS = 'task_ids'
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
  canonical = task_ids_lib.canonical_task(name)
  if alias_of is not None or canonical not in task_ids_lib.known_tasks():
    task_ids_lib.append_task(name, alias_of=alias_of)
  task = seqio.TaskRegistry.add(
      name,
      source=source,
      preprocessors=_with_task_ids(name, preprocessors),
      output_features=output_features,
      postprocess_fn=postprocess_fn,
      metric_fns=list(metric_fns),
      **task_kwargs)
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
