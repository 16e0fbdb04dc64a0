"""Best-fit packing of examples into training rows, as a tf.data transform.

seqio's packer (`seqio.utils.trim_and_pack_dataset`) fills one row at a
time in stream order and closes it at the first example that does not fit,
so at GLUE + SuperGLUE lengths a long MultiRC or ReCoRD example often ends
a half-full row. `best_fit_pack` fills the open row from a buffer of the
next `buffer_size` examples and closes it only when no buffered example
fits in every feature. Each step moves the example that leaves the least
room, with one step of lookahead (`_scores`); ties go to the oldest, and a
new row opens with the example the same rule picks for an empty row. Room
is weighed per feature (`_feature_weights`) so that the feature the stream
fills first counts and the others barely: weighing them alike spent rows
on the feature that does not bind and kept small examples waiting in the
buffer. Rows fill better than seqio's (docs/performance.md, "Packing").

The output is seqio's: every feature `k` of `feature_lengths`, trimmed and
packed, with `k_segment_ids` (1, 2, ... per example, 0 on padding) and
`k_positions` (0, 1, ... within each example), int32 `[length]`. Rows take
examples out of stream order, as a shuffle buffer does; every example is
packed once.

It is a `tf.data.Dataset.scan`, so the packer is deterministic and its
buffer and open row are part of the iterator's state, which
`tf.train.Checkpoint` saves with the iterator: a resumed run gets exactly
the rows it would have got. seqio offers no packer to plug in, and no
tf.data transform packs best-fit.
"""

import dataclasses
from typing import Any, Mapping, Optional

import numpy as np
import tensorflow as tf

# Examples buffered for the best fit (docs/performance.md, Packing).
BUFFER_SIZE = 16
# How much the scarce feature outweighs the others (`_feature_weights`): a
# compromise between both benchmark distributions, found by simulation
# (lower fills GLUE + SuperGLUE inputs more, higher the fixture's targets).
SCARCITY_POWER = 6
# The packer as run records name it (a run resumes only with the packer
# whose state its iterator checkpoint holds).
NAME = f'best_fit(buffer_size={BUFFER_SIZE}, choice=scarce_pairs)'


def name(max_examples: Optional[int] = None) -> str:
  """The packer's record name, with its bound on examples per row."""
  if max_examples is None:
    return NAME
  return f'{NAME[:-1]}, max_examples={max_examples})'


def _feature_weights(seen_lengths: tf.Tensor, seen: tf.Tensor,
                     lengths: list[int]) -> tf.Tensor:
  """`[features]` float64 weights of the features' room in a row.

  Each feature's demand (mean example length over row length) over the
  largest one's, to SCARCITY_POWER: the feature the stream fills first
  counts 1, the others barely. All 0 before any example.
  """
  demand = (tf.cast(seen_lengths, tf.float64) / tf.cast(lengths, tf.float64)
            / tf.cast(tf.maximum(seen, 1), tf.float64))
  x = tf.math.divide_no_nan(demand, tf.reduce_max(demand))
  weights = tf.ones_like(x)
  for _ in range(SCARCITY_POWER):  # products, not pow: exact in any libm
    weights = weights * x
  return weights


def _scores(buffer_lengths: tf.Tensor, buffered: tf.Tensor, free: tf.Tensor,
            weights: tf.Tensor, lengths: list[int]) -> tf.Tensor:
  """`[slots]` float64: minus the room the open row would have left.

  Room is the largest over features of weight * free positions / row
  length, after the slot's example alone or followed by the buffered
  example that then leaves the least. Higher is better; the caller
  compares only the slots that fit.
  """
  scale = weights / tf.cast(lengths, tf.float64)

  def room(left):  # [..., features] int -> [...] float64
    return tf.reduce_max(tf.cast(left, tf.float64) * scale, axis=-1)

  alone = free[None] - buffer_lengths  # [slots, features]
  paired = alone[:, None] - buffer_lengths[None]  # [slots, slots, features]
  ok = tf.logical_and(
      tf.reduce_all(paired >= 0, axis=-1),
      tf.logical_and(buffered[None],
                     tf.logical_not(tf.eye(buffered.shape[0],
                                           dtype=tf.bool))))
  return tf.maximum(
      -room(alone),
      tf.reduce_max(tf.where(ok, -room(paired), -np.inf), axis=1))


def _check_arguments(spec: Mapping[str, tf.TensorSpec],
                     feature_lengths: Mapping[str, int], buffer_size: int,
                     max_examples: Optional[int]) -> None:
  """Raises ValueError on arguments `best_fit_pack` cannot pack with."""
  if (isinstance(buffer_size, bool) or not isinstance(buffer_size, int)
      or buffer_size < 1):
    raise ValueError(f'buffer_size must be an int >= 1, got {buffer_size!r}.')
  if max_examples is not None and (
      isinstance(max_examples, bool) or not isinstance(max_examples, int)
      or max_examples < 1):
    raise ValueError(
        f'max_examples must be None or an int >= 1, got {max_examples!r}.')
  for k in sorted(feature_lengths):
    if k not in spec:
      raise ValueError(f'Feature {k!r} is not in the dataset (it has '
                       f'{sorted(spec)}).')
    if not spec[k].shape.is_compatible_with([None]):
      raise ValueError(f'Packed features must be one-dimensional; {k!r} has '
                       f'shape {spec[k].shape}.')
    if feature_lengths[k] < 1:
      raise ValueError(f'Feature {k!r} has row length {feature_lengths[k]}.')


@dataclasses.dataclass(frozen=True)
class _Packer:
  """The scan of `best_fit_pack`: its static layout and its step.

  Its methods are TF ops and static Python, so AutoGraph has nothing to
  convert (and would re-read their source from disk to try).

  Attributes:
    keys: the packed features, sorted.
    lengths: each feature's row length.
    dtypes: each feature's dtype.
    buffer_size: the buffer's slots, b.
    max_examples: at most this many examples a row (None: no bound).
  """
  keys: tuple[str, ...]
  lengths: tuple[int, ...]
  dtypes: tuple[tf.dtypes.DType, ...]
  buffer_size: int
  max_examples: Optional[int]

  def initial_state(self) -> dict[str, Any]:
    """The empty buffer and open row.

    Returns:
      `buffer` `{k: [b, n_k]}`, `buffer_lengths` `[b, features]`,
      `buffered` `[b]` bool, `row`, `segment_ids`, `positions`
      `{k: [n_k]}`, `used` `[features]`, the open row's `examples`, each
      slot's `arrival` `[b]` (for ties), and the stream's `seen` examples
      and `seen_lengths` `[features]` (its demand).
    """
    b, features = self.buffer_size, list(zip(self.keys, self.lengths,
                                             self.dtypes))
    return {
        'buffer': {k: tf.zeros([b, n], dtype) for k, n, dtype in features},
        'buffer_lengths': tf.zeros([b, len(self.keys)], tf.int32),
        'buffered': tf.zeros([b], tf.bool),
        'row': {k: tf.zeros([n], dtype) for k, n, dtype in features},
        'segment_ids': {k: tf.zeros([n], tf.int32) for k, n, _ in features},
        'positions': {k: tf.zeros([n], tf.int32) for k, n, _ in features},
        'used': tf.zeros([len(self.keys)], tf.int32),
        'examples': tf.constant(0, tf.int32),
        'arrival': tf.zeros([b], tf.int64),
        'seen': tf.constant(0, tf.int64),
        'seen_lengths': tf.zeros([len(self.keys)], tf.int64),
    }

  def _insert(self, state: dict, example: Mapping[str, tf.Tensor],
              insert: tf.Tensor) -> dict:
    """`state` with the example in the first free slot, where `insert`.

    One is free: the buffer never holds more than b - 1 between steps.
    """
    b = self.buffer_size
    slot = tf.argmin(tf.cast(state['buffered'], tf.int32),
                     output_type=tf.int32)
    example_lengths = tf.stack([tf.shape(example[k])[0] for k in self.keys])
    into_slot = tf.logical_and(insert, tf.range(b) == slot)
    buffer = {k: tf.where(into_slot[:, None],
                          tf.pad(example[k], [[0, n - tf.shape(example[k])[0]]]
                                 )[None], state['buffer'][k])
              for k, n in zip(self.keys, self.lengths)}
    return {
        **state, 'buffer': buffer,
        'buffer_lengths': tf.where(into_slot[:, None], example_lengths[None],
                                   state['buffer_lengths']),
        'buffered': tf.logical_or(state['buffered'], into_slot),
        'arrival': tf.where(into_slot, state['seen'], state['arrival']),
        'seen': state['seen'] + tf.cast(insert, tf.int64),
        'seen_lengths': state['seen_lengths'] + tf.cast(
            example_lengths, tf.int64) * tf.cast(insert, tf.int64),
    }

  def _fits(self, state: dict) -> tf.Tensor:
    """`[b]` bool: the buffered examples the open row has room for."""
    capacity = tf.constant(self.lengths, tf.int32)
    fits = tf.logical_and(
        state['buffered'],
        tf.reduce_all(state['used'][None] + state['buffer_lengths']
                      <= capacity, axis=1))
    if self.max_examples is not None:  # a full row takes no more examples
      fits = tf.logical_and(fits, state['examples'] < self.max_examples)
    return fits

  @staticmethod
  def _emptied(state: dict, close: tf.Tensor) -> dict:
    """`state` with the open row emptied where `close`."""
    keep = tf.logical_not(close)
    empty = lambda v: tf.where(keep, v, tf.zeros_like(v))
    return {
        **state,
        **{part: {k: empty(v) for k, v in state[part].items()}
           for part in ('row', 'segment_ids', 'positions')},
        'used': empty(state['used']),
        'examples': tf.where(keep, state['examples'], 0),
    }

  def _chosen(self, state: dict, fits: tf.Tensor) -> tf.Tensor:
    """The slot whose example moves: the best-scored that fits, oldest first."""
    capacity = tf.constant(self.lengths, tf.int32)
    score = _scores(state['buffer_lengths'], state['buffered'],
                    capacity - state['used'],
                    _feature_weights(state['seen_lengths'], state['seen'],
                                     list(self.lengths)),
                    list(self.lengths))
    best = tf.reduce_max(tf.where(fits, score, -np.inf))
    tied = tf.logical_and(fits, tf.equal(score, best))
    return tf.argmin(tf.where(tied, state['arrival'],
                              np.iinfo(np.int64).max), output_type=tf.int32)

  def _moved(self, state: dict, chosen: tf.Tensor, move: tf.Tensor) -> dict:
    """`state` with the `chosen` example as the open row's next segment."""
    chosen_lengths = state['buffer_lengths'][chosen] * tf.cast(move, tf.int32)
    row, segment_ids, positions = (dict(state[part]) for part in (
        'row', 'segment_ids', 'positions'))
    used, examples = state['used'], state['examples']
    for i, (k, n) in enumerate(zip(self.keys, self.lengths)):
      index = tf.range(n)
      start, end = used[i], used[i] + chosen_lengths[i]
      span = tf.logical_and(index >= start, index < end)
      # Buffered examples are zero-padded, so shifting one by `start` along
      # the row puts it at [start, end) (end <= n: it fits).
      row[k] = tf.where(span, tf.roll(state['buffer'][k][chosen], start,
                                      axis=0), row[k])
      segment_ids[k] = tf.where(span, examples + 1, segment_ids[k])
      positions[k] = tf.where(span, index - start, positions[k])
    return {
        **state,
        'buffered': tf.logical_and(
            state['buffered'], tf.logical_not(tf.logical_and(
                move, tf.range(self.buffer_size) == chosen))),
        'row': row, 'segment_ids': segment_ids, 'positions': positions,
        'used': used + chosen_lengths,
        'examples': examples + tf.cast(move, tf.int32),
    }

  def step(self, state: dict, element: tuple[Mapping[str, tf.Tensor],
                                             tf.Tensor]):
    """One scan step; returns `(state, (closed, the closed row))`.

    The example (or a flush) goes into the buffer; once it is full (or
    flushing), the best-scored example that fits moves into the row, else
    the row closes and the best-scored starts the next.
    """
    example, is_flush = element
    state = self._insert(state, example, tf.logical_not(is_flush))
    count = tf.reduce_sum(tf.cast(state['buffered'], tf.int32))
    move = tf.logical_or(tf.equal(count, self.buffer_size),
                         tf.logical_and(is_flush, count > 0))
    fits = self._fits(state)
    close = tf.logical_and(state['examples'] > 0, tf.logical_or(
        tf.logical_and(move, tf.logical_not(tf.reduce_any(fits))),
        tf.logical_and(is_flush, tf.equal(count, 0))))
    emitted = {**state['row'],
               **{f'{k}_segment_ids': v
                  for k, v in state['segment_ids'].items()},
               **{f'{k}_positions': v for k, v in state['positions'].items()}}
    state = self._emptied(state, close)
    # A closed row is empty again, and every buffered example fits it.
    fits = tf.logical_or(fits, tf.logical_and(close, state['buffered']))
    state = self._moved(state, self._chosen(state, fits), move)
    return state, (close, emitted)


def best_fit_pack(dataset: tf.data.Dataset, feature_lengths: Mapping[str, int],
                  buffer_size: int = BUFFER_SIZE,
                  max_examples: Optional[int] = None) -> tf.data.Dataset:
  """Packs `dataset`'s examples into rows of `feature_lengths`.

  Args:
    dataset: examples with (at least) the features of `feature_lengths`,
      each of rank 1 (`[None]`); other features are dropped, as seqio's
      packer drops them.
    feature_lengths: feature -> its row length; longer examples are trimmed.
    buffer_size: examples the packer chooses from (>= 1; 1 packs in stream
      order, like seqio's).
    max_examples: at most this many examples a row (the row closes at it;
      models that gate each example by its own weights need a bound, e.g.
      HyperGrid's MAX_SEGMENTS); None: as many as fit.

  Returns:
    Packed rows: `k`, `k_segment_ids`, `k_positions` (int32 for the ids and
    positions, `k`'s dtype for `k`; each `[feature_lengths[k]]`). A finite
    `dataset` ends with its last, partly filled rows.
  """
  spec = dataset.element_spec
  _check_arguments(spec, feature_lengths, buffer_size, max_examples)
  keys = tuple(sorted(feature_lengths))
  packer = _Packer(keys, tuple(int(feature_lengths[k]) for k in keys),
                   tuple(spec[k].dtype for k in keys), buffer_size,
                   max_examples)

  @tf.autograph.experimental.do_not_convert
  def trimmed(ex):
    """The example trimmed to the row lengths, not a flush."""
    return ({k: ex[k][:n] for k, n in zip(keys, packer.lengths)},
            tf.constant(False))

  # After the last example, buffer_size + 1 flush steps move every buffered
  # example into rows and close the last one (an infinite stream never gets
  # there).
  flush = tf.data.Dataset.from_tensors(
      ({k: tf.zeros([0], spec[k].dtype) for k in keys}, tf.constant(True))
  ).repeat(buffer_size + 1)
  stream = dataset.map(trimmed, num_parallel_calls=tf.data.AUTOTUNE
                       ).concatenate(flush)

  @tf.autograph.experimental.do_not_convert
  def closed(close, unused_row):
    return close

  @tf.autograph.experimental.do_not_convert
  def row_of(unused_close, row):
    return row

  step = tf.autograph.experimental.do_not_convert(packer.step)
  return stream.scan(packer.initial_state(), step).filter(closed).map(
      row_of)
