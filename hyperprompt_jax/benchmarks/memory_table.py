"""Device memory of each paper setup's training step (`benchmark --memory`).

For a setup (`runs/<name>.gin`: its model, TASK_FEATURE_LENGTHS, BATCH_SIZE
and PACK) on `devices` devices of data parallelism, the built-in runner's
step (`trainer.train_step`) is compiled for abstract shapes (nothing is
allocated) at the per-device batch, and XLA's `memory_analysis()` gives its
bytes: arguments (parameters, optimizer state, batch) + outputs + temporaries
- aliased (the donated state). Each setup is measured without and with
'full' remat (REMAT_POLICY), and for each stated device memory the smallest
NUM_MICROBATCHES that fits is searched (powers of 2 dividing the per-device
batch).

The figures are CPU compilations: GPU and TPU compilers lay memory out
differently (fusion, layouts, their own rematerialisation), so they are
estimates, best read as ratios between settings.
"""

import dataclasses
import functools
from typing import Callable, Optional, Sequence

import gin
import jax
import jax.numpy as jnp

from hyperprompt_jax.model import network
from hyperprompt_jax.runner import batches
from hyperprompt_jax.runner import gin_utils
from hyperprompt_jax.runner import optimizers
from hyperprompt_jax.runner import trainer

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Setup:
  """What a paper setup's step needs: its network, lengths, global batch
  and whether it packs."""
  name: str
  config: network.T5Config
  input_length: int
  target_length: int
  batch_size: int
  pack: bool


def read_setup(name: str) -> Setup:
  """The setup of `runs/<name>.gin`. gin is cleared before and after (the
  run file's bindings, its task list among them, must not outlive it)."""
  gin.clear_config()
  try:
    gin_utils.parse_gin([f'runs/{name}.gin'], [])
    lengths = gin.query_parameter('TASK_FEATURE_LENGTHS/macro.value')
    return Setup(
        name=name, config=gin.get_configurable(network.T5Config)(),
        input_length=lengths['inputs'], target_length=lengths['targets'],
        batch_size=gin.query_parameter('BATCH_SIZE/macro.value'),
        pack=gin.query_parameter('PACK/macro.value'))
  finally:
    gin.clear_config()


def step_bytes(config: network.T5Config, batch: int, input_length: int,
               target_length: int, pack: bool, num_microbatches: int = 1
               ) -> dict[str, int]:
  """XLA's memory analysis of one training step on one device, compiled
  for abstract shapes: {'arguments', 'outputs', 'temporaries', 'peak'}
  (peak = arguments + outputs + temporaries - aliased)."""
  model = network.Transformer(config)
  optimizer = optimizers.make_optimizer()
  params = network.abstract_variables(model, input_length,
                                      target_length)['params']
  state = {'step': jax.ShapeDtypeStruct((), jnp.int32), 'params': params,
           'opt_state': jax.eval_shape(optimizer.init, params)}
  lengths = {'encoder': input_length, 'decoder': target_length}
  features = {}
  for name in batches.required_features(pack):
    shape = ((batch,) if name == 'task_ids' else
             (batch, lengths[name.split('_')[0]]))
    features[name] = jax.ShapeDtypeStruct(shape, jnp.int32)
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
  compiled = jax.jit(
      functools.partial(trainer.train_step, model, optimizer, z_loss=1e-4,
                        num_microbatches=num_microbatches),
      donate_argnums=(0,)).lower(state, features, rng).compile()
  m = compiled.memory_analysis()
  return {'arguments': m.argument_size_in_bytes,
          'outputs': m.output_size_in_bytes,
          'temporaries': m.temp_size_in_bytes,
          'peak': (m.argument_size_in_bytes + m.output_size_in_bytes
                   + m.temp_size_in_bytes - m.alias_size_in_bytes)}


def smallest_fitting(peak_of: Callable[[int], int], batch: int,
                     limit_bytes: float) -> Optional[int]:
  """The smallest NUM_MICROBATCHES (a power of 2 dividing `batch`) whose
  `peak_of(n)` is within `limit_bytes`; None if even one row a part does
  not fit. Peaks fall as n grows, so the search stops at the first fit."""
  n = 1
  while n <= batch:
    if batch % n == 0 and peak_of(n) <= limit_bytes:
      return n
    n *= 2
  return None


def memory_rows(names: Sequence[str], devices: int,
                device_memory_gb: Sequence[float]) -> list[dict]:
  """One row per setup: per-device peak without / with 'full' remat at
  NUM_MICROBATCHES = 1, and per device memory the smallest NUM_MICROBATCHES
  that fits with 'none' and with 'full' (None: nothing fits)."""
  rows = []
  for name in names:
    setup = read_setup(name)
    if setup.batch_size % devices:
      raise ValueError(f'{name}: BATCH_SIZE {setup.batch_size} does not '
                       f'divide over {devices} devices.')
    batch = setup.batch_size // devices
    measured = {}

    def peak(n, policy, setup=setup, batch=batch, measured=measured):
      if (n, policy) not in measured:
        measured[(n, policy)] = step_bytes(
            dataclasses.replace(setup.config, remat_policy=policy), batch,
            setup.input_length, setup.target_length, setup.pack, n)['peak']
      return measured[(n, policy)]

    row = {'setup': name, 'batch_per_device': batch,
           'peak_none': peak(1, 'none'), 'peak_full': peak(1, 'full'),
           'fits': {}}
    for gb in device_memory_gb:
      row['fits'][gb] = {
          policy: smallest_fitting(functools.partial(peak, policy=policy),
                                   batch, gb * GB)
          for policy in ('none', 'full')}
    rows.append(row)
  return rows


def format_rows(rows: Sequence[dict], device_memory_gb: Sequence[float]
                ) -> str:
  """The table: peak GB per device, and the fitting NUM_MICROBATCHES per
  device memory and remat policy ('-': nothing fits)."""
  head = f'{"setup":<36}{"rows":>5}{"none GB":>9}{"full GB":>9}'
  for gb in device_memory_gb:
    head += f'{f"{gb:g}GB none":>12}{f"{gb:g}GB full":>12}'
  lines = [head]
  for r in rows:
    line = (f'{r["setup"]:<36}{r["batch_per_device"]:>5}'
            f'{r["peak_none"] / GB:>9.1f}{r["peak_full"] / GB:>9.1f}')
    for gb in device_memory_gb:
      for policy in ('none', 'full'):
        n = r['fits'][gb][policy]
        line += f'{"-" if n is None else f"n={n}":>12}'
    lines.append(line)
  return '\n'.join(lines)
