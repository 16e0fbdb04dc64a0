"""The benchmark's training step learns, and its report has one row per
(batch size, model) with MTL as the unit."""

import dataclasses

import jax
import numpy as np

from conftest import T5X_TINY_CONFIG
from hyperprompt_jax import benchmark
from hyperprompt_jax import optimizers


def test_train_step_reduces_the_loss_on_a_repeated_batch():
  cfg = benchmark.variant_config(T5X_TINY_CONFIG, 'global', 'both')
  model = benchmark.network.Transformer(cfg)
  batch = benchmark.random_batch(np.random.default_rng(0), 4, 8, 4, 384)
  params = model.init(jax.random.PRNGKey(0), batch['encoder_input_tokens'],
                      batch['decoder_input_tokens'],
                      batch['decoder_target_tokens'], enable_dropout=False,
                      task_ids=batch['task_ids'])['params']
  opt = optimizers.make_optimizer(learning_rate=1e-2)
  state = opt.init(params)
  step = jax.jit(benchmark.make_train_step(model, opt))
  losses = []
  for i in range(8):
    params, state, loss = step(params, state, batch, jax.random.PRNGKey(i))
    losses.append(float(loss))
  assert losses[-1] < 0.8 * losses[0]


def test_report_rows():
  cfg = dataclasses.replace(T5X_TINY_CONFIG, num_encoder_layers=1,
                            num_decoder_layers=1)
  rows = benchmark.benchmark(cfg, [1, 2], ['global'], 'decoder',
                             input_length=8, target_length=4, rounds=1,
                             steps=1)
  assert [(r['batch_size'], r['model']) for r in rows] == [
      (1, 'mtl'), (1, 'global'), (2, 'mtl'), (2, 'global')]
  assert all(r['seconds_per_step'] > 0 for r in rows)
  assert rows[0]['ratio_to_mtl'] == 1.0 and rows[2]['ratio_to_mtl'] == 1.0
  assert 'ratio to MTL' in benchmark.format_rows(rows)
