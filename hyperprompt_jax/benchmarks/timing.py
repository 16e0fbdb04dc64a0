"""What every benchmark measures with: random batches, the runners'
initialisation, the built-in runner's training step compiled and warmed up,
XLA's peak-memory estimate, and several programs timed side by side in one
process, every call on its own, their ratios relative to each round's level
(`relative_ratio`; ratios, never absolute targets)."""

import contextlib
import functools
import io
import math
import re
import time
from typing import Callable, Optional

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np

from hyperprompt_jax.model import network
from hyperprompt_jax.training import metabalance
from hyperprompt_jax.training import trainer

Z_LOSS = 1e-4


def random_batch(rng: np.random.Generator, batch: int, input_length: int,
                 target_length: int, vocab: int, num_tasks: int = 8):
  """A batch of `trainer.BATCH_KEYS` with random tokens and task ids."""
  targets = rng.integers(1, vocab, (batch, target_length), dtype=np.int32)
  return {
      'encoder_input_tokens': rng.integers(1, vocab, (batch, input_length),
                                           dtype=np.int32),
      'decoder_input_tokens': np.concatenate(
          [np.zeros((batch, 1), np.int32), targets[:, :-1]], 1),
      'decoder_target_tokens': targets,
      'decoder_loss_weights': np.ones_like(targets),
      'task_ids': rng.integers(0, num_tasks, (batch,), dtype=np.int32),
  }


def fresh_params(model: network.Transformer, input_length: int,
                  target_length: int):
  """The runners' initialisation (`network.init_variables`), seed 0."""
  return jax.jit(lambda rng: network.init_variables(
      model, rng, input_length, target_length)['params'])(
          jax.random.PRNGKey(0))


def fresh_state(model: network.Transformer, optimizer, input_length: int,
                target_length: int) -> dict:
  """The built-in runner's training state at step 0 around `fresh_params`:
  `{'step', 'params', 'opt_state'}`."""
  params = fresh_params(model, input_length, target_length)
  return {'step': jnp.zeros((), jnp.int32), 'params': params,
          'opt_state': optimizer.init(params)}


def _round_order(names: list[str], r: int) -> list[str]:
  """The runners of round `r`: each round starts at another one, so no
  runner always runs first (right after a switch of programs, or after
  the previous round)."""
  return names[r % len(names):] + names[:r % len(names)]


def step_times(runners: dict[str, Callable[[int], jax.Array]],
               rounds: int, steps: int) -> dict[str, np.ndarray]:
  """Seconds of every call of each runner (`i -> output`), `[rounds,
  steps]`, in interleaved rounds (`_round_order`), each call waited for
  and timed on its own."""
  names = list(runners)
  times = {name: np.zeros((rounds, steps)) for name in names}
  for r in range(rounds):
    for name in _round_order(names, r):
      for i in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(runners[name](i))
        times[name][r, i] = time.perf_counter() - start
  return times


def relative_ratio(times: dict[str, np.ndarray], numerator: str,
                   denominator: str) -> float:
  """One runner's time over another's, from `step_times`: each call's
  seconds over its round's level (the geometric mean over all runners of
  their mean call in that round), pooled over every call of a runner, and
  the ratio of the two medians.

  Why this estimator: on a shared CPU the calls' times jitter call by call
  (up to 12 % between two calls of one program, one after the other), and
  the machine also slows for minutes at a time. Dividing by the round's level
  takes out the slow part, which every runner of a round shares; the median
  over all `rounds * steps` calls takes out the jitter. The median over
  rounds of the same-round ratio of two runners (the estimator before) left
  the jitter of one pair of calls in each ratio: over two halves of one run
  (MTL and HyperFormer++, 5 rounds x 3 steps each) it put the halves 5-7 %
  apart, this one 1-2 % (docs/performance.md, Packing)."""
  relative = _relative_to_round(times)
  return (float(np.median(relative[numerator]))
          / float(np.median(relative[denominator])))


def _relative_to_round(times: dict[str, np.ndarray]
                       ) -> dict[str, np.ndarray]:
  """Each call's seconds (`step_times`, `[rounds, steps]`) over its round's
  level: the geometric mean over all runners of their mean call that
  round. A round's level depends on that round's calls only."""
  level = np.exp(np.mean([np.log(t.mean(axis=1)) for t in times.values()],
                         axis=0))  # [rounds]
  return {name: t / level[:, None] for name, t in times.items()}


def relative_ratio_interval(times: dict[str, np.ndarray], numerator: str,
                            denominator: str, coverage: float = 0.95,
                            draws: int = 1000, seed: int = 0
                            ) -> tuple[float, float]:
  """A bootstrap interval of `relative_ratio` over the rounds: the
  `coverage` central quantiles of the ratio over `draws` resamples of the
  rounds (with replacement; a resampled round keeps all its runners'
  calls, so each keeps its level, computed once). Rounds, not calls, are
  resampled because calls of one round share the machine's state of those
  minutes.
  Seeded: the same times give the same interval.

  It is the spread within one run, and with few rounds it is narrow (in
  simulation, 6 rounds x 2 steps of 4 % jitter and 5 % drift between
  rounds, the 95 % interval held the true ratio in about 90 % of runs;
  `tests/test_benchmark.py`). Runs on a shared machine differ by more: of
  two runs of 12 rounds x 2 steps, the first's intervals missed two of the
  second's three step ratios (docs/performance.md, Packing)."""
  relative = _relative_to_round(times)
  top, bottom = relative[numerator], relative[denominator]
  rounds = top.shape[0]
  rng = np.random.default_rng(seed)
  ratios = []
  for _ in range(draws):
    pick = rng.integers(0, rounds, rounds)
    ratios.append(np.median(top[pick]) / np.median(bottom[pick]))
  tail = (1 - coverage) / 2
  low, high = np.quantile(ratios, [tail, 1 - tail])
  return float(low), float(high)


def timed_side_by_side(runners: dict[str, Callable[[int], jax.Array]],
                       rounds: int, steps: int, baseline: str
                       ) -> dict[str, tuple[float, float]]:
  """Each runner's median seconds per call and its time over
  `baseline`'s (`relative_ratio`), from `step_times`' interleaved
  rounds."""
  times = step_times(runners, rounds, steps)
  return {name: (float(np.median(t)), relative_ratio(times, name, baseline))
          for name, t in times.items()}


def peak_bytes(compiled) -> int:
  """XLA's peak-memory estimate of a compiled computation."""
  m = compiled.memory_analysis()
  return (m.temp_size_in_bytes + m.argument_size_in_bytes
          + m.output_size_in_bytes - m.alias_size_in_bytes)


def step_runner(model: network.Transformer, optimizer, state, batch,
                balancing: Optional[metabalance.Plan] = None,
                num_microbatches: int = 1, temp_bytes: Optional[list] = None
                ) -> tuple[Callable[[int], jax.Array], int]:
  """`(i -> loss of training step i, peak bytes)`: the built-in runner's
  step (`trainer.train_step`) compiled for `state` and `batch` (donated:
  each call steps the state on), warmed up. `temp_bytes`, a list, gets the
  step's temporaries appended."""
  rng = jax.random.PRNGKey(1)
  step = jax.jit(functools.partial(trainer.train_step, model, optimizer,
                                   z_loss=Z_LOSS, balancing=balancing,
                                   num_microbatches=num_microbatches),
                 donate_argnums=(0,)).lower(state, batch, rng).compile()
  if temp_bytes is not None:
    temp_bytes.append(step.memory_analysis().temp_size_in_bytes)
  state, terms = step(state, batch, rng)
  jax.block_until_ready(terms['loss'])
  holder = [state]

  def run(i):
    holder[0], terms = step(holder[0], batch, jax.random.PRNGKey(i))
    return terms['loss']

  return run, peak_bytes(step)


def saved_activation_bytes(model: network.Transformer, params, batch,
                           z_loss: float = Z_LOSS) -> int:
  """Bytes of the activations the training step's backward pass keeps from
  its forward on `batch` (JAX's saved residuals of the loss, the arguments
  left out): what REMAT_POLICY trades for recomputation, as JAX hands it to
  XLA. XLA may still recompute or reorder on its own; its CPU compiler's
  `memory_analysis` does not show remat's saving (docs/performance.md).
  `params` and `batch` may be abstract (`jax.ShapeDtypeStruct`)."""
  loss = functools.partial(trainer.loss_fn, model, z_loss=z_loss)
  listing = io.StringIO()
  with contextlib.redirect_stdout(listing):
    jax.ad_checkpoint.print_saved_residuals(
        lambda p, b: loss(p, b, jax.random.PRNGKey(0))[0], params, batch)
  return sum(size for size, source in map(_residual, listing.getvalue()
                                         .splitlines())
             if not source.startswith('from the argument'))


# Bytes an element of each dtype in `print_saved_residuals`' short names.
_ITEM_BYTES = {'bool': 1, 'i8': 1, 'u8': 1, 'i16': 2, 'u16': 2, 'f16': 2,
               'bf16': 2, 'i32': 4, 'u32': 4, 'f32': 4, 'i64': 8, 'u64': 8,
               'f64': 8, 'c64': 8, 'c128': 16}
_RESIDUAL = re.compile(r'^(\w+)\[([\d,]*)\] (.*)$')


def _residual(line: str) -> tuple[int, str]:
  """`(bytes, source)` of one line of `jax.ad_checkpoint.
  print_saved_residuals` (e.g. "f32[3,5] output of cos from ..."): JAX's
  public API prints the residuals' list rather than returning it."""
  match = _RESIDUAL.match(line)
  if not match or match.group(1) not in _ITEM_BYTES:
    raise ValueError(f'Unreadable line of print_saved_residuals: {line!r}; '
                     'extend timing._ITEM_BYTES / _RESIDUAL for it.')
  dims = [int(d) for d in match.group(2).split(',') if d]
  return math.prod(dims) * _ITEM_BYTES[match.group(1)], match.group(3)
