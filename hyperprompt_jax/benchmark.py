r"""Training-step time and peak memory of each variant relative to MTL T5.

    python -m hyperprompt_jax.benchmark [--gin_file=models/t5_1_1_small.gin]
        [--batch_sizes=4,8,16] [--input_length=512] [--target_length=32]
        [--variants=adapter,share,global,hypergrid_lg,...] [--placement=both]
        [--rounds=3] [--steps=3] [--gin.ACTIVATION_DTYPE="'float32'"]
    python -m hyperprompt_jax.benchmark --table --batch_sizes=4 \
        [--table_model=models/t5_1_1_base.gin] [--flops_batch_size=128]

For every batch size, one jit-compiled training step (forward, backward,
`make_optimizer`'s Adafactor update) is built for the MTL network and for each
variant, at the papers' defaults: the baselines as gin/variants (Vanilla
Adapter r 32, HyperFormer++ r 16, t' 512, e 128, t 64, Prompt-Tuning 12
tokens), T = 8; HyperPrompt with l_enc 16, l_dec 6, r 32, t' 64, e 128, t 64,
T = 8; HyperGrid with a 32 x 128 grid on `wo`, task attention conditioning,
T = 16. The steps are timed side by side in this one process, in interleaved
rounds (MTL, share, ..., then share, ..., MTL: each round starts one model
later) so drift and position hit every model alike; the
median per-step time gives the ratio variant / MTL. Peak memory is XLA's own
estimate for the compiled step (`compiled.memory_analysis()`: temporaries +
arguments + outputs - aliased). Hyper-prompts are computed once per step for
all tasks, so their ratio should not grow with the batch size.

`--table` prints one row per model: the parameter ratio and the forward FLOPs
per example (XLA's cost analysis, `param_table.forward_flops`) of the
`--table_model` network, beside the step-time ratio of the `--gin_file`
network (T5.1.1-small by default) at the first batch size.
"""

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Optional, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hyperprompt_jax import adapters
from hyperprompt_jax import gin_utils
from hyperprompt_jax import hyperformer
from hyperprompt_jax import hypergrid
from hyperprompt_jax import hyperprompt
from hyperprompt_jax import network
from hyperprompt_jax import optimizers
from hyperprompt_jax import param_table
from hyperprompt_jax import prompt_tuning

HYPERPROMPT_TASKS = 8    # one GLUE or SuperGLUE run
HYPERGRID_TASKS = 16     # GLUE + SuperGLUE co-trained
HYPERPROMPT_VARIANTS = ('share', 'sep', 'global')
HYPERGRID_VARIANTS = ('hypergrid_l', 'hypergrid_l2', 'hypergrid_lg',
                      'hypergrid_gl', 'output_gating')
BASELINE_VARIANTS = ('adapter', 'hyperformer_pp', 'prompt_tuning')
VARIANTS = BASELINE_VARIANTS + HYPERPROMPT_VARIANTS + HYPERGRID_VARIANTS
Z_LOSS = 1e-4


def make_train_step(model: network.Transformer, optimizer):
  """`(params, opt_state, batch, rng) -> (params, opt_state, loss)`."""

  def loss_fn(params, batch, rng):
    logits = model.apply(
        {'params': params}, batch['encoder_input_tokens'],
        batch['decoder_input_tokens'], batch['decoder_target_tokens'],
        enable_dropout=True, task_ids=batch['task_ids'],
        rngs={'dropout': rng},
    )
    targets = batch['decoder_target_tokens']
    log_z = jax.nn.logsumexp(logits, axis=-1)
    nll = log_z - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    weights = (targets > 0).astype(jnp.float32)
    return jnp.sum((nll + Z_LOSS * log_z**2) * weights) / jnp.sum(weights)

  def step(params, opt_state, batch, rng):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def random_batch(rng: np.random.Generator, batch: int, input_length: int,
                 target_length: int, vocab: int):
  targets = rng.integers(1, vocab, (batch, target_length), dtype=np.int32)
  return {
      'encoder_input_tokens': rng.integers(1, vocab, (batch, input_length),
                                           dtype=np.int32),
      'decoder_input_tokens': np.concatenate(
          [np.zeros((batch, 1), np.int32), targets[:, :-1]], 1),
      'decoder_target_tokens': targets,
      'task_ids': rng.integers(0, HYPERPROMPT_TASKS, (batch,),
                               dtype=np.int32),
  }


def variant_config(base: network.T5Config, variant: str,
                   placement: str) -> network.T5Config:
  """The network of `variant` ('mtl' or one of `VARIANTS`), at the papers'
  defaults (the gin/variants files' values)."""
  base = dataclasses.replace(base, hyperprompt=None, hypergrid=None,
                             adapter=None, hyperformer=None,
                             prompt_tuning=None, num_tasks=HYPERPROMPT_TASKS)
  if variant == 'mtl':
    return base
  if variant == 'adapter':
    return dataclasses.replace(
        base, adapter=adapters.AdapterConfig(placement=placement))
  if variant == 'hyperformer_pp':
    return dataclasses.replace(
        base, hyperformer=hyperformer.HyperFormerConfig(placement=placement))
  if variant == 'prompt_tuning':
    return dataclasses.replace(base,
                               prompt_tuning=prompt_tuning.PromptTuningConfig())
  if variant in HYPERPROMPT_VARIANTS:
    return dataclasses.replace(
        base, num_tasks=HYPERPROMPT_TASKS,
        hyperprompt=hyperprompt.HyperPromptConfig(variant=variant,
                                                  placement=placement))
  if variant in HYPERGRID_VARIANTS:
    return dataclasses.replace(
        base, num_tasks=HYPERGRID_TASKS,
        hypergrid=hypergrid.HyperGridConfig(
            variant=variant.removeprefix('hypergrid_'), placement=placement))
  raise ValueError(f'Unknown variant {variant!r}: choose from {VARIANTS}.')


def peak_bytes(compiled) -> int:
  """XLA's peak-memory estimate of a compiled computation."""
  m = compiled.memory_analysis()
  return (m.temp_size_in_bytes + m.argument_size_in_bytes
          + m.output_size_in_bytes - m.alias_size_in_bytes)


def benchmark(base: network.T5Config, batch_sizes: Sequence[int],
              variants: Sequence[str], placement: str, input_length: int,
              target_length: int, rounds: int, steps: int) -> list[dict]:
  """Returns one row per (batch size, model): median seconds per step,
  peak bytes, and their ratios to MTL at that batch size."""
  rows = []
  optimizer = optimizers.make_optimizer()
  names = ['mtl', *variants]
  for batch_size in batch_sizes:
    batch = random_batch(np.random.default_rng(0), batch_size, input_length,
                         target_length, base.vocab_size)
    runners = {}
    for name in names:
      model = network.Transformer(variant_config(base, name, placement))
      params = jax.jit(lambda rng, m=model: m.init(
          rng, batch['encoder_input_tokens'], batch['decoder_input_tokens'],
          batch['decoder_target_tokens'], enable_dropout=False,
          task_ids=batch['task_ids'])['params'])(jax.random.PRNGKey(0))
      opt_state = optimizer.init(params)
      rng = jax.random.PRNGKey(1)
      step = jax.jit(make_train_step(model, optimizer),
                     donate_argnums=(0, 1)).lower(params, opt_state, batch,
                                                  rng).compile()
      state = [params, opt_state]
      # Warm up.
      state[0], state[1], loss = step(state[0], state[1], batch, rng)
      loss.block_until_ready()
      runners[name] = (step, state, peak_bytes(step))
    times = {name: [] for name in names}
    for r in range(rounds):
      # Each round starts at another model, so no model always runs first
      # (right after a switch of programs, or after the previous round).
      for name in names[r % len(names):] + names[:r % len(names)]:
        step, state, _ = runners[name]
        start = time.perf_counter()
        for i in range(steps):
          state[0], state[1], loss = step(state[0], state[1], batch,
                                          jax.random.PRNGKey(i))
        loss.block_until_ready()
        times[name].append((time.perf_counter() - start) / steps)
    mtl = statistics.median(times['mtl'])
    mtl_peak = runners['mtl'][2]
    for name in names:
      seconds = statistics.median(times[name])
      peak = runners[name][2]
      rows.append({'batch_size': batch_size, 'model': name,
                   'seconds_per_step': seconds, 'ratio_to_mtl': seconds / mtl,
                   'peak_bytes': peak, 'peak_ratio_to_mtl': peak / mtl_peak})
    del runners
  return rows


def gated_matmul_routes(batch: int, lengths: Sequence[int], d_model: int,
                        d_ff: int, grid_rows: int, grid_cols: int,
                        repeats: int = 5) -> list[dict]:
  """Times HyperGrid's two routes for a gated `wo` (forward and backward)
  at each length, beside the route `gated_matmul_route` picks."""
  rng = np.random.default_rng(0)
  kernel = jnp.asarray(rng.normal(size=(d_ff, d_model)), jnp.float32)
  grid = jnp.asarray(rng.uniform(size=(batch, grid_cols, grid_rows)),
                     jnp.float32)  # wo orientation: [d_ff blocks, d_model]
  rows = []
  for length in lengths:
    x = jnp.asarray(rng.normal(size=(batch, length, d_ff)), jnp.float32)
    seconds = {}
    for route in ('blockwise', 'fold'):
      fn = jax.jit(jax.grad(lambda x, k, g, r=route: jnp.sum(
          hypergrid.gated_matmul(x, k, g, route=r) ** 2), argnums=(0, 1)))
      jax.block_until_ready(fn(x, kernel, grid))
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(x, kernel, grid))
        times.append(time.perf_counter() - start)
      seconds[route] = statistics.median(times)
    rows.append({'length': length, **{f'{r}_seconds': s
                                      for r, s in seconds.items()},
                 'rule': hypergrid.gated_matmul_route(length, d_ff, grid_cols,
                                                      grid_rows),
                 'faster': min(seconds, key=seconds.get)})
  return rows


def variant_table(small: network.T5Config, base: network.T5Config,
                  variants: Sequence[str], placement: str, input_length: int,
                  target_length: int, batch_size: int, flops_batch_size: int,
                  rounds: int, steps: int) -> list[dict]:
  """One row per model ('mtl' first, then `variants`): the parameter ratio
  and the forward FLOPs per example of the `base` network (abstract shapes:
  nothing is allocated), and the training-step time ratio over MTL of the
  `small` network at `batch_size`, timed side by side by `benchmark`."""
  timed = {r['model']: r for r in benchmark(
      small, [batch_size], variants, placement, input_length, target_length,
      rounds, steps)}
  rows = []
  for name in ['mtl', *variants]:
    model = network.Transformer(variant_config(base, name, placement))
    summary = param_table.summarize(param_table.abstract_params(model))
    rows.append({
        'model': name,
        'num_tasks': model.config.num_tasks,
        'parameter_ratio': summary['ratio'],
        'forward_flops_per_example': param_table.forward_flops(
            model, input_length, target_length, flops_batch_size),
        'step_time_ratio': timed[name]['ratio_to_mtl'],
        'seconds_per_step': timed[name]['seconds_per_step'],
    })
  mtl_flops = rows[0]['forward_flops_per_example']
  for row in rows:
    row['flops_ratio'] = row['forward_flops_per_example'] / mtl_flops
  return rows


def format_table(rows: list[dict]) -> str:
  lines = [f'{"model":<15}{"T":>3}{"#params":>10}{"fwd FLOPs/ex":>14}'
           f'{"FLOPs / MTL":>13}{"step / MTL":>12}']
  for r in rows:
    lines.append(f'{r["model"]:<15}{r["num_tasks"]:>3}'
                 f'{r["parameter_ratio"]:>9.4f}x'
                 f'{r["forward_flops_per_example"]:>14.3e}'
                 f'{r["flops_ratio"]:>12.4f}x{r["step_time_ratio"]:>11.3f}x')
  return '\n'.join(lines)


def format_rows(rows: list[dict]) -> str:
  lines = [f'{"batch":>5}  {"model":<15}{"ms/step":>10}{"time / MTL":>12}'
           f'{"peak MiB":>11}{"peak / MTL":>12}']
  for r in rows:
    lines.append(f'{r["batch_size"]:>5}  {r["model"]:<15}'
                 f'{1000 * r["seconds_per_step"]:>10.1f}'
                 f'{r["ratio_to_mtl"]:>11.3f}x'
                 f'{r["peak_bytes"] / 2**20:>11.1f}'
                 f'{r["peak_ratio_to_mtl"]:>11.3f}x')
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = gin_utils.rewrite_gin_shorthand(
      sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(
      prog='python -m hyperprompt_jax.benchmark', description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  gin_utils.add_gin_flags(parser)
  parser.add_argument('--batch_sizes', default='4,8,16')
  parser.add_argument('--input_length', type=int, default=512)
  parser.add_argument('--target_length', type=int, default=32)
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--placement', default='both',
                      choices=hyperprompt.PLACEMENTS)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument(
      '--gated_matmul', action='store_true',
      help="only time HyperGrid's blockwise and fold routes of a gated wo at "
           'lengths 1, 8, 32, 128 and --input_length, at the first batch size')
  parser.add_argument(
      '--table', action='store_true',
      help='the variant table: parameter ratio and forward FLOPs per example '
           'of the --table_model network (at --input_length / '
           '--target_length, batch --flops_batch_size), and the step-time '
           'ratio over MTL of the --gin_file network at the first batch size')
  parser.add_argument('--table_model', default='models/t5_1_1_base.gin',
                      help='model gin file of the --table parameter and FLOPs '
                           'columns')
  parser.add_argument('--flops_batch_size', type=int, default=128,
                      help="batch of the FLOPs count (the papers' 128): "
                           'per-task parts are computed once per batch')
  args = parser.parse_args(argv)
  variants = [v for v in args.variants.split(',') if v]
  bad = set(variants) - set(VARIANTS)
  if bad:
    raise ValueError(f'Unknown variants {sorted(bad)}: choose from '
                     f'{VARIANTS}.')
  if args.flops_batch_size <= 0:
    raise ValueError('--flops_batch_size must be positive.')
  table_base = None
  if args.table:
    gin.clear_config()
    gin_utils.parse_gin([args.table_model], [])
    table_base = gin.get_configurable(network.Transformer)().config
  gin_utils.parse_gin_flags(args, ['models/t5_1_1_small.gin'])
  base = gin.get_configurable(network.Transformer)().config
  batch_sizes = [int(b) for b in args.batch_sizes.split(',')]
  if args.gated_matmul:
    routes = gated_matmul_routes(batch_sizes[0],
                                 [1, 8, 32, 128, args.input_length],
                                 base.emb_dim, base.mlp_dim, 32, 128)
    print(f'{"length":>6}{"blockwise ms":>14}{"fold ms":>10}  rule picks  '
          'faster')
    for r in routes:
      print(f'{r["length"]:>6}{1000 * r["blockwise_seconds"]:>14.2f}'
            f'{1000 * r["fold_seconds"]:>10.2f}  {r["rule"]:<10}  '
            f'{r["faster"]}')
    return 0
  if args.table:
    rows = variant_table(base, table_base, variants, args.placement,
                         args.input_length, args.target_length,
                         batch_sizes[0], args.flops_batch_size, args.rounds,
                         args.steps)
    print(f'devices: {jax.devices()}')
    timed_model = ', '.join(args.gin_file or ['models/t5_1_1_small.gin'])
    print(f'#params, FLOPs: {args.table_model}, input {args.input_length}, '
          f'target {args.target_length}, FLOPs batch '
          f'{args.flops_batch_size}; step time: {timed_model}, batch '
          f'{batch_sizes[0]}')
    print(format_table(rows))
    return 0
  rows = benchmark(base, batch_sizes, variants, args.placement, args.input_length,
                   args.target_length, args.rounds, args.steps)
  print(f'devices: {jax.devices()}')
  print(format_rows(rows))
  return 0


if __name__ == '__main__':
  gin_utils.run(main)
