"""The built-in runner's training loop, `python -m hyperprompt_jax.train`.

`train` takes a run's `run_settings.RunSettings`, checks them against the
model, tasks and devices (`_resolve`), locks MODEL_DIR, restores or
initialises the state (`_restore_or_start`), and steps, logs, checkpoints
and evaluates (`_StepLoop`) until TRAIN_STEPS, surviving preemption.
"""

import argparse
import contextlib
import dataclasses
import logging
import math
import threading
import time
from typing import Any, Callable, Mapping, Optional


from clu import metric_writers
import gin
import jax
import numpy as np

from hyperprompt_jax import paths
from hyperprompt_jax.checkpointing import checkpoint_manager
from hyperprompt_jax.checkpointing import initial_checkpoint
from hyperprompt_jax.checkpointing import run_record
from hyperprompt_jax.common import batches
from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.common import input_pipeline
from hyperprompt_jax.common import multihost
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.model import network
from hyperprompt_jax.runner import preemption
from hyperprompt_jax.runner import run_lock
from hyperprompt_jax.tasks import task_ids
from hyperprompt_jax.training import metabalance
from hyperprompt_jax.training import metabalance_plan
# Imported for gin: runs/train.gin binds `@optimizers.make_optimizer()`.
from hyperprompt_jax.training import optimizers  # pylint: disable=unused-import
from hyperprompt_jax.training import run_settings
from hyperprompt_jax.training import trainer as trainer_lib

log = logging.getLogger('hyperprompt_jax.train')


class NonFiniteLossError(gin_utils.ReportedError):
  """The loss became NaN or Inf; the last good checkpoint is kept."""


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """Evaluation during training (EVAL_PERIOD, KEEP_BEST_BY), for the loop.

  The train command hands one to `train` (`during_training.EVALUATION`): the
  runner imports nothing of the evaluation above it.

  Attributes:
    check_settings: `(eval_period, examples_per_task, keep_best_by,
      batch_size)`: raises ValueError on a setting it cannot use.
    check_tasks: `(mixture_or_task_name, keep_best_by)`: raises ValueError if
      the run's tasks have nothing to evaluate or no KEEP_BEST_BY score.
    evaluator: `(model, mixture_or_task_name, task_feature_lengths, mesh,
      model_dir, batch_size, examples_per_task, keep_best_by, use_cached)` ->
      an evaluator with `evaluate(step, params)` (an evaluation's line),
      `evaluated(step)`, `resume(step)`, `best()`, `best_step()`, `close()`.
    keep_best: `(best_step)` -> the orbax preservation policy keeping the
      checkpoint of `best_step()`.
    scalars: an evaluation's line -> its TensorBoard scalars.
    progress: an evaluation's line -> its log line.
  """
  check_settings: Callable[..., None]
  check_tasks: Callable[..., None]
  evaluator: Callable[..., Any]
  keep_best: Callable[..., Any]
  scalars: Callable[[Mapping[str, Any]], dict[str, float]]
  progress: Callable[[Mapping[str, Any]], str]


def _check_evaluation(evaluation: Optional[Evaluation],
                      settings: run_settings.RunSettings) -> None:
  """The evaluation settings; without an evaluation, both must be off."""
  eval_period, keep_best_by = settings.eval_period, settings.keep_best_by
  if evaluation is not None:
    evaluation.check_settings(eval_period, settings.eval_examples_per_task,
                              keep_best_by, settings.eval_batch_size)
  elif eval_period is not None or keep_best_by is not None:
    raise ValueError(
        f'EVAL_PERIOD={eval_period!r}, KEEP_BEST_BY={keep_best_by!r}: this '
        'call of train has no evaluation to run. Run the train command '
        '(python -m hyperprompt_jax.train), or pass train(evaluation='
        'during_training.EVALUATION).')


def _eta(seconds: float) -> str:
  seconds = int(seconds)
  return f'{seconds // 3600}h{seconds // 60 % 60:02d}m{seconds % 60:02d}s'


def _first_new_task(model, settings: run_settings.RunSettings) -> int:
  """The first task TRAIN_ONLY_NEW_TASKS trains: those trained before."""
  first = initial_checkpoint.trained_tasks(
      model, settings.initial_checkpoint_path, settings.task_params_path)
  if first >= model.config.num_tasks:
    raise ValueError(
        f'TRAIN_ONLY_NEW_TASKS: the model has no new tasks (NUM_TASKS='
        f'{model.config.num_tasks}, and {settings.initial_checkpoint_path} '
        f'has {first}); raise NUM_TASKS to the tasks of the run, new ones '
        'included.')
  return first


def train(model: Optional[network.Transformer] = None,
          evaluation: Optional[Evaluation] = None,
          settings: Optional[run_settings.RunSettings] = None
          ) -> dict[str, Any]:
  """Trains `model` for `settings.train_steps`.

  Every setting is checked before anything is written or compiled. The run
  holds `MODEL_DIR/train.lock` while it runs (`run_lock`), resumes from the
  newest checkpoint that restores (`checkpoint_manager.restore_newest`), and
  on SIGTERM / SIGINT / preemption saves at the next step and returns
  (`preemption`).

  Args:
    model: the network; None builds `network.Transformer` from gin.
    evaluation: what evaluates during training (the train command's
      `during_training.EVALUATION`); None: EVAL_PERIOD must be None.
    settings: the run's settings; None makes them from gin (runs/train.gin
      binds `run_settings.RunSettings` from the macros).

  Returns:
    {'step', 'loss', 'params', 'stopped_by'}: the final step, last logged
    loss, the final parameters (host numpy; None where the model axis spans
    processes and no process holds them all), and the signal that stopped
    the run early ('SIGTERM', 'SIGINT', 'preemption'; None if it finished).
  """
  settings = settings or run_settings.RunSettings()
  run = _resolve(settings, model, evaluation)
  # Every process writes its part of each checkpoint.
  multihost.raise_everywhere(
      lambda: paths.check_writable_dir(settings.model_dir, 'MODEL_DIR'),
      ValueError, on_process_0_only=False)
  # Process 0 holds the lock; a refusal stops every process at once, with
  # the same message.
  lock = (run_lock.RunLock(settings.model_dir) if jax.process_index() == 0
          else None)
  multihost.raise_everywhere(lock.acquire if lock else lambda: None,
                             run_lock.DirectoryInUseError)
  try:
    return _train(lock, run)
  finally:
    if lock:
      lock.release()


@dataclasses.dataclass(frozen=True)
class _Run:
  """A run's settings, resolved with its model, tasks and devices."""
  settings: run_settings.RunSettings
  model: network.Transformer
  evaluation: Optional[Evaluation]
  mesh: jax.sharding.Mesh
  optimizer: Any
  balancing: Optional[metabalance.Plan]
  num_microbatches: int
  first_new_task: Optional[int]


def _resolve(settings: run_settings.RunSettings,
             model: Optional[network.Transformer],
             evaluation: Optional[Evaluation]) -> _Run:
  """The run of `settings` here; ValueError, naming the macro, if it misfits."""
  _check_evaluation(evaluation, settings)
  model = model or gin.get_configurable(network.Transformer)()
  task_ids.check_num_tasks(model.config.num_tasks)
  input_pipeline.check_samplable(settings.mixture_or_task_name)
  if settings.eval_period:
    evaluation.check_tasks(settings.mixture_or_task_name,
                           settings.keep_best_by)
  balancing = metabalance_plan.settings_plan(settings, model)
  mesh = partitioning.create_mesh(settings.mesh_data, settings.mesh_model)
  if settings.batch_size % mesh.shape['data']:
    data = mesh.shape['data']
    raise ValueError(
        f'BATCH_SIZE={settings.batch_size} does not divide over the mesh\'s '
        f'{data} data shards (MESH_DATA x MESH_MODEL = {data} x '
        f"{mesh.shape['model']} devices): set --gin.BATCH_SIZE to a multiple "
        f'of {data}, or a larger MESH_MODEL for fewer data shards.')
  num_microbatches = trainer_lib.check_num_microbatches(
      settings.num_microbatches, settings.batch_size // mesh.shape['data'])
  optimizer, first_new_task = settings.optimizer, None
  if settings.train_only_new_tasks:
    first_new_task = _first_new_task(model, settings)
    optimizer = initial_checkpoint.only_new_task_params(optimizer, model,
                                                        first_new_task)
  return _Run(settings, model, evaluation, mesh, optimizer, balancing,
              num_microbatches, first_new_task)


def _train(lock: Optional[run_lock.RunLock], run: _Run) -> dict[str, Any]:
  """`train` once the settings are checked and the directory is locked."""
  settings = run.settings
  rows = batches.RowFormat.of(run.model.config, settings.pack)
  trainer = trainer_lib.Trainer(
      run.model, run.optimizer, run.mesh, settings.task_feature_lengths,
      z_loss=settings.z_loss, seed=settings.seed, balancing=run.balancing,
      num_microbatches=run.num_microbatches,
      checked_on_host=True)  # `_StepLoop._step`
  layout = trainer.data_layout
  dataset = input_pipeline.train_dataset(
      settings.mixture_or_task_name, settings.task_feature_lengths,
      settings.batch_size, seed=settings.seed, rows=rows,
      use_cached=settings.use_cached_tasks, shard_index=layout.shard_index,
      num_shards=layout.num_shards)
  if jax.process_count() > 1:
    log.info('Process %d of %d reads data shard %d of %d (%d rows of the '
             'global batch of %d).', jax.process_index(), jax.process_count(),
             layout.shard_index, layout.num_shards,
             settings.batch_size // layout.num_shards, settings.batch_size)
  evaluator = None
  if settings.eval_period:
    evaluator = run.evaluation.evaluator(
        run.model, settings.mixture_or_task_name,
        settings.task_feature_lengths, run.mesh, settings.model_dir,
        settings.eval_batch_size, settings.eval_examples_per_task,
        settings.keep_best_by, settings.use_cached_tasks)
  manager = checkpoint_manager.make_manager(
      settings.model_dir, settings.save_period, settings.keep_checkpoints,
      run.evaluation.keep_best(evaluator.best_step)
      if settings.keep_best_by else None)
  data = _data_record(run, rows)
  state, iterator = _restore_or_start(run, trainer, manager, dataset, data)
  start = int(state['step'])
  if evaluator:
    evaluator.resume(start)
  writer = metric_writers.create_default_writer(
      settings.model_dir, just_logging=jax.process_index() > 0)
  loop = _StepLoop(run, lock, trainer, manager, writer, evaluator, data,
                   layout.record(), rows, start)
  try:
    return loop.run(state, iterator)
  finally:
    # What a finished run still waits on is said, not silent: the last
    # save's commit, and the input pipeline, whose deletion waits for
    # tf.data's threads to finish the elements in flight.
    with _said_if_slow('Waiting for the last checkpoint to commit'):
      manager.wait_until_finished()
      del loop, manager
    writer.flush()
    if evaluator:
      evaluator.close()
    with _said_if_slow('Stopping the input pipeline'):
      del iterator, dataset, evaluator


@contextlib.contextmanager
def _said_if_slow(what: str, after_s: float = 2.0):
  """Logs `what ...` once the block takes `after_s` seconds, then its time."""
  began = time.time()
  timer = threading.Timer(after_s, log.info, ('%s ...', what))
  timer.daemon = True
  timer.start()
  try:
    yield
  finally:
    timer.cancel()
    if time.time() - began >= after_s:
      log.info('%s: done in %.1fs.', what, time.time() - began)


def _data_record(run: _Run, rows: batches.RowFormat) -> dict[str, Any]:
  """The run record's data settings: what a resume must keep."""
  settings = run.settings
  data = run_record.data_settings(
      settings.mixture_or_task_name, settings.task_feature_lengths,
      settings.batch_size, settings.pack, settings.seed, rows.max_examples)
  # The optimizer state's shape depends on it: a resume must keep it.
  # (The record's name for it, kept: older records keep checking.)
  data['TRAIN_ONLY_NEW_TASKS_FROM_ROW'] = run.first_new_task
  # So is MetaBalance's (its moving averages, one per auxiliary).
  data['GRADIENT_BALANCING'] = run.balancing and run_record.balancing_record(
      dataclasses.asdict(run.balancing.settings))
  # The rates a resumed run continues (the optimizer state counts steps).
  if settings.learning_rate_schedule is not None:
    data[run_record.SCHEDULE] = settings.learning_rate_schedule.record()
  return data


def _restore_or_start(run: _Run, trainer: trainer_lib.Trainer, manager,
                      dataset, data: Mapping[str, Any]) -> tuple[Any, Any]:
  """`(state, data iterator)`: MODEL_DIR's newest checkpoint, else step 0.

  The newest that restores, checked against the run's settings; else from
  INITIAL_CHECKPOINT_PATH or fresh parameters.
  """
  model, settings = run.model, run.settings
  layout = trainer.data_layout

  def check_resume(step, record):
    if record is not None:
      run_record.check_resume(record, model.config, data,
                              f'checkpoint_{step}', task_ids.run_task_list())
    return run_record.data_source(record, layout,
                                  settings.restart_data_on_layout_change,
                                  f'checkpoint_{step}')

  restored = checkpoint_manager.restore_newest(
      manager, trainer.abstract_state(), lambda: iter(dataset), check_resume)
  if restored is not None:
    latest, state, iterator = restored
    if latest > settings.train_steps:
      raise ValueError(
          f'MODEL_DIR {settings.model_dir} is at step {latest}, past '
          f'TRAIN_STEPS={settings.train_steps}: raise TRAIN_STEPS to train '
          'on, or use a new MODEL_DIR.')
    log.info('Resuming from %s/checkpoint_%d (TRAIN_STEPS=%d).',
             settings.model_dir, latest, settings.train_steps)
    return state, iterator
  if not settings.initial_checkpoint_path:
    log.info('Starting in %s from fresh parameters.', settings.model_dir)
    return trainer.new_state(trainer.fresh_params()), iter(dataset)
  params, fresh, checkpoint_tasks = initial_checkpoint.params_from_t5x(
      trainer, settings.initial_checkpoint_path, settings.task_params_path,
      settings.growth, task_ids.run_task_list())
  log.info('Starting in %s from %s%s; %d new parameters initialised.',
           settings.model_dir, settings.initial_checkpoint_path,
           f' with the task parameters of {settings.task_params_path}'
           if settings.task_params_path else '', len(fresh))
  if checkpoint_tasks and checkpoint_tasks < model.config.num_tasks:
    log.info('The parameters of tasks %d to %d (new task ids) set by '
             'NEW_TASK_INIT=%r%s.', checkpoint_tasks,
             model.config.num_tasks - 1, settings.growth.rule,
             '; only they train' if run.first_new_task is not None
             else '')
  return trainer.new_state(params), iter(dataset)


class _StepLoop:
  """The steps from `start` to TRAIN_STEPS, logging, saving, evaluating."""

  def __init__(self, run: _Run, lock, trainer, manager, writer, evaluator,
               data, processes, rows, start: int):
    self.settings = run.settings
    self.model = run.model
    self.evaluation = run.evaluation
    self.lock = lock
    self.trainer = trainer
    self.manager = manager
    self.writer = writer
    self.evaluator = evaluator
    self.data = data
    self.processes = processes
    self.rows = rows
    self.start = start
    self.task_list = task_ids.run_task_list()
    # Made at the first save, once the operative config is known; the gin
    # files are written with the first checkpoint saved.
    self.record = None
    self.gin_files_written = False
    self.saved_step = None

  # -- checkpointing -----------------------------------------------------------

  def _save(self, step: int, state, iterator) -> bool:
    """Saves `step` (whatever SAVE_PERIOD says: the loop decides)."""
    settings = self.settings
    # A run presumed gone whose lock was taken over must not overwrite the
    # new holder's checkpoints (process 0 holds the lock; all stop).
    multihost.raise_everywhere(
        self.lock.check_held if self.lock else lambda: None,
        run_lock.LockLostError)
    if self.record is None:
      self.record = run_record.make(self.model.config, self.data,
                                    self.start, self.task_list,
                                    self.processes)
    record = self.record
    if self.evaluator and settings.keep_best_by:
      # The best evaluated checkpoint so far, kept beside the last
      # KEEP_CHECKPOINTS.
      record = dict(record, best_checkpoint=self.evaluator.best())
    saved = checkpoint_manager.save(self.manager, step, state, iterator,
                                    record, force=True)
    if saved:
      self.saved_step = step
      if not self.gin_files_written and jax.process_index() == 0:
        run_record.write_gin_files(settings.model_dir, record)
        self.gin_files_written = True
      log.info('Saving %s/checkpoint_%d.', settings.model_dir, step)
    return saved

  def _check_finite(self, terms_history, step: int) -> None:
    if not all(bool(t['finite']) for t in terms_history):
      last = self.manager.latest_step()
      self.manager.wait_until_finished()
      raise NonFiniteLossError(
          f'The loss became NaN or Inf before step {step}; the update was not '
          f'applied and the run stopped. Last good checkpoint: '
          f'{"checkpoint_%d" % last if last is not None else "none"} in '
          f'{self.settings.model_dir}. Lower the learning rate, or check the '
          'data.')

  # -- curves ----------------------------------------------------------------

  def _log(self, step: int, pending, elapsed: float, steps: int) -> float:
    """Writes the scalars and progress line since the last log; returns loss."""
    settings = self.settings
    metrics = _curves(pending, elapsed, settings.batch_size, self.task_list)
    schedule = settings.learning_rate_schedule
    if schedule is not None:
      # The rate of the step's update (the optimizer counts from 0).
      metrics['learning_rate'] = float(schedule(step - 1))
    steps_per_s = steps / max(elapsed, 1e-9)
    metrics['steps_per_sec'] = steps_per_s
    self.writer.write_scalars(step, metrics)
    log.info('step %d/%d  loss %.4f  accuracy %.3f  %.2f steps/s  '
             '%.0f tokens/s  %.0f%% of rows filled  ETA %s', step,
             settings.train_steps, metrics['loss'], metrics['accuracy'],
             steps_per_s, metrics['tokens_per_sec'],
             100 * metrics['packing_efficiency'],
             _eta((settings.train_steps - step) / max(steps_per_s, 1e-9)))
    return metrics['loss']

  # -- evaluation ------------------------------------------------------------

  def _evaluate(self, step: int, state) -> None:
    """Scores the state of `step`, its checkpoint committed first."""
    if self.saved_step == step:
      self.manager.wait_until_finished()
    line = self.evaluator.evaluate(step, state['params'])
    self.writer.write_scalars(step, self.evaluation.scalars(line))
    self.writer.flush()
    log.info('%s', self.evaluation.progress(line))

  def _evaluate_missing(self, step: int, state) -> None:
    """Scores a resumed checkpoint whose run stopped before scoring it."""
    if (self.evaluator and self.settings.due_eval(step)
        and not self.evaluator.evaluated(step)):
      self._evaluate(step, state)

  # -- the loop ----------------------------------------------------------------

  def run(self, state, iterator) -> dict[str, Any]:
    settings, step = self.settings, self.start
    self._evaluate_missing(step, state)
    if step == settings.train_steps:
      log.info('Already at TRAIN_STEPS=%d: nothing to train.', step)
      return {'step': step, 'loss': float('nan'),
              'params': _host_params(state), 'stopped_by': None}
    pending, last_loss = [], float('nan')
    tick, tick_step = time.time(), step
    stop = preemption.StopRequest(self.manager.reached_preemption,
                                  catch_sigterm=jax.process_count() == 1)
    stopped_by = None
    # The handlers stay until the last save is committed: a SIGTERM while it
    # is written is recorded (the run is saving anyway), not fatal.
    with stop:
      try:
        while step < settings.train_steps:
          state, terms = self._step(state, iterator)
          step += 1
          pending.append(terms)
          due_eval = settings.due_eval(step)
          due_save = (step % settings.save_period == 0
                      or step == settings.train_steps
                      # the best must be a checkpoint
                      or (due_eval and settings.keep_best_by is not None))
          stopping = stop.due(step)
          if step % settings.log_period == 0 or due_save or stopping:
            self._check_finite(pending, step)
            last_loss = self._log(step, pending, time.time() - tick,
                                  step - tick_step)
            pending, tick, tick_step = [], time.time(), step
          if due_save or stopping:
            self._save(step, state, iterator)
          if due_eval:
            began = time.time()
            self._evaluate(step, state)
            tick += time.time() - began  # steps/s counts training only
            # A signal during the evaluation: stop now (the step's
            # checkpoint saved). Several processes agree on a stop at the
            # next step (`stop.due`), as a signal may reach one host only.
            if (not stopping and jax.process_count() == 1
                and stop.signal is not None):
              if self.saved_step != step:
                self._save(step, state, iterator)
              stopping = True
          if stopping and step < settings.train_steps:
            stopped_by = stop.name
            break
      finally:
        self.manager.wait_until_finished()
    if stopped_by:
      log.info('Stopped by %s at step %d with checkpoint_%d saved; run the '
               'same command again to resume.', stopped_by, step, step)
    return {'step': step, 'loss': last_loss, 'params': _host_params(state),
            'stopped_by': stopped_by}

  def _step(self, state, iterator):
    """One optimizer step on the next batch, checked on the host."""
    local = input_pipeline.as_numpy(next(iterator))
    # Inside jit an out-of-range task or token id would clamp silently.
    config = self.model.config
    batches.validate_batch(local, config.num_tasks, config.vocab_size,
                           rows=self.rows)
    return self.trainer.step(state, self.trainer.global_batch(local))


def _curves(pending, elapsed: float, batch_size: int,
            task_list) -> dict[str, float]:
  """The scalars of the steps since the last log, from their terms.

  Means of the loss terms, accuracy and grad_norm; `loss/<task>` and
  `accuracy/<task>`; tokens_per_sec, packing_efficiency, examples_per_row.
  """
  metrics = {k: float(np.mean([float(t[k]) for t in pending]))
             for k in ('loss', 'cross_entropy', 'z_loss', 'accuracy',
                       'grad_norm')}
  task_tokens = sum(np.asarray(t['task_tokens'], np.float64) for t in pending)
  task_loss = sum(np.asarray(t['task_loss'], np.float64) for t in pending)
  task_hits = sum(np.asarray(t['task_hits'], np.float64) for t in pending)
  for i, tokens in enumerate(task_tokens):
    if tokens > 0:
      name = task_list[i] if i < len(task_list) else f'task_{i}'
      metrics[f'loss/{name}'] = float(task_loss[i] / tokens)
      metrics[f'accuracy/{name}'] = float(task_hits[i] / tokens)
  tokens = sum(float(t['tokens']) + float(t['input_tokens']) for t in pending)
  capacity = sum(float(t['capacity']) for t in pending)
  metrics.update(
      tokens_per_sec=tokens / max(elapsed, 1e-9),
      packing_efficiency=tokens / max(capacity, 1.0),
      examples_per_row=(sum(float(t['examples']) for t in pending)
                        / (batch_size * len(pending))))
  return metrics


def _host_params(state) -> Optional[Any]:
  """The parameters as host numpy, where this process holds all of them.

  None where a model axis spans processes, rather than gathering a model the
  size of the pod onto every host.
  """
  if not multihost.fully_addressable(state['params']):
    return None
  return multihost.host_value(state['params'])


def run(args: argparse.Namespace,
        evaluation: Optional[Evaluation] = None) -> int:
  """`python -m hyperprompt_jax.train` with its flags and evaluation."""
  gin_utils.log_to_stdout(log)
  gin_utils.parse_gin_flags(args)
  # Parsing gin computes nothing, so the hosts may join after it.
  multihost.initialize_from_flags(args)
  result = train(evaluation=evaluation)
  if result['stopped_by']:
    return preemption.exit_status(result['stopped_by'])
  if math.isnan(result['loss']):  # no step trained (already at the end)
    log.info('Finished at step %d.', result['step'])
  else:
    log.info('Finished at step %d, loss %.4f.', result['step'],
             result['loss'])
  return 0

