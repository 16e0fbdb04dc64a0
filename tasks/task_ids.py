"""Stable task ids: the ordered task list, its aliases and the run's list.

Ids are positions in a run's ordered task list, never mixture order (a seqio
Mixture sorts its tasks by name). The lists are fixed in code in the papers'
order; a user's task is appended (`append_task`), so existing ids, and the
checkpoints trained with them, stay valid.

A run picks its list with gin (`gin/tasks/*.gin`):

    hyperprompt_jax.tasks.task_ids.run_task_list.benchmark = 'super_glue'

`'glue'` (8 tasks, the default), `'super_glue'` (8) or `'glue_super_glue'`
(16, HyperGrid's joint setting), followed by the appended user tasks; or an
explicit list with `run_task_list.tasks = [...]`.

Each Task attaches its id in its own preprocessors (`add_task_ids`, after the
cache placeholder), so a cached dataset does not depend on the run's list and
the id survives seqio's task-by-task evaluation.
"""

import difflib
import functools
from typing import Optional, Sequence

import gin
import tensorflow as tf

GLUE_TASKS = (
    'glue_cola', 'glue_sst2', 'glue_mrpc', 'glue_stsb', 'glue_qqp',
    'glue_mnli', 'glue_qnli', 'glue_rte',
)
SUPER_GLUE_TASKS = (
    'super_glue_boolq', 'super_glue_cb', 'super_glue_copa',
    'super_glue_multirc', 'super_glue_record', 'super_glue_rte',
    'super_glue_wic', 'super_glue_wsc',
)
BENCHMARKS = {
    'glue': GLUE_TASKS,
    'super_glue': SUPER_GLUE_TASKS,
    'glue_super_glue': GLUE_TASKS + SUPER_GLUE_TASKS,
}

# Tasks that train or evaluate another task: they carry that task's id and are
# scored with it (MNLI matched / mismatched are averaged into MNLI).
ALIASES = {
    'glue_mnli_matched': 'glue_mnli',
    'glue_mnli_mismatched': 'glue_mnli',
    'dpr_simple': 'super_glue_wsc',
    'super_glue_wsc_simple_train': 'super_glue_wsc',
}

# Offline fixture tasks are named `fixture_<task>` and carry <task>'s id.
FIXTURE_PREFIX = 'fixture_'

# User tasks appended by `append_task`, in order.
_APPENDED: list[str] = []


def canonical_task(name: str) -> str:
  """The task whose id and score `name` shares (aliases, fixture prefix)."""
  if name.startswith(FIXTURE_PREFIX):
    name = name[len(FIXTURE_PREFIX):]
  return ALIASES.get(name, name)


def known_tasks() -> tuple[str, ...]:
  """Every task with an id, in id order of the joint list."""
  return GLUE_TASKS + SUPER_GLUE_TASKS + tuple(_APPENDED)


def append_task(name: str, alias_of: Optional[str] = None) -> None:
  """Gives a user task the next id of every run's list.

  Appending never moves an existing id. Re-appending a known name is a no-op,
  so a module that registers tasks can be imported twice.

  Args:
    name: the task's name.
    alias_of: make `name` share this task's id instead.

  Raises:
    ValueError: an unknown `alias_of`, a name that is another task's alias,
      or a `fixture_` name.
  """
  if alias_of is not None:
    target = canonical_task(alias_of)
    if target not in known_tasks():
      raise ValueError(f'alias_of={alias_of!r} is not a known task; known: '
                       f'{", ".join(known_tasks())}')
    if ALIASES.get(name, target) != target:
      raise ValueError(f'{name!r} is already an alias of {ALIASES[name]!r}')
    ALIASES[name] = target
    return
  if name in ALIASES:
    raise ValueError(f'{name!r} is an alias of {ALIASES[name]!r}, not a task')
  if name.startswith(FIXTURE_PREFIX):
    raise ValueError(f'{name!r}: names starting with {FIXTURE_PREFIX!r} are '
                     'reserved for the offline fixtures')
  if name not in known_tasks():
    _APPENDED.append(name)


@gin.configurable(module='hyperprompt_jax.tasks.task_ids')
def run_task_list(benchmark: str = 'glue',
                  tasks: Optional[Sequence[str]] = None) -> tuple[str, ...]:
  """The run's ordered task list: position = task id.

  Args:
    benchmark: 'glue', 'super_glue' or 'glue_super_glue'; the appended user
      tasks follow its tasks.
    tasks: an explicit ordered list instead (canonical names).

  Returns:
    The task names in id order.
  """
  if tasks is not None:
    names = tuple(canonical_task(t) for t in tasks)
    if len(set(names)) != len(names):
      raise ValueError(f'run_task_list.tasks repeats a task: {list(tasks)}')
    return names
  if benchmark not in BENCHMARKS:
    raise ValueError(f'run_task_list.benchmark={benchmark!r}; expected one of '
                     f'{sorted(BENCHMARKS)}')
  return BENCHMARKS[benchmark] + tuple(_APPENDED)


def task_id(name: str, task_list: Optional[Sequence[str]] = None) -> int:
  """The id of task `name` (or of the task it is an alias of) in the run.

  Args:
    name: a task, alias or fixture name.
    task_list: the ordered task list; None: `run_task_list()`.

  Returns:
    The task's position in the list.

  Raises:
    ValueError: the task is not in the list, with a hint.
  """
  task_list = tuple(run_task_list() if task_list is None else task_list)
  canonical = canonical_task(name)
  if canonical in task_list:
    return task_list.index(canonical)
  close = difflib.get_close_matches(canonical, known_tasks(), n=3)
  hint = ''
  for bench, names in BENCHMARKS.items():
    if canonical in names:
      hint = (f"; it belongs to the '{bench}' list: bind "
              f"hyperprompt_jax.tasks.task_ids.run_task_list.benchmark = "
              f"'{bench}' (or include gin/tasks/{bench}.gin)")
      break
  else:
    if close:
      hint = f'; did you mean {", ".join(close)}?'
    elif canonical not in known_tasks():
      hint = ('; register it with hyperprompt_jax.tasks.add_task, which '
              'appends its id')
  raise ValueError(f'task {name!r} has no id in this run: the run\'s task list '
                   f'is {list(task_list)}{hint}')


def check_num_tasks(num_tasks: int,
                    task_list: Optional[Sequence[str]] = None) -> None:
  """Fails a run whose task-id space is smaller than its task list."""
  task_list = tuple(run_task_list() if task_list is None else task_list)
  if num_tasks < len(task_list):
    raise ValueError(
        f'NUM_TASKS={num_tasks} is smaller than the run\'s task list '
        f'({len(task_list)} tasks: {", ".join(task_list)}); set '
        f'--gin.NUM_TASKS={len(task_list)} or bind a shorter '
        'hyperprompt_jax.tasks.task_ids.run_task_list')


def add_task_ids(dataset: tf.data.Dataset, *, task_name: str
                 ) -> tf.data.Dataset:
  """seqio preprocessor: adds `task_ids` (int32 scalar) to every example.

  The id is looked up when the dataset is built, after gin is parsed, so the
  same registered Task serves GLUE, SuperGLUE and joint runs.
  """
  tid = tf.constant(task_id(task_name), tf.int32)
  return dataset.map(lambda ex: {**ex, 'task_ids': tid},
                     num_parallel_calls=tf.data.AUTOTUNE)


def task_ids_preprocessor(task_name: str):
  """`add_task_ids` bound to one task, for a Task's preprocessor list."""
  return functools.partial(add_task_ids, task_name=task_name)
