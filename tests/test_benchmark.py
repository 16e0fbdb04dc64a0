"""The benchmark's training step learns, and its report has one row per
(batch size, model) with MTL as the unit."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import T5X_TINY_CONFIG
from hyperprompt_jax import methods
from hyperprompt_jax.benchmarks import benchmark_suite
from hyperprompt_jax.benchmarks import length_estimates
from hyperprompt_jax.benchmarks import mfu
from hyperprompt_jax.benchmarks import packing_benchmark
from hyperprompt_jax.benchmarks import timing
from hyperprompt_jax.model import network
from hyperprompt_jax.tasks import packing
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import trainer


def test_train_step_reduces_the_loss_on_a_repeated_batch():
  cfg = benchmark_suite.variant_config(T5X_TINY_CONFIG, 'hyperprompt_global', 'both')
  model = benchmark_suite.network.Transformer(cfg)
  batch = timing.random_batch(np.random.default_rng(0), 4, 8, 4, 384)
  params = jax.jit(lambda r: benchmark_suite.network.init_variables(
      model, r, 8, 4)['params'])(jax.random.PRNGKey(0))
  opt = optimizers.make_optimizer(learning_rate=1e-2)
  state = {'step': jnp.zeros((), jnp.int32), 'params': params,
           'opt_state': opt.init(params)}
  # The benchmark times the built-in runner's own step.
  step = jax.jit(functools.partial(trainer.train_step, model, opt,
                                   z_loss=timing.Z_LOSS))
  losses = []
  for i in range(8):
    state, terms = step(state, batch, jax.random.PRNGKey(i))
    losses.append(float(terms['loss']))
  assert losses[-1] < 0.8 * losses[0]


def test_report_rows():
  cfg = dataclasses.replace(T5X_TINY_CONFIG, num_encoder_layers=1,
                            num_decoder_layers=1)
  rows = benchmark_suite.benchmark(cfg, [1, 2], ['hyperprompt_global'], 'decoder',
                             input_length=8, target_length=4, rounds=1,
                             steps=1)
  assert [(r['batch_size'], r['variant']) for r in rows] == [
      (1, 'mtl'), (1, 'hyperprompt_global'), (2, 'mtl'),
      (2, 'hyperprompt_global')]
  assert all(r['seconds_per_step'] > 0 and r['peak_bytes'] > 0 for r in rows)
  assert rows[0]['ratio_to_mtl'] == 1.0 and rows[2]['ratio_to_mtl'] == 1.0
  # More parameters (and optimizer state) than MTL: more peak memory.
  assert rows[1]['peak_ratio_to_mtl'] > 1.0
  assert 'time / MTL' in benchmark_suite.format_rows(rows)


def test_metabalance_rows():
  """The plain step is the unit; 'each' and 'all' add the shares'
  gradients to running totals, so their peak memory is above the plain
  step's and does not grow with the number of tasks (K = 3 and 7) beyond
  the moving averages and the shares' masks (a float per tensor, and per
  target token, for each auxiliary)."""
  cfg = dataclasses.replace(T5X_TINY_CONFIG, num_encoder_layers=1,
                            num_decoder_layers=1)
  rows = benchmark_suite.metabalance_benchmark(cfg, 8, [4, 8], input_length=8,
                                         target_length=4, rounds=1, steps=1)
  assert [(r['num_tasks'], r['gradient']) for r in rows] == [
      (t, g) for t in (4, 8) for g in ('plain', 'each', 'all')]
  assert all(r['seconds_per_step'] > 0 for r in rows)
  by = {(r['num_tasks'], r['gradient']): r for r in rows}
  assert by[4, 'plain']['ratio_to_plain'] == 1.0
  for t in (4, 8):
    assert by[t, 'each']['peak_bytes'] > by[t, 'plain']['peak_bytes']
    assert by[t, 'all']['peak_bytes'] > by[t, 'plain']['peak_bytes']
  tensors = len(jax.tree.leaves(jax.eval_shape(
      lambda: network.init_variables(network.Transformer(cfg),
                                     jax.random.PRNGKey(0), 8, 4))))
  # 4 more auxiliaries: float32 averages (a tensor's) and masks (8 x 4
  # target tokens), each twice at most (the averages are an argument and
  # an output). Stacked gradients would add 4 gradients (~100 KB each).
  growth = 4 * 4 * (tensors + 8 * 4)
  assert (by[8, 'each']['peak_bytes']
          <= by[4, 'each']['peak_bytes'] + 2 * growth)


def test_decode_rows():
  """One decode step per model against its cache, MTL the unit; HyperGrid's
  cache (its decoder gates) decodes too."""
  cfg = dataclasses.replace(T5X_TINY_CONFIG, num_encoder_layers=1,
                            num_decoder_layers=1, mlp_dim=128)
  rows = benchmark_suite.decode_benchmark(cfg, 2, ['hyperprompt_global', 'hypergrid_lg'],
                                    'both', input_length=8, target_length=4,
                                    rounds=1, steps=1)
  assert [r['variant'] for r in rows] == ['mtl', 'hyperprompt_global', 'hypergrid_lg']
  assert all(r['seconds_per_step'] > 0 for r in rows)
  assert rows[0]['ratio_to_mtl'] == 1.0


def test_variant_table_rows():
  """The table's MTL row is the unit; Prompt-Tuning's longer encoder input
  costs FLOPs, the adapters cost parameters."""
  small = dataclasses.replace(T5X_TINY_CONFIG, num_encoder_layers=1,
                              num_decoder_layers=1)
  rows = benchmark_suite.variant_table(small, T5X_TINY_CONFIG,
                                 ['adapter', 'prompt_tuning'], 'both',
                                 input_length=8, target_length=4,
                                 batch_size=2, flops_batch_size=2, rounds=1,
                                 steps=1)
  by_variant = {r['variant']: r for r in rows}
  assert [r['variant'] for r in rows] == ['mtl', 'adapter', 'prompt_tuning']
  assert by_variant['mtl']['parameter_ratio'] == 1.0
  assert by_variant['mtl']['flops_ratio'] == 1.0
  assert by_variant['mtl']['step_time_ratio'] == 1.0
  assert by_variant['adapter']['parameter_ratio'] > 1.0
  # 12 prompt positions before 8 tokens: a much longer encoder pass.
  assert by_variant['prompt_tuning']['flops_ratio'] > 1.5
  assert 'FLOPs / MTL' in benchmark_suite.format_table(rows)


def test_every_variant_is_task_conditioned_and_mtl_is_not():
  for name in ('mtl',) + benchmark_suite.VARIANTS:
    cfg = benchmark_suite.variant_config(T5X_TINY_CONFIG, name, 'both')
    assert benchmark_suite.network.is_task_conditioned(cfg) == (name != 'mtl')


def test_packing_rows():
  """Packed rows hold more examples and real tokens than unpacked ones on
  GLUE-like lengths; the estimated lengths follow the mixture's rates."""
  cfg = dataclasses.replace(T5X_TINY_CONFIG, num_encoder_layers=1,
                            num_decoder_layers=1)
  configs = {'mtl': benchmark_suite.variant_config(cfg, 'mtl', 'both')}
  rows = packing_benchmark.packing_benchmark(
      configs, 2, 128, 16, ['glue_super_glue'], rounds=1, steps=1,
      stream_rows=40)['glue_super_glue']
  assert [r['variant'] for r in rows] == ['mtl']
  mtl = rows[0]
  assert mtl['packed_examples_per_row'] > mtl['unpacked_examples_per_row'] == 1
  assert mtl['packed_efficiency'] > mtl['unpacked_efficiency']
  assert mtl['packed_step_to_mtl'] == 1.0
  assert mtl['packed_step_to_mtl_interval'] == (1.0, 1.0)
  low, high = mtl['speedup_interval']
  assert low <= mtl['speedup'] <= high
  # Unpacked rows hold the stream's first examples, one each (targets
  # trimmed to 16): their fill, from the drawn lengths.
  held = round(40 * mtl['packed_examples_per_row'])
  drawn = packing_benchmark.example_lengths(  # the benchmark's draw
      'glue_super_glue', (40 + packing.BUFFER_SIZE) * 16 // 2)[:held]
  tokens = sum(min(i, 128) + min(t, 16) for i, t, _ in drawn)
  assert mtl['unpacked_efficiency'] == pytest.approx(
      tokens / (held * (128 + 16)))
  with pytest.raises(ValueError, match='stream_rows'):
    packing_benchmark.packing_benchmark(
        configs, 4, 128, 16, ['glue_super_glue'], 1, 1, stream_rows=2)
  text = packing_benchmark.format_packing(rows)
  assert 'tasks per packed row' in text and '1 rounds x 1 steps' in text
  # QQP and MNLI (756,548 of the 1,133,190 training examples: 0.668)
  # dominate the draw.
  tasks = [t for _, _, t in packing_benchmark.example_lengths(
      'glue_super_glue', 4000)]
  names = list(length_estimates.GLUE_SUPER_GLUE)
  share = np.mean([names[t] in ('glue_qqp', 'glue_mnli') for t in tasks])
  assert 0.64 < share < 0.70, share


def test_step_times_interleave_the_runners_and_time_every_call():
  calls = []

  def runner(name):
    return lambda i: calls.append((name, i)) or jnp.zeros(())

  times = timing.step_times({n: runner(n) for n in 'abc'}, rounds=3, steps=2)
  assert {n: t.shape for n, t in times.items()} == {n: (3, 2) for n in 'abc'}
  assert all((t > 0).all() for t in times.values())
  # Each round starts at the next runner; each runner's steps are 0, 1.
  order = [n for n, i in calls if i == 0]
  assert order == list('abc' 'bca' 'cab')
  assert [i for _, i in calls] == [0, 1] * 9


def test_relative_ratio_divides_out_the_rounds_level_and_the_jitter():
  # b costs 1.25x a. Round 1 runs the machine 2x slower (both runners),
  # and one call of a in round 2 jitters 3x. By hand: the rounds' levels
  # are sqrt(mean a * mean b) = sqrt(1.25), 2 sqrt(1.25), sqrt(2.5); a's
  # six relative times are 1 / sqrt(1.25) four times, 1 / sqrt(2.5) and
  # 3 / sqrt(2.5) (median 1 / sqrt(1.25)); b's sqrt(1.25) four times and
  # 1.25 / sqrt(2.5) twice (median sqrt(1.25)): the ratio is 1.25.
  a = np.array([[1.0, 1.0], [2.0, 2.0], [1.0, 3.0]])
  b = np.array([[1.25, 1.25], [2.5, 2.5], [1.25, 1.25]])
  times = {'a': a, 'b': b}
  assert timing.relative_ratio(times, 'b', 'a') == pytest.approx(1.25)
  assert timing.relative_ratio(times, 'a', 'b') == pytest.approx(0.8)
  # The ratio of the raw medians mixes in the slow round: 1.25 / 1.5.
  assert np.median(b) / np.median(a) == pytest.approx(1.25 / 1.5)
  # A third runner changes the levels, not the ratio of these two.
  times['c'] = np.array([[5.0, 5.0], [10.0, 10.0], [5.0, 5.0]])
  assert timing.relative_ratio(times, 'b', 'a') == pytest.approx(1.25)


def test_relative_ratio_interval_holds_the_true_ratio():
  """Simulated runs of 4 runners, b 1.05x a: 6 rounds x 2 steps, each call
  jittered by 4 % (log-normal) and each round's machine by 5 %. The
  95 % bootstrap interval holds 1.05 in most runs (a bootstrap over 6
  rounds is narrow: ~90 % here), and narrows with more rounds."""
  rng = np.random.default_rng(1)
  costs = {'a': 1.0, 'b': 1.05, 'c': 0.98, 'd': 1.1}

  def run(rounds):
    drift = np.exp(rng.normal(0, 0.05, (rounds, 1)))
    return {n: c * drift * np.exp(rng.normal(0, 0.04, (rounds, 2)))
            for n, c in costs.items()}

  held, widths = 0, {6: [], 24: []}
  for sim in range(100):
    for rounds in (6, 24):
      times = run(rounds)
      low, high = timing.relative_ratio_interval(times, 'b', 'a', draws=200)
      assert low <= timing.relative_ratio(times, 'b', 'a') <= high
      widths[rounds].append(high - low)
      held += rounds == 6 and low <= 1.05 <= high
  assert held >= 80, held
  # 4x the rounds: narrower (not quite half, as 6 rounds' is too narrow).
  assert 0.4 < np.mean(widths[24]) / np.mean(widths[6]) < 0.75
  # Without jitter or drift every resample gives the true ratio.
  exact = {n: np.full((6, 2), c) for n, c in costs.items()}
  assert timing.relative_ratio_interval(exact, 'b', 'a') == (
      pytest.approx(1.05), pytest.approx(1.05))
  # Seeded: the same times, the same interval.
  times = run(6)
  assert (timing.relative_ratio_interval(times, 'd', 'a')
          == timing.relative_ratio_interval(times, 'd', 'a'))


def test_variants_are_named_as_their_gin_files():
  """One name a variant: the benchmarks' --variants take the gin/variants
  file's name; HyperPrompt's old short names still work, with a warning,
  for one release."""
  assert set(benchmark_suite.VARIANTS) == {
      os.path.splitext(os.path.basename(f))[0]
      for f in methods.variant_files()}
  assert 'hyperprompt_global' in benchmark_suite.VARIANTS
  assert 'hyperprompt_global' in mfu.VARIANTS and 'global' not in mfu.VARIANTS
  with pytest.warns(DeprecationWarning, match="'global' is now "
                    "'hyperprompt_global'"):
    assert methods.variant_names('global,,adapter') == [
        'hyperprompt_global', 'adapter']
