"""Real-token throughput of packed against unpacked training rows.

    python -m hyperprompt_jax.benchmark --packing [--batch_sizes=8]
        [--input_length=512] [--target_length=32] [--lengths=both]
        [--variants=hyperprompt_global,hyperprompt_share,hyperprompt_sep,adapter,...]

For MTL and each variant that packs, the built-in runner's
training step (`trainer.train_step`) is compiled twice, for `batch` rows of
one example each and for `batch` packed rows, and timed side by side in one
process, every step on its own (`timing.step_times`). A step's work is its
real target tokens (the loss's tokens); throughput is real target tokens
per second at the median step time. A step's cost does not depend on what
its rows hold (static shapes), so the timed batch is the first `batch`
rows, and a row's real tokens, examples, fill and tasks are means over a
long stretch of the stream (`STREAM_ROWS` packed rows, and as many
unpacked rows as they hold examples), as a run sees them: 8 rows are too
few (at 512 / 32 the 8 unpacked rows' target tokens swing by +-10 %
between draws). The ratios (a packed step against MTL's, and the
speedup: packed real tokens per second over unpacked) are
`timing.relative_ratio`s: each step's time relative to its round's, the
median over all steps of a variant; each is printed with its bootstrap
interval over the rounds (`timing.relative_ratio_interval`): the spread
within the run (another run on a shared machine may fall further).

Both batches come out of the project's own feature converter
(`TaskIdsEncDecFeatureConverter`, the best-fit packer of
`tasks/packing.py`) over a stream of examples whose lengths follow one of
two distributions:

- 'fixture': the offline fixture mixture of the 16 GLUE + SuperGLUE tasks
  (`fixture_glue_super_glue_proportional`), its real examples and their
  byte-vocabulary lengths;
- 'glue_super_glue': T5's proportional GLUE + SuperGLUE mixture with
  estimated lengths (`length_estimates.sample_glue_super_glue`).

Token ids are random (the step's cost does not depend on them); each
example's task id is its task's index modulo the model's `num_tasks` (the
variant's paper setup has T = 8: only the id range matters to the cost).
"""

from typing import Sequence

import gin
import jax
import numpy as np
import seqio
import tensorflow as tf

# Registers the project's seqio tasks.
from hyperprompt_jax import tasks  # pylint: disable=unused-import
from hyperprompt_jax.benchmarks import length_estimates
from hyperprompt_jax.benchmarks import timing
from hyperprompt_jax.common import batches as batch_lib
from hyperprompt_jax.model import network
from hyperprompt_jax.tasks import packing
from hyperprompt_jax.training import optimizers
from hyperprompt_jax.training import trainer

FIXTURE_MIXTURE = 'fixture_glue_super_glue_proportional'
LENGTH_DISTRIBUTIONS = ('fixture', 'glue_super_glue')
# Packed rows a row's means are taken over (~1,500 examples at 512 / 32).
STREAM_ROWS = 256


def _fixture_lengths(count: int, seed: int) -> list[tuple[int, int, int]]:
  """`(input length, target length, task id)` of `count` shuffled examples
  of the fixture mixture (byte vocabulary, untruncated), with the ids of its
  16-task list."""
  binding = 'hyperprompt_jax.tasks.task_ids.run_task_list.benchmark'
  try:
    previous = gin.query_parameter(binding)
  except ValueError:
    previous = None
  with gin.unlock_config():
    gin.bind_parameter(binding, 'glue_super_glue')
  try:
    dataset = seqio.get_mixture_or_task(FIXTURE_MIXTURE).get_dataset(
        {'inputs': 1 << 16, 'targets': 1 << 16}, split='train', shuffle=True,
        seed=seed, num_epochs=None)
    return [(len(ex['inputs']), len(ex['targets']), int(ex['task_ids']))
            for ex in dataset.take(count).as_numpy_iterator()]
  finally:
    with gin.unlock_config():
      gin.bind_parameter(binding, previous or 'glue')


def example_lengths(distribution: str, count: int, seed: int = 0
                    ) -> list[tuple[int, int, int]]:
  """`count` examples' `(input length, target length, task)` (EOS included)."""
  if distribution == 'fixture':
    return _fixture_lengths(count, seed)
  if distribution == 'glue_super_glue':
    return length_estimates.sample_glue_super_glue(
        np.random.default_rng(seed), count)
  raise ValueError(f'Unknown length distribution {distribution!r}: choose '
                   f'from {LENGTH_DISTRIBUTIONS}.')


def converted_batch(lengths: Sequence[tuple[int, int, int]], batch_size: int,
                    input_length: int, target_length: int, vocab_size: int,
                    num_tasks: int, rows: batch_lib.RowFormat, seed: int = 0
                    ) -> dict[str, np.ndarray]:
  """`batch_size` rows of these examples (random tokens, task ids modulo
  `num_tasks`) after the project's feature converter for `rows`. Packed,
  the first `packing.BUFFER_SIZE` rows are skipped: the best-fit packer's
  buffer starts as the stream's first examples, and only later holds what
  a run's buffer holds (the examples that wait for a row's last places)."""
  rng = np.random.default_rng(seed)

  def examples():  # truncated to the row, as seqio's trim would
    for inputs, targets, task in lengths:
      inputs = min(inputs, input_length - rows.input_prompt_length)
      targets = min(targets, target_length)
      yield {'inputs': rng.integers(2, vocab_size, inputs, dtype=np.int32),
             'targets': rng.integers(2, vocab_size, targets, dtype=np.int32),
             'task_ids': np.int32(task % num_tasks)}

  dataset = tf.data.Dataset.from_generator(
      examples, output_signature={
          'inputs': tf.TensorSpec([None], tf.int32),
          'targets': tf.TensorSpec([None], tf.int32),
          'task_ids': tf.TensorSpec([], tf.int32)})
  converter = rows.converter()
  converted = converter(dataset, {'inputs': input_length,
                                  'targets': target_length})
  skip = packing.BUFFER_SIZE if rows.packed else 0
  made = list(converted.skip(skip).take(batch_size).as_numpy_iterator())
  if len(made) < batch_size:
    raise ValueError(f'{len(lengths)} examples fill only {len(made)} of '
                     f'{batch_size} rows: draw more.')
  return {k: np.stack([r[k] for r in made]) for k in made[0]}


def tasks_per_row(batch: dict[str, np.ndarray]) -> np.ndarray:
  """Distinct tasks in each packed row."""
  ids, segments = batch['encoder_task_ids'], batch['encoder_segment_ids']
  return np.array([len(np.unique(i[s > 0])) for i, s in zip(ids, segments)])


def _row_means(rows: dict[str, np.ndarray], pack: bool) -> dict:
  """Per row of a stretch of the stream: real target tokens, examples and
  (packed) distinct tasks; and the filled fraction of its positions."""
  info = {
      'examples': float(rows['decoder_segment_ids'].max(axis=1).mean()
                        if pack else 1.0),
      'target_tokens': float((rows['decoder_target_tokens'] > 0).sum(axis=1
                                                                     ).mean()),
      'efficiency': float(
          ((rows['encoder_input_tokens'] > 0).sum()
           + (rows['decoder_target_tokens'] > 0).sum())
          / (rows['encoder_input_tokens'].size
             + rows['decoder_target_tokens'].size)),
  }
  if pack:
    info['tasks_per_row'] = tasks_per_row(rows)
  return info


def packing_benchmark(configs: dict[str, network.T5Config], batch_size: int,
                      input_length: int, target_length: int,
                      distributions: Sequence[str], rounds: int, steps: int,
                      z_loss: float = 1e-4, stream_rows: int = STREAM_ROWS
                      ) -> dict[str, list[dict]]:
  """Per length distribution, one row per variant: seconds per step and real
  target tokens per second, unpacked and packed, on the same example
  stream. Each (variant, layout) step is compiled once (the shapes do not
  depend on the distribution) and every step is timed side by side; a
  row's tokens, examples and fill are means over `stream_rows` packed rows
  and the examples they hold, unpacked.

  Args:
    configs: variant name -> its configuration ('mtl' first).
  """
  if stream_rows < batch_size:
    raise ValueError(f'stream_rows ({stream_rows}) must be at least the '
                     f'batch ({batch_size}).')
  optimizer = optimizers.make_optimizer()
  # Enough examples for the skipped and `stream_rows` packed rows: a row
  # holds at most target_length / 2 (a target is a piece and EOS or more).
  lengths = {d: example_lengths(
      d, (stream_rows + packing.BUFFER_SIZE) * target_length // 2)
             for d in distributions}
  runners, info = {}, {}
  for name, cfg in configs.items():
    model = network.Transformer(cfg)
    state = timing.fresh_state(model, optimizer, input_length, target_length)
    batches = {}
    for d in distributions:
      packed = converted_batch(
          lengths[d], stream_rows, input_length, target_length,
          cfg.vocab_size, cfg.num_tasks, batch_lib.RowFormat.of(cfg, True))
      info[(d, name, True)] = _row_means(packed, True)
      held = int(packed['decoder_segment_ids'].max(axis=1).sum())
      unpacked = converted_batch(
          lengths[d], held, input_length, target_length, cfg.vocab_size,
          cfg.num_tasks, batch_lib.RowFormat.of(cfg, False))
      info[(d, name, False)] = _row_means(unpacked, False)
      for pack, rows in ((False, unpacked), (True, packed)):
        batches[(d, pack)] = {k: v[:batch_size].copy()  # not a view
                              for k, v in rows.items()}
    for pack in (False, True):
      step = jax.jit(lambda s, b, r, m=model: trainer.train_step(
          m, optimizer, s, b, r, z_loss)).lower(
              state, batches[(distributions[0], pack)],
              jax.random.PRNGKey(0)).compile()
      for d in distributions:
        batch = batches[(d, pack)]
        jax.block_until_ready(step(state, batch, jax.random.PRNGKey(0)))
        runners[(d, name, pack)] = (
            lambda i, step=step, s=state, b=batch:
            step(s, b, jax.random.PRNGKey(i))[1]['loss'])
  times = timing.step_times(runners, rounds, steps)
  seconds = {key: float(np.median(t)) for key, t in times.items()}
  tables = {}
  for d in distributions:
    rows = []
    for name in configs:
      row = {'variant': name, 'num_tasks': configs[name].num_tasks,
             'batch_size': batch_size, 'stream_rows': stream_rows,
             'rounds': rounds, 'steps': steps}
      for pack, label in ((False, 'unpacked'), (True, 'packed')):
        key = (d, name, pack)
        row[f'{label}_seconds'] = seconds[key]
        row[f'{label}_examples_per_row'] = info[key]['examples']
        row[f'{label}_efficiency'] = info[key]['efficiency']
        row[f'{label}_tokens_per_second'] = (
            info[key]['target_tokens'] * batch_size / seconds[key])
      # Real tokens a row packed over unpacked, times the unpacked step's
      # time over the packed one's (`timing.relative_ratio`, as the step
      # ratio below).
      # Each with its bootstrap interval over the rounds
      # (`timing.relative_ratio_interval`): the spread within this run.
      tokens = (info[(d, name, True)]['target_tokens']
                / info[(d, name, False)]['target_tokens'])
      unpacked_to_packed = ((d, name, False), (d, name, True))
      row['speedup'] = tokens * timing.relative_ratio(
          times, *unpacked_to_packed)
      row['speedup_interval'] = tuple(
          tokens * r for r in timing.relative_ratio_interval(
              times, *unpacked_to_packed))
      packed_to_mtl = ((d, name, True), (d, 'mtl', True))
      row['packed_step_to_mtl'] = timing.relative_ratio(times, *packed_to_mtl)
      row['packed_step_to_mtl_interval'] = timing.relative_ratio_interval(
          times, *packed_to_mtl)
      rows.append(row)
    rows[0]['tasks_per_row'] = info[(d, 'mtl', True)]['tasks_per_row']
    tables[d] = rows
  return tables


def format_packing(rows: list[dict]) -> str:
  def interval(low_high, digits):
    return f'({low_high[0]:.{digits}f}-{low_high[1]:.{digits}f})'

  lines = [f'{"variant":<15}{"unpacked tok/s":>15}{"packed tok/s":>14}'
           f'{"speedup (95%)":>23}{"packed step / MTL packed (95%)":>33}']
  for r in rows:
    lines.append(
        f'{r["variant"]:<15}{r["unpacked_tokens_per_second"]:>15.1f}'
        f'{r["packed_tokens_per_second"]:>14.1f}'
        f'{r["speedup"]:>9.2f}x {interval(r["speedup_interval"], 2):>13}'
        f'{r["packed_step_to_mtl"]:>16.3f}x '
        f'{interval(r["packed_step_to_mtl_interval"], 3):>16}')
  mtl = rows[0]
  per_row = mtl['tasks_per_row']
  lines.append(
      f'over {mtl["stream_rows"]} packed rows of the stream (timed: the '
      f'first {mtl["batch_size"]}): examples per packed row '
      f'{mtl["packed_examples_per_row"]:.2f}; rows filled: unpacked '
      f'{100 * mtl["unpacked_efficiency"]:.0f}%, packed '
      f'{100 * mtl["packed_efficiency"]:.0f}%; tasks per packed row: mean '
      f'{per_row.mean():.1f}, max {per_row.max()} (of T = '
      f'{mtl["num_tasks"]}); timed: {mtl["rounds"]} rounds x '
      f'{mtl["steps"]} steps (95%: bootstrap intervals over the rounds)')
  return '\n'.join(lines)
