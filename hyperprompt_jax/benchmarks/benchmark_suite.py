"""The benchmarks, each printed side by side in one process (ratios to a
baseline, never absolute targets): training steps of every variant, decode
steps, MetaBalance, microbatches and remat, packing, memory. Its command:
`python -m hyperprompt_jax.benchmark`."""

import argparse
import dataclasses
import os
import statistics
import time
from typing import Sequence

from flax import traverse_util
import gin
import jax
import jax.numpy as jnp
import numpy as np

from hyperprompt_jax import methods
from hyperprompt_jax import paths
from hyperprompt_jax import task_params
from hyperprompt_jax.benchmarks import memory_table
from hyperprompt_jax.benchmarks import packing_benchmark
from hyperprompt_jax.benchmarks import param_counts
from hyperprompt_jax.benchmarks import timing
from hyperprompt_jax.common import gin_literals
from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.common import host_memory
from hyperprompt_jax.methods import hypergrid
from hyperprompt_jax.methods import hyperprompt
from hyperprompt_jax.model import network
from hyperprompt_jax.training import metabalance
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import trainer



def _variant_name(variant_file: str) -> str:
  """'variants/hyperprompt_share.gin' -> 'hyperprompt_share': a variant is
  named as its gin file."""
  return os.path.splitext(os.path.basename(variant_file))[0]


# name -> the gin/variants file that defines it, for every method of the
# registry (`methods.REGISTRY`), in its order.
VARIANT_FILES = {_variant_name(f): f for f in methods.variant_files()}
VARIANTS = tuple(VARIANT_FILES)


def variant_config(base: network.T5Config, variant: str,
                   placement: str) -> network.T5Config:
  """`base` with the task conditioning of `variant` ('mtl' or one of
  `VARIANTS`): its gin/variants file's method configs at `PLACEMENT =
  placement`, and the task-id space of its paper setup. Clears gin's
  current configuration."""
  off = {m.CONFIG_FIELD: None for m in methods.REGISTRY}
  if variant == 'mtl':
    return dataclasses.replace(base, **off)
  if variant not in VARIANT_FILES:
    raise ValueError(f'Unknown variant {variant!r}: choose from {VARIANTS}.')
  files = [VARIANT_FILES[variant],
           gin_literals.paper_task_file(VARIANT_FILES[variant])]
  gin.clear_config()
  gin.add_config_file_search_path(paths.gin_dir())
  gin.parse_config_files_and_bindings(
      [os.path.join(paths.gin_dir(), f) for f in files],
      [f'PLACEMENT = {placement!r}'])
  bound = gin.get_configurable(network.T5Config)(vocab_size=base.vocab_size)
  gin.clear_config()
  return dataclasses.replace(
      base, num_tasks=bound.num_tasks,
      **{field: getattr(bound, field) for field in off})


def benchmark(base: network.T5Config, batch_sizes: Sequence[int],
              variants: Sequence[str], placement: str, input_length: int,
              target_length: int, rounds: int, steps: int) -> list[dict]:
  """Returns one row per (batch size, variant): median seconds per training
  step (the built-in runner's `trainer.train_step`), peak bytes, and their
  ratios to MTL at that batch size."""
  rows = []
  optimizer = optimizers.make_optimizer()
  configs = {name: variant_config(base, name, placement)
             for name in ['mtl', *variants]}
  for batch_size in batch_sizes:
    # One batch for every variant: ids every one of them has.
    batch = timing.random_batch(
        np.random.default_rng(0), batch_size, input_length, target_length,
        base.vocab_size, min(cfg.num_tasks for cfg in configs.values()))
    runners, peaks = {}, {}
    for name, cfg in configs.items():
      model = network.Transformer(cfg)
      state = timing.fresh_state(model, optimizer, input_length,
                                 target_length)
      runners[name], peaks[name] = timing.step_runner(model, optimizer,
                                                      state, batch)
    timed = timing.timed_side_by_side(runners, rounds, steps, 'mtl')
    for name in configs:
      rows.append({'batch_size': batch_size, 'variant': name,
                   'seconds_per_step': timed[name][0],
                   'ratio_to_mtl': timed[name][1],
                   'peak_bytes': peaks[name],
                   'peak_ratio_to_mtl': peaks[name] / peaks['mtl']})
    del runners
  return rows


def metabalance_benchmark(base: network.T5Config, batch_size: int,
                          task_counts: Sequence[int], input_length: int,
                          target_length: int, rounds: int, steps: int
                          ) -> list[dict]:
  """One row per (number of tasks T, gradient): the training step of the
  `base` network (MTL: balancing does not depend on the method) with the
  plain gradient and with MetaBalance's, K = T - 1 auxiliaries 'each' and
  'all', timed side by side: seconds, peak bytes and their ratios to the
  plain step. Every task has rows in the batch (task ids cycle)."""
  optimizer = optimizers.make_optimizer()
  rows = []
  for num_tasks in task_counts:
    cfg = dataclasses.replace(base, num_tasks=num_tasks)
    model = network.Transformer(cfg)
    names = tuple(f'task_{i}' for i in range(num_tasks))
    batch = timing.random_batch(np.random.default_rng(0), batch_size,
                                input_length, target_length, base.vocab_size,
                                num_tasks)
    batch['task_ids'] = np.arange(batch_size, dtype=np.int32) % num_tasks
    runners, peaks = {}, {}
    for mode in ('plain', 'each', 'all'):
      plan = None if mode == 'plain' else metabalance.make_plan(
          metabalance.Settings(target_task=names[0], auxiliaries=mode,
                               max_auxiliaries=num_tasks),
          names, names, task_params.task_axes(model))
      state = timing.fresh_state(model, optimizer, input_length,
                                 target_length)
      if plan is not None:
        shared = {k: v for k, v in
                  traverse_util.flatten_dict(state['params'], sep='/').items()
                  if k not in plan.task_rows}
        state[trainer.METABALANCE] = metabalance.init(
            traverse_util.unflatten_dict(shared, sep='/'),
            plan.num_auxiliary)
      runners[mode], peaks[mode] = timing.step_runner(model, optimizer,
                                                      state, batch, plan)
    timed = timing.timed_side_by_side(runners, rounds, steps, 'plain')
    for mode in runners:
      rows.append({'num_tasks': num_tasks, 'gradient': mode,
                   'seconds_per_step': timed[mode][0],
                   'ratio_to_plain': timed[mode][1],
                   'peak_bytes': peaks[mode],
                   'peak_ratio_to_plain': peaks[mode] / peaks['plain']})
    del runners
  return rows


def remat_microbatches_benchmark(base: network.T5Config, batch_size: int,
                                 input_length: int, target_length: int,
                                 rounds: int, steps: int) -> list[dict]:
  """One row per (NUM_MICROBATCHES in 1, 2, 4; REMAT_POLICY): MTL's
  training step on one batch, timed side by side: seconds, peak bytes,
  temporary bytes, the activations its backward keeps (of one part:
  `timing.saved_activation_bytes`), and their ratios to 1 / 'none'."""
  optimizer = optimizers.make_optimizer()
  batch = timing.random_batch(np.random.default_rng(0), batch_size,
                             input_length, target_length, base.vocab_size,
                             base.num_tasks)
  runners, peaks, temps, saved = {}, {}, {}, {}
  for parts in (1, 2, 4):
    for policy in network.REMAT_POLICIES:
      model = network.Transformer(dataclasses.replace(base,
                                                      remat_policy=policy))
      state = timing.fresh_state(model, optimizer, input_length,
                                 target_length)
      key, temp = (parts, policy), []
      part = {k: v[::parts] for k, v in batch.items()}  # one part's rows
      saved[key] = timing.saved_activation_bytes(model, state['params'],
                                                 part)
      runners[key], peaks[key] = timing.step_runner(
          model, optimizer, state, batch, num_microbatches=parts,
          temp_bytes=temp)
      temps[key] = temp[0]
  plain = (1, 'none')
  timed = timing.timed_side_by_side(runners, rounds, steps, plain)
  return [{'num_microbatches': parts, 'remat_policy': policy,
           'seconds_per_step': timed[(parts, policy)][0],
           'ratio': timed[(parts, policy)][1],
           'peak_bytes': peaks[(parts, policy)],
           'peak_ratio': peaks[(parts, policy)] / peaks[plain],
           'temp_bytes': temps[(parts, policy)],
           'temp_ratio': temps[(parts, policy)] / temps[plain],
           'saved_bytes': saved[(parts, policy)],
           'saved_ratio': saved[(parts, policy)] / saved[plain]}
          for parts, policy in runners]


def decode_benchmark(base: network.T5Config, batch_size: int,
                     variants: Sequence[str], placement: str,
                     input_length: int, target_length: int, rounds: int,
                     steps: int) -> list[dict]:
  """One row per variant: the median seconds of one incremental decode step
  (one token against a cache of `target_length`, created by
  `network.create_cache` as both runners' decoders do) and its ratio to
  MTL's, timed side by side."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, base.vocab_size, (batch_size, input_length),
                        dtype=np.int32)
  token = np.ones((batch_size, 1), np.int32)
  runners = {}
  for name in ['mtl', *variants]:
    model = network.Transformer(variant_config(base, name, placement))
    task_ids = rng.integers(0, model.config.num_tasks, (batch_size,),
                            dtype=np.int32)
    params = timing.fresh_params(model, input_length, target_length)
    encoded = jax.jit(lambda p, m=model, ids=task_ids: m.apply(
        {'params': p}, tokens, enable_dropout=False, task_ids=ids,
        method=m.encode))(params)
    cache = jax.jit(lambda p, e, m=model, ids=task_ids: network.create_cache(
        m, p, e, tokens, target_length, ids))(params, encoded)

    def decode_step(p, c, e, m=model, ids=task_ids):
      logits, new = m.apply(
          {'params': p, 'cache': c}, e, tokens, token, token,
          enable_dropout=False, decode=True, max_decode_length=target_length,
          task_ids=ids, mutable=['cache'], method=m.decode)
      return logits, new['cache']

    step = jax.jit(decode_step).lower(params, cache, encoded).compile()
    jax.block_until_ready(step(params, cache, encoded))  # warm up
    runners[name] = (lambda i, step=step, p=params, c=cache, e=encoded:
                     step(p, c, e)[0])
  timed = timing.timed_side_by_side(runners, rounds, steps, 'mtl')
  return [{'variant': name, 'seconds_per_step': seconds, 'ratio_to_mtl': ratio}
          for name, (seconds, ratio) in timed.items()]


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
  """One row per variant ('mtl' first, then `variants`): the parameter ratio
  and the forward FLOPs per example of the `base` network (abstract shapes:
  nothing is allocated), and the training-step time ratio over MTL of the
  `small` network at `batch_size`, timed side by side by `benchmark`."""
  timed = {r['variant']: r for r in benchmark(
      small, [batch_size], variants, placement, input_length, target_length,
      rounds, steps)}
  rows = []
  for name in ['mtl', *variants]:
    model = network.Transformer(variant_config(base, name, placement))
    summary = param_counts.summarize(param_counts.abstract_params(model))
    rows.append({
        'variant': name,
        'num_tasks': model.config.num_tasks,
        'parameter_ratio': summary['ratio'],
        'forward_flops_per_example': param_counts.forward_flops(
            model, input_length, target_length, flops_batch_size),
        'step_time_ratio': timed[name]['ratio_to_mtl'],
        'seconds_per_step': timed[name]['seconds_per_step'],
    })
  mtl_flops = rows[0]['forward_flops_per_example']
  for row in rows:
    row['flops_ratio'] = row['forward_flops_per_example'] / mtl_flops
  return rows


def format_table(rows: list[dict]) -> str:
  lines = [f'{"variant":<15}{"T":>3}{"#params":>10}{"fwd FLOPs/ex":>14}'
           f'{"FLOPs / MTL":>13}{"step / MTL":>12}']
  for r in rows:
    lines.append(f'{r["variant"]:<15}{r["num_tasks"]:>3}'
                 f'{r["parameter_ratio"]:>9.4f}x'
                 f'{r["forward_flops_per_example"]:>14.3e}'
                 f'{r["flops_ratio"]:>12.4f}x{r["step_time_ratio"]:>11.3f}x')
  return '\n'.join(lines)


def format_rows(rows: list[dict]) -> str:
  lines = [f'{"batch":>5}  {"variant":<15}{"ms/step":>10}{"time / MTL":>12}'
           f'{"peak MiB":>11}{"peak / MTL":>12}']
  for r in rows:
    lines.append(f'{r["batch_size"]:>5}  {r["variant"]:<15}'
                 f'{1000 * r["seconds_per_step"]:>10.1f}'
                 f'{r["ratio_to_mtl"]:>11.3f}x'
                 f'{r["peak_bytes"] / 2**20:>11.1f}'
                 f'{r["peak_ratio_to_mtl"]:>11.3f}x')
  return '\n'.join(lines)


def _memory_table(args: argparse.Namespace) -> int:
  """`--memory`: `memory_table` of the setups, printed."""
  setups = (args.setups.split(',') if args.setups else sorted(
      p[:-len('.gin')] for p in os.listdir(
          os.path.join(paths.gin_dir(), 'setups'))
      if p.endswith('.gin')))
  memories = [float(gb) for gb in args.device_memory_gb.split(',')]
  if args.devices < 1 or any(gb <= 0 for gb in memories):
    raise ValueError('--devices and --device_memory_gb must be positive.')
  rows = memory_table.memory_rows(setups, args.devices, memories)
  print(f'devices: {args.devices} (data parallel); per device: the peak of '
        'the compiled training step (XLA memory_analysis on this CPU: an '
        "estimate for GPU / TPU; 'full' remat estimated, memory_table.py), "
        'the activations its backward keeps with REMAT_POLICY none / full, '
        'and n = the smallest NUM_MICROBATCHES that fits')
  print(memory_table.format_rows(rows, memories))
  return 0


def _variants(args: argparse.Namespace) -> list[str]:
  """The --variants named (default: all), after the checks of --variants
  and --placement."""
  if args.variants is None:
    variants = list(VARIANTS)
  else:
    variants = methods.variant_names(args.variants)
  bad = set(variants) - set(VARIANTS)
  if bad:
    raise ValueError(f'Unknown variants {sorted(bad)}: choose from '
                     f'{VARIANTS}.')
  if args.placement not in hyperprompt.PLACEMENTS:
    raise ValueError(f'--placement={args.placement}: choose from '
                     f'{hyperprompt.PLACEMENTS}.')
  return variants


def _print_gated_matmul(args: argparse.Namespace, base: network.T5Config,
                        batch_size: int) -> None:
  """--gated_matmul: HyperGrid's two routes of a gated wo, by length."""
  routes = gated_matmul_routes(batch_size,
                               [1, 8, 32, 128, args.input_length],
                               base.emb_dim, base.mlp_dim, 32, 128)
  print(f'{"length":>6}{"blockwise ms":>14}{"fold ms":>10}  rule picks  '
        'faster')
  for r in routes:
    print(f'{r["length"]:>6}{1000 * r["blockwise_seconds"]:>14.2f}'
          f'{1000 * r["fold_seconds"]:>10.2f}  {r["rule"]:<10}  '
          f'{r["faster"]}')


def _print_packing(args: argparse.Namespace, base: network.T5Config,
                   variants: Sequence[str], batch_size: int) -> None:
  """--packing: packed against unpacked rows, per length distribution."""
  # Imported here: it builds on this module's timing helpers (and reads
  # its data with TensorFlow).
  gin_utils.import_tensorflow_quietly()
  configs = {'mtl': variant_config(base, 'mtl', args.placement)}
  for name in variants:
    configs[name] = variant_config(base, name, args.placement)
  print(f'devices: {jax.devices()}')
  tables = packing_benchmark.packing_benchmark(
      configs, batch_size, args.input_length, args.target_length,
      args.lengths.split(','), args.rounds, args.steps)
  for distribution, rows in tables.items():
    print(f'{distribution} lengths: batch {batch_size} rows of '
          f'{args.input_length} / {args.target_length} tokens')
    print(packing_benchmark.format_packing(rows))


def _print_metabalance(args: argparse.Namespace, base: network.T5Config,
                       batch_size: int) -> None:
  """--metabalance: the step with MetaBalance beside the plain one."""
  rows = metabalance_benchmark(
      variant_config(base, 'mtl', args.placement), batch_size,
      [int(t) for t in args.metabalance.split(',')], args.input_length,
      args.target_length, args.rounds, args.steps)
  print(f'devices: {jax.devices()}')
  print(f'training step: batch {batch_size}, input '
        f'{args.input_length}, target {args.target_length}; MetaBalance: '
        'target = task 0, auxiliaries = the other T - 1')
  print(f'{"T":>3}  {"gradient":<9}{"s/step":>9}{"x plain":>9}'
        f'{"peak GB":>9}{"x plain":>9}')
  for r in rows:
    print(f'{r["num_tasks"]:>3}  {r["gradient"]:<9}'
          f'{r["seconds_per_step"]:>9.3f}{r["ratio_to_plain"]:>8.2f}x'
          f'{r["peak_bytes"] / 1e9:>9.2f}{r["peak_ratio_to_plain"]:>8.2f}x')


def _print_remat_microbatches(args: argparse.Namespace,
                              base: network.T5Config,
                              batch_size: int) -> None:
  """--remat_microbatches: MTL's step per NUM_MICROBATCHES and REMAT_POLICY."""
  rows = remat_microbatches_benchmark(
      variant_config(base, 'mtl', args.placement), batch_size,
      args.input_length, args.target_length, args.rounds, args.steps)
  print(f'devices: {jax.devices()}')
  print(f'training step (MTL): batch {batch_size}, input '
        f'{args.input_length}, target {args.target_length}')
  print(f'{"parts":>5}  {"remat":<8}{"s/step":>9}{"x plain":>9}'
        f'{"peak GB":>9}{"x plain":>9}{"temp GB":>9}{"x plain":>9}'
        f'{"saved GB":>9}{"x plain":>9}')
  for r in rows:
    print(f'{r["num_microbatches"]:>5}  {r["remat_policy"]:<8}'
          f'{r["seconds_per_step"]:>9.3f}{r["ratio"]:>8.2f}x'
          f'{r["peak_bytes"] / 1e9:>9.2f}{r["peak_ratio"]:>8.2f}x'
          f'{r["temp_bytes"] / 1e9:>9.2f}{r["temp_ratio"]:>8.2f}x'
          f'{r["saved_bytes"] / 1e9:>9.2f}{r["saved_ratio"]:>8.2f}x')


def _print_decode(args: argparse.Namespace, base: network.T5Config,
                  variants: Sequence[str], batch_size: int) -> None:
  """--decode: one incremental decode step of each variant against MTL's."""
  rows = decode_benchmark(base, batch_size, variants, args.placement,
                          args.input_length, args.target_length,
                          args.rounds, args.steps)
  print(f'devices: {jax.devices()}')
  print(f'decode step: batch {batch_size}, input {args.input_length}, '
        f'cache {args.target_length}')
  print(f'{"variant":<15}{"ms/step":>10}{"step / MTL":>12}')
  for r in rows:
    print(f'{r["variant"]:<15}{1000 * r["seconds_per_step"]:>10.2f}'
          f'{r["ratio_to_mtl"]:>11.3f}x')


def _print_table(args: argparse.Namespace, base: network.T5Config,
                 table_base: network.T5Config, variants: Sequence[str],
                 batch_size: int) -> None:
  """--table: parameters and FLOPs of --table_model beside step times."""
  rows = variant_table(base, table_base, variants, args.placement,
                       args.input_length, args.target_length,
                       batch_size, args.flops_batch_size, args.rounds,
                       args.steps)
  print(f'devices: {jax.devices()}')
  timed_model = ', '.join(args.gin_file or ['models/t5_1_1_small.gin'])
  print(f'#params, FLOPs: {args.table_model}, input {args.input_length}, '
        f'target {args.target_length}, FLOPs batch '
        f'{args.flops_batch_size}; step time: {timed_model}, batch '
        f'{batch_size}')
  print(format_table(rows))


def run(args: argparse.Namespace) -> int:
  """`python -m hyperprompt_jax.benchmark` with its parsed flags."""
  variants = _variants(args)
  if args.flops_batch_size <= 0:
    raise ValueError('--flops_batch_size must be positive.')
  if args.memory:
    return _memory_table(args)
  # As the training command does: a step's fresh host pages are the CPU
  # allocator's cost, not the model's (`host_memory`).
  if host_memory.reuse_freed_memory_on_cpu():
    print('Host memory: freed blocks kept for reuse (host_memory).')
  table_base = None
  if args.table:
    gin.clear_config()
    gin_utils.parse_gin([args.table_model], [])
    table_base = gin.get_configurable(network.Transformer)().config
  gin_utils.parse_gin_flags(args, ['models/t5_1_1_small.gin'])
  base = gin.get_configurable(network.Transformer)().config
  batch_sizes = [int(b) for b in args.batch_sizes.split(',')]
  if args.gated_matmul:
    _print_gated_matmul(args, base, batch_sizes[0])
  elif args.packing:
    _print_packing(args, base, variants, batch_sizes[0])
  elif args.metabalance:
    _print_metabalance(args, base, batch_sizes[0])
  elif args.remat_microbatches:
    _print_remat_microbatches(args, base, batch_sizes[0])
  elif args.decode:
    _print_decode(args, base, variants, batch_sizes[0])
  elif args.table:
    _print_table(args, base, table_base, variants, batch_sizes[0])
  else:
    rows = benchmark(base, batch_sizes, variants, args.placement,
                     args.input_length, args.target_length, args.rounds,
                     args.steps)
    print(f'devices: {jax.devices()}')
    print(format_rows(rows))
  return 0
