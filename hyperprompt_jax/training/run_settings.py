"""A training run's settings as one object, `RunSettings`, checked when made.

gin/runs/train.gin binds it from t5x's macro names (MODEL_DIR, TRAIN_STEPS,
BATCH_SIZE, ...). The checks that need the model or the devices (the task
count, the mesh, MetaBalance's plan) are `train`'s.
"""

import dataclasses
import os
from typing import Any, Mapping, Optional

import gin

from hyperprompt_jax import task_params
from hyperprompt_jax.training import metabalance
from hyperprompt_jax.training import schedules


# The MODEL_DIR of settings made only to compile a run for a slice (the
# `compile` command): it writes nothing and reads no checkpoint, so a local
# INITIAL_CHECKPOINT_PATH need not exist on the compiling host.
COMPILE_ONLY = '(compile only)'


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RunSettings:
  """The built-in runner's settings for one run (gin: runs/train.gin's macros).

  Each setting is checked when the object is made: a bad one raises
  ValueError naming its macro and a fix, before anything is written, loaded
  or compiled.

  Attributes:
    model_dir: checkpoints, summaries and the gin config go here.
    mixture_or_task_name: a registered seqio Task / Mixture.
    task_feature_lengths: {'inputs': L_in, 'targets': L_out}.
    train_steps: the step to stop at (fine-tuning counts from 0).
    batch_size: the global batch size.
    optimizer: an optax transformation (gin: `@optimizers.make_optimizer()`).
    initial_checkpoint_path: a pretrained t5x `checkpoint_<step>`.
    save_period: steps between checkpoints (papers: 2000).
    keep_checkpoints: how many to keep (None: all; at least 1).
    log_period: steps between progress lines and summaries.
    seed: parameters, dropout (`fold_in(seed, step)`) and data order.
    z_loss: t5x's z-loss coefficient.
    mesh_data: the mesh's data axis (-1: the remaining devices).
    mesh_model: the mesh's model axis.
    pack: pack several examples per row (T5's fine-tuning default), each
      token with its example's task id.
    use_cached_tasks: read seqio's offline cache.
    task_params_path: a `task_params` artifact placed on the backbone of
      `initial_checkpoint_path`.
    new_task_init: how task ids the initial checkpoint lacks start: 'mean',
      'copy' or 'fresh' (`task_params.grow`).
    new_task_source: the task 'copy' copies.
    train_only_new_tasks: train only the new tasks' parameters
      (`optimizers.only_task_params`).
    restart_data_on_layout_change: resuming with the data in another number
      of shards (`multihost.data_layout`) restarts the data stream instead of
      refusing.
    gradient_balancing: None (the loss's gradient) or 'metabalance'.
    metabalance_settings: MetaBalance's (gin: the METABALANCE_* macros).
    num_microbatches: each batch's gradient in this many parts, summed into
      one update (t5x's meaning; None or 1: whole batches).
    learning_rate_schedule: the optimizer's schedule (the same gin reference
      as `make_optimizer.learning_rate`), recorded with each checkpoint (a
      resume with another is refused) and logged; None: neither.
    eval_period: decode the run's validation sets every this many steps and
      at the last (t5x's `eval_period`); None: never.
    eval_examples_per_task: score each task's first this many examples
      (None: all).
    eval_batch_size: examples per decode call.
    keep_best_by: a task or average (e.g. 'glue_average') whose best
      checkpoint is kept beside the last `keep_checkpoints`; every evaluation
      then saves a checkpoint.
  """
  model_dir: str = gin.REQUIRED
  mixture_or_task_name: str = gin.REQUIRED
  task_feature_lengths: Mapping[str, int] = gin.REQUIRED
  train_steps: int = gin.REQUIRED
  batch_size: int = gin.REQUIRED
  optimizer: Any = gin.REQUIRED
  initial_checkpoint_path: Optional[str] = None
  save_period: int = 2000
  keep_checkpoints: Optional[int] = None
  log_period: int = 100
  seed: int = 0
  z_loss: float = 1e-4
  mesh_data: int = -1
  mesh_model: int = 1
  pack: bool = False
  use_cached_tasks: bool = False
  task_params_path: Optional[str] = None
  new_task_init: str = 'mean'
  new_task_source: Optional[str] = None
  train_only_new_tasks: bool = False
  restart_data_on_layout_change: bool = False
  gradient_balancing: Optional[str] = None
  metabalance_settings: Optional[metabalance.Settings] = None
  num_microbatches: Optional[int] = None
  learning_rate_schedule: Optional[schedules.Schedule] = None
  eval_period: Optional[int] = None
  eval_examples_per_task: Optional[int] = None
  eval_batch_size: int = 64
  keep_best_by: Optional[str] = None

  def __post_init__(self):
    self._check_data()
    self._check_loop()
    self._check_start()

  @property
  def growth(self) -> task_params.Growth:
    """NEW_TASK_INIT and NEW_TASK_SOURCE (checked when made)."""
    return task_params.Growth(self.new_task_init, self.new_task_source)

  def due_eval(self, step: int) -> bool:
    """t5x's eval_period: every EVAL_PERIOD steps and at the last one."""
    return bool(self.eval_period) and step > 0 and (
        step % self.eval_period == 0 or step == self.train_steps)

  def _check_data(self) -> None:
    for macro, value in (('MODEL_DIR', self.model_dir),
                         ('MIXTURE_OR_TASK_NAME', self.mixture_or_task_name)):
      if not isinstance(value, str) or not value:
        raise ValueError(f"{macro} must be a non-empty string, got "
                         f"{value!r}: --gin.{macro}=\"'...'\" (quoted).")
    lengths = self.task_feature_lengths
    if not isinstance(lengths, Mapping) or set(lengths) != {'inputs',
                                                            'targets'}:
      raise ValueError(
          'TASK_FEATURE_LENGTHS must be {"inputs": L_in, "targets": L_out}, '
          f'got {lengths!r}.')
    for key, length in lengths.items():
      _check_int(f'TASK_FEATURE_LENGTHS[{key!r}]', length, example=512)
    _check_int('BATCH_SIZE', self.batch_size, example=128)
    _check_int('SEED', self.seed, minimum=0, example=0)
    _check_bool('PACK', self.pack)

  def _check_loop(self) -> None:
    _check_int('TRAIN_STEPS', self.train_steps)
    _check_int('SAVE_PERIOD', self.save_period, example=2000)
    _check_int('LOG_PERIOD', self.log_period, example=100)
    keep = self.keep_checkpoints
    if keep is not None and (isinstance(keep, bool)
                             or not isinstance(keep, int) or keep < 1):
      raise ValueError(
          f'KEEP_CHECKPOINTS must be None (keep all) or an integer >= 1, got '
          f'{keep!r}: 0 would delete every checkpoint in MODEL_DIR.')
    z_loss = self.z_loss
    if isinstance(z_loss, bool) or not isinstance(z_loss, (int, float)) or (
        not 0 <= z_loss < float('inf')):
      raise ValueError(
          f'RunSettings.z_loss must be a number >= 0, got {z_loss!r}.')
    _check_bool('RESTART_DATA_ON_LAYOUT_CHANGE',
                self.restart_data_on_layout_change)
    if self.learning_rate_schedule is not None and not isinstance(
        self.learning_rate_schedule, schedules.Schedule):
      raise ValueError(
          'RunSettings.learning_rate_schedule must be a schedules.Schedule '
          '(gin: @schedules.create_learning_rate_scheduler()) or None, got '
          f'{self.learning_rate_schedule!r}.')

  def _check_start(self) -> None:
    """INITIAL_CHECKPOINT_PATH and what a run from it takes with it."""
    path = self.initial_checkpoint_path
    if path is not None:
      if not isinstance(path, str):
        raise ValueError('INITIAL_CHECKPOINT_PATH must be a quoted path or '
                         f'None, got {path!r}.')
      if ('://' not in path and self.model_dir != COMPILE_ONLY
          and not os.path.isdir(path)):
        raise ValueError(f'INITIAL_CHECKPOINT_PATH {path!r} does not exist: '
                         'give a t5x checkpoint_<step> folder.')
    _ = self.growth  # raises on a bad NEW_TASK_INIT or NEW_TASK_SOURCE
    _check_bool('TRAIN_ONLY_NEW_TASKS', self.train_only_new_tasks)
    for macro, value in (('TASK_PARAMS_PATH', self.task_params_path),
                         ('TRAIN_ONLY_NEW_TASKS', self.train_only_new_tasks)):
      if value and not path:
        raise ValueError(
            f'{macro} needs INITIAL_CHECKPOINT_PATH: the checkpoint whose '
            'backbone (and task parameters) the run starts from.')
    if self.task_params_path is not None and not isinstance(
        self.task_params_path, str):
      raise ValueError('TASK_PARAMS_PATH must be a quoted path or None, got '
                       f'{self.task_params_path!r}.')


def _check_int(macro: str, value: Any, minimum: int = 1,
               example: int = 1000) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(
        f'{macro} must be an integer >= {minimum}, got {value!r} '
        f'({type(value).__name__}): e.g. --gin.{macro}={example}.')


def _check_bool(macro: str, value: Any) -> None:
  if not isinstance(value, bool):
    raise ValueError(f'{macro} must be True or False, got {value!r}.')
