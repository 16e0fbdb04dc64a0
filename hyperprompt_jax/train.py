r"""The built-in training runner: `python -m hyperprompt_jax.train`.

For machines without t5x (CI, GPU boxes, laptops); gin-configured with t5x's
flags and macro names, so a t5x user reads it at once:

  python -m hyperprompt_jax.train \
    --gin_file=runs/quickstart.gin --gin.MODEL_DIR="'/tmp/quickstart'"

Macros: MODEL_DIR, MIXTURE_OR_TASK_NAME, TASK_FEATURE_LENGTHS, TRAIN_STEPS,
BATCH_SIZE, INITIAL_CHECKPOINT_PATH (a pretrained t5x checkpoint: backbone
loaded, new parameters fresh, step 0, fresh optimizer state), SAVE_PERIOD,
KEEP_CHECKPOINTS, SEED. A run whose MODEL_DIR holds checkpoints resumes from
the newest (the initial checkpoint is then ignored, as in t5x), data position
included. The operative gin config is written to MODEL_DIR.
"""

import importlib
import logging
import os
import time
from typing import Any, Mapping, Optional, Sequence

from clu import metric_writers
import gin
import jax
import numpy as np

from hyperprompt_jax import batches
from hyperprompt_jax import checkpoint_manager
from hyperprompt_jax import gin_utils
from hyperprompt_jax import input_pipeline
from hyperprompt_jax import methods
from hyperprompt_jax import network
from hyperprompt_jax import optimizers
from hyperprompt_jax import partitioning
from hyperprompt_jax import paths
from hyperprompt_jax import prompt_tuning
from hyperprompt_jax import trainer as trainer_lib
from hyperprompt_jax.tasks import task_ids

log = logging.getLogger('hyperprompt_jax.train')


class NonFiniteLossError(RuntimeError):
  """The loss became NaN or Inf; the last good checkpoint is kept."""


def _eta(seconds: float) -> str:
  seconds = int(seconds)
  return f'{seconds // 3600}h{seconds // 60 % 60:02d}m{seconds % 60:02d}s'


@gin.configurable(denylist=['model'])
def train(
    model: Optional[network.Transformer] = None,
    *,
    model_dir: str = gin.REQUIRED,
    mixture_or_task_name: str = gin.REQUIRED,
    task_feature_lengths: Mapping[str, int] = gin.REQUIRED,
    train_steps: int = gin.REQUIRED,
    batch_size: int = gin.REQUIRED,
    initial_checkpoint_path: Optional[str] = None,
    save_period: int = 2000,
    keep_checkpoints: Optional[int] = None,
    log_period: int = 100,
    seed: int = 0,
    z_loss: float = 1e-4,
    mesh_data: int = -1,
    mesh_model: int = 1,
    pack: bool = False,
    use_cached_tasks: bool = False,
    optimizer=gin.REQUIRED,
) -> dict[str, Any]:
  """Trains `model` (default: the gin-configured network) for `train_steps`.

  Args:
    model: the network; None builds `network.Transformer` from gin.
    model_dir: checkpoints, summaries and the gin config go here.
    mixture_or_task_name: a registered seqio Task / Mixture.
    task_feature_lengths: {'inputs': L_in, 'targets': L_out}.
    train_steps: the step to stop at (fine-tuning counts from 0).
    batch_size: the global batch size.
    initial_checkpoint_path: a pretrained t5x `checkpoint_<step>`.
    save_period: steps between checkpoints (papers: 2000).
    keep_checkpoints: how many to keep (None: all).
    log_period: steps between progress lines and summaries.
    seed: parameters, dropout (`fold_in(seed, step)`) and data order.
    z_loss: t5x's z-loss coefficient.
    mesh_data, mesh_model: the device mesh (-1: the remaining devices).
    pack: pack several examples per row (T5's fine-tuning default), each
      token carrying its example's task id; refused up front for methods
      that cannot condition per token (HyperGrid, Output Gating).
    use_cached_tasks: read seqio's offline cache.
    optimizer: an optax transformation (gin: `@optimizers.make_optimizer()`).

  Returns:
    {'step', 'loss', 'params'}: the final step, last logged loss and the
    final parameters (host numpy).
  """
  model = model or gin.get_configurable(network.Transformer)()
  paths.check_writable_dir(model_dir, 'MODEL_DIR')
  task_ids.check_num_tasks(model.config.num_tasks)
  mesh = partitioning.create_mesh(mesh_data, mesh_model)
  if batch_size % mesh.shape['data']:
    raise ValueError(f'BATCH_SIZE={batch_size} does not divide over the '
                     f"mesh's {mesh.shape['data']} data shards.")
  if pack:
    methods.check_packing(model.config)
  prompt_length = prompt_tuning.prompt_length(model.config.prompt_tuning)
  dataset = input_pipeline.train_dataset(
      mixture_or_task_name, task_feature_lengths, batch_size, seed=seed,
      pack=pack, use_cached=use_cached_tasks,
      input_prompt_length=prompt_length if pack else 0)
  iterator = iter(dataset)
  trainer = trainer_lib.Trainer(model, optimizer, mesh, task_feature_lengths,
                                z_loss=z_loss, seed=seed)
  manager = checkpoint_manager.make_manager(model_dir, save_period,
                                            keep_checkpoints)
  latest = manager.latest_step()
  if latest is not None:
    state = checkpoint_manager.restore(manager, latest,
                                       trainer.abstract_state(), iterator)
    log.info('Resumed from %s/checkpoint_%d.', model_dir, latest)
  elif initial_checkpoint_path:
    params, fresh = trainer.params_from_t5x(initial_checkpoint_path)
    state = trainer.new_state(params)
    log.info('Loaded %s; %d new parameters initialised.',
             initial_checkpoint_path, len(fresh))
  else:
    state = trainer.new_state(trainer.fresh_params())
  start = int(state['step'])

  writer = metric_writers.create_default_writer(
      model_dir, just_logging=jax.process_index() > 0)
  with open(os.path.join(model_dir, 'config.gin'), 'w') as f:
    f.write(gin.config_str())

  def check_finite(terms_history, step):
    if not all(bool(t['finite']) for t in terms_history):
      last = manager.latest_step()
      manager.wait_until_finished()
      raise NonFiniteLossError(
          f'The loss became NaN or Inf before step {step}; the update was not '
          f'applied and the run stopped. Last good checkpoint: '
          f'{"checkpoint_%d" % last if last is not None else "none"} in '
          f'{model_dir}. Lower the learning rate, or check the data.')

  pending, last_loss = [], float('nan')
  tick, tick_step = time.time(), start
  step = start
  try:
    while step < train_steps:
      local = input_pipeline.as_numpy(next(iterator))
      # Inside jit an out-of-range task or token id would clamp silently.
      batches.validate_batch(local, model.config.num_tasks,
                             model.config.vocab_size,
                             required=batches.required_features(pack),
                             input_prompt_length=prompt_length)
      batch = trainer.global_batch(local)
      state, terms = trainer.step(state, batch)
      step += 1
      pending.append(terms)
      if step == start + 1:
        with open(os.path.join(model_dir, 'operative_config.gin'), 'w') as f:
          f.write(gin.operative_config_str())
      due_save = step % save_period == 0 or step == train_steps
      if step % log_period == 0 or due_save:
        check_finite(pending, step)
        metrics = {k: float(np.mean([float(t[k]) for t in pending]))
                   for k in ('loss', 'cross_entropy', 'z_loss', 'accuracy')}
        # Real (non-padding) tokens, inputs and targets.
        tokens = sum(float(t['tokens']) + float(t['input_tokens'])
                     for t in pending)
        capacity = sum(float(t['capacity']) for t in pending)
        elapsed = time.time() - tick
        steps_per_s = (step - tick_step) / max(elapsed, 1e-9)
        metrics.update(steps_per_sec=steps_per_s,
                       tokens_per_sec=tokens / max(elapsed, 1e-9),
                       packing_efficiency=tokens / max(capacity, 1.0))
        writer.write_scalars(step, metrics)
        last_loss = metrics['loss']
        log.info('step %d/%d  loss %.4f  accuracy %.3f  %.2f steps/s  '
                 '%.0f tokens/s  %.0f%% of rows filled  ETA %s', step,
                 train_steps, metrics['loss'], metrics['accuracy'],
                 steps_per_s, metrics['tokens_per_sec'],
                 100 * metrics['packing_efficiency'],
                 _eta((train_steps - step) / max(steps_per_s, 1e-9)))
        pending, tick, tick_step = [], time.time(), step
      if due_save:
        checkpoint_manager.save(manager, step, state, iterator,
                                force=step == train_steps)
  finally:
    manager.wait_until_finished()
    writer.flush()
  params = jax.device_get(state['params'])
  return {'step': step, 'loss': last_loss, 'params': params}


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = gin_utils.parse_command_line(
      'python -m hyperprompt_jax.train', __doc__, argv, logger=log,
      add_flags=lambda parser: parser.add_argument(
          '--multiprocess', action='store_true',
          help='call jax.distributed.initialize() (multi-host GPU; TPU pods '
          'detect their hosts themselves)'))
  # Parsing gin computes nothing, so the hosts may join after it.
  if args.multiprocess or os.environ.get('JAX_COORDINATOR_ADDRESS'):
    jax.distributed.initialize()
  # Under `python -m` this file is `__main__`; gin configures the function
  # of the importable module (`hyperprompt_jax.train.train`).
  result = importlib.import_module('hyperprompt_jax.train').train()
  log.info('Finished at step %d, loss %.4f.', result['step'], result['loss'])
  return 0


if __name__ == '__main__':
  gin_utils.run(main)
