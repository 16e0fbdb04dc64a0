"""Device memory of each paper setup's training step (`benchmark --memory`).

For a setup (`runs/<name>.gin`, optionally with gin files added, e.g. a
model size: its model, TASK_FEATURE_LENGTHS, BATCH_SIZE
and PACK) on `devices` devices of data parallelism, the built-in runner's
step (`trainer.train_step`) is compiled for abstract shapes (nothing is
allocated) at the per-device batch, and XLA's `memory_analysis()` gives its
bytes: arguments (parameters, optimizer state, batch) + outputs + temporaries
- aliased (the donated state). For each stated device memory the smallest
NUM_MICROBATCHES that fits is searched (powers of 2 dividing the per-device
batch).

REMAT_POLICY 'full' is estimated, not compiled: this CPU's XLA schedules the
recomputed forward early, so its `memory_analysis` shows no saving from
remat (a compiled 'full' step comes out no smaller; docs/performance.md
has a 20-line reproduction). What remat changes is the activations the
backward pass keeps (`timing.saved_activation_bytes`, traced, not
compiled); the 'full' peak is the compiled 'none' peak less the
activations 'full' no longer keeps.

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

from hyperprompt_jax.benchmarks import timing
from hyperprompt_jax.benchmarks import tpu_compile
from hyperprompt_jax.common import gin_utils
from hyperprompt_jax.model import network
from hyperprompt_jax.t5 import inputs
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import trainer

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
  """The setup of `name` (`tpu_compile.setup_gin_files`). gin is cleared
  before and after (the run file's bindings, its task list among them,
  must not outlive it)."""
  gin.clear_config()
  try:
    gin_utils.parse_gin(tpu_compile.setup_gin_files(name), [])
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
  features = abstract_batch(batch, input_length, target_length, pack)
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


def abstract_batch(batch: int, input_length: int, target_length: int,
                   pack: bool) -> dict[str, jax.ShapeDtypeStruct]:
  """The shapes of a model batch of `batch` rows."""
  return tpu_compile.placed_batch(
      inputs.required_features(pack), batch,
      {'inputs': input_length, 'targets': target_length})


def saved_bytes(config: network.T5Config, batch: int, input_length: int,
                target_length: int, pack: bool) -> int:
  """The activations one step's backward keeps at `batch` rows, traced for
  abstract shapes (`timing.saved_activation_bytes`)."""
  model = network.Transformer(config)
  params = network.abstract_variables(model, input_length,
                                      target_length)['params']
  return timing.saved_activation_bytes(
      model, params, abstract_batch(batch, input_length, target_length, pack))


def full_remat_peak(peak_none: int, saved_none: int, saved_full: int) -> int:
  """The estimated peak with REMAT_POLICY 'full': the compiled 'none' peak
  less the activations 'full' no longer keeps (module docstring)."""
  return peak_none - max(saved_none - saved_full, 0)


def memory_rows(names: Sequence[str], devices: int,
                device_memory_gb: Sequence[float]) -> list[dict]:
  """One row per setup: the per-device peak of the compiled step and the
  activations its backward keeps with REMAT_POLICY 'none' / 'full' (at
  NUM_MICROBATCHES = 1), and per device memory the smallest
  NUM_MICROBATCHES that fits with 'none' and (estimated) with 'full'
  (None: nothing fits)."""
  rows = []
  for name in names:
    setup = read_setup(name)
    if setup.batch_size % devices:
      raise ValueError(f'{name}: BATCH_SIZE {setup.batch_size} does not '
                       f'divide over {devices} devices.')
    batch = setup.batch_size // devices
    peaks, saved = {}, {}

    def peak(n, setup=setup, batch=batch, peaks=peaks):
      if n not in peaks:
        peaks[n] = step_bytes(setup.config, batch, setup.input_length,
                              setup.target_length, setup.pack, n)['peak']
      return peaks[n]

    def kept(n, policy, setup=setup, batch=batch, saved=saved):
      if (n, policy) not in saved:
        saved[(n, policy)] = saved_bytes(
            dataclasses.replace(setup.config, remat_policy=policy),
            batch // n, setup.input_length, setup.target_length, setup.pack)
      return saved[(n, policy)]

    def peak_full(n):
      return full_remat_peak(peak(n), kept(n, 'none'), kept(n, 'full'))

    row = {'setup': name, 'pack': setup.pack, 'batch_per_device': batch,
           'peak_none': peak(1),
           'saved_none': kept(1, 'none'), 'saved_full': kept(1, 'full'),
           'fits': {}}
    row['peak_full'] = peak_full(1)
    for gb in device_memory_gb:
      row['fits'][gb] = {
          'none': smallest_fitting(peak, batch, gb * GB),
          'full': smallest_fitting(peak_full, batch, gb * GB)}
    rows.append(row)
  return rows


def format_rows(rows: Sequence[dict], device_memory_gb: Sequence[float]
                ) -> str:
  """The table: per device, the peak GB and the activations the backward
  keeps with 'none' / 'full', and the fitting NUM_MICROBATCHES per device
  memory and remat policy ('-': nothing fits). Each setup is compiled in
  its run's row format; one whose run does not pack is marked
  `(unpacked)`."""
  head = (f'{"setup":<46}{"rows":>5}{"none GB":>9}{"full GB":>9}'
          f'{"kept none":>10}{"kept full":>10}')
  for gb in device_memory_gb:
    head += f'{f"{gb:g}GB none":>12}{f"{gb:g}GB full":>12}'
  lines = [head]
  for r in rows:
    name = r['setup'] + ('' if r['pack'] else ' (unpacked)')
    line = (f'{name:<46}{r["batch_per_device"]:>5}'
            f'{r["peak_none"] / GB:>9.1f}{r["peak_full"] / GB:>9.1f}'
            f'{r["saved_none"] / GB:>10.1f}{r["saved_full"] / GB:>10.1f}')
    for gb in device_memory_gb:
      for policy in ('none', 'full'):
        n = r['fits'][gb][policy]
        line += f'{"-" if n is None else f"n={n}":>12}'
    lines.append(line)
  return '\n'.join(lines)
