"""Best-fit packing of examples into training rows, as a tf.data transform.

seqio's packer (`seqio.utils.trim_and_pack_dataset`) fills one row at a
time in stream order and closes it at the first example that does not fit.
At GLUE + SuperGLUE lengths (512 / 32) a ~400-piece MultiRC or ReCoRD
example then ends a row that is often half full, and rows come out ~70 %
filled. `best_fit_pack` keeps a buffer of the next `buffer_size` examples
and fills the open row from it: each step moves the largest buffered
example that still fits in every feature (size: the sum over features of
its length / the feature's row length; ties: the lowest buffer slot, an
example taking the first free one), and the row closes only when none
fits; a new row starts with the largest buffered example. With 16 buffered
examples rows are ~90 % filled at those lengths (docs/performance.md,
Packing).

The output is seqio's: every feature `k` of `feature_lengths`, trimmed to
its length and packed, with `k_segment_ids` (1, 2, ... per example, 0 on
padding) and `k_positions` (0, 1, ... within each example), int32
`[length]`, the examples in the order they were moved in. Examples wait
in the buffer until they fit, so rows take them out of stream order (as a
shuffle buffer does); every example is packed once.

It is a `tf.data.Dataset.scan` over the examples, so the packer is
deterministic (the same stream gives the same rows) and its buffer and open
row are part of the iterator's state: `tf.train.Checkpoint` saves and
restores them with the iterator (the built-in runner's and t5x's dataset
checkpoints), so a resumed run gets exactly the rows it would have got.

seqio offers no packer to plug in, and no tf.data transform packs
best-fit; this module is the one piece of packing the project writes.
"""

from typing import Mapping

import tensorflow as tf

# Examples buffered for the best fit: 16 fills GLUE + SuperGLUE rows to ~90 %
# (more buys < 0.5 %; docs/performance.md, Packing).
BUFFER_SIZE = 16
# The packer as run records name it (a run resumes only with the packer
# whose state its iterator checkpoint holds).
NAME = f'best_fit(buffer_size={BUFFER_SIZE})'


def best_fit_pack(dataset: tf.data.Dataset, feature_lengths: Mapping[str, int],
                  buffer_size: int = BUFFER_SIZE) -> tf.data.Dataset:
  """Packs `dataset`'s examples into rows of `feature_lengths`.

  Args:
    dataset: examples with (at least) the features of `feature_lengths`,
      each of rank 1 (`[None]`); other features are dropped, as seqio's
      packer drops them.
    feature_lengths: feature -> its row length; longer examples are trimmed.
    buffer_size: examples the packer chooses from (>= 1; 1 packs in stream
      order, like seqio's).

  Returns:
    Packed rows: `k`, `k_segment_ids`, `k_positions` (int32 for the ids and
    positions, `k`'s dtype for `k`; each `[feature_lengths[k]]`). A finite
    `dataset` ends with its last, partly filled rows.
  """
  if (isinstance(buffer_size, bool) or not isinstance(buffer_size, int)
      or buffer_size < 1):
    raise ValueError(f'buffer_size must be an int >= 1, got {buffer_size!r}.')
  spec = dataset.element_spec
  keys = sorted(feature_lengths)
  for k in keys:
    if k not in spec:
      raise ValueError(f'Feature {k!r} is not in the dataset (it has '
                       f'{sorted(spec)}).')
    if not spec[k].shape.is_compatible_with([None]):
      raise ValueError(f'Packed features must be one-dimensional; {k!r} has '
                       f'shape {spec[k].shape}.')
    if feature_lengths[k] < 1:
      raise ValueError(f'Feature {k!r} has row length {feature_lengths[k]}.')
  lengths = [int(feature_lengths[k]) for k in keys]
  capacity = tf.constant(lengths, tf.int32)
  b = buffer_size

  # The functions below are TF ops and static Python: AutoGraph has nothing
  # to convert (and re-reads their source from disk to try).
  @tf.autograph.experimental.do_not_convert
  def trimmed(ex):
    return {k: ex[k][:n] for k, n in zip(keys, lengths)}, tf.constant(False)

  # After the last example, buffer_size + 1 flush steps move every buffered
  # example into rows and close the last one (an infinite stream never gets
  # there).
  flush = tf.data.Dataset.from_tensors(
      ({k: tf.zeros([0], spec[k].dtype) for k in keys}, tf.constant(True))
  ).repeat(b + 1)
  stream = dataset.map(trimmed, num_parallel_calls=tf.data.AUTOTUNE
                       ).concatenate(flush)

  initial = {
      'buffer': {k: tf.zeros([b, n], spec[k].dtype)
                 for k, n in zip(keys, lengths)},
      'buffer_lengths': tf.zeros([b, len(keys)], tf.int32),
      'buffered': tf.zeros([b], tf.bool),
      'row': {k: tf.zeros([n], spec[k].dtype) for k, n in zip(keys, lengths)},
      'segment_ids': {k: tf.zeros([n], tf.int32)
                      for k, n in zip(keys, lengths)},
      'positions': {k: tf.zeros([n], tf.int32) for k, n in zip(keys, lengths)},
      'used': tf.zeros([len(keys)], tf.int32),
      'examples': tf.constant(0, tf.int32),
  }

  @tf.autograph.experimental.do_not_convert
  def step(state, element):
    example, is_flush = element
    buffer, buffer_lengths = state['buffer'], state['buffer_lengths']
    buffered = state['buffered']
    # 1. The example goes into the first free slot (one is free: the buffer
    #    never holds more than buffer_size - 1 between steps).
    insert = tf.logical_not(is_flush)
    slot = tf.argmin(tf.cast(buffered, tf.int32), output_type=tf.int32)
    example_lengths = tf.stack([tf.shape(example[k])[0] for k in keys])
    into_slot = tf.logical_and(insert, tf.range(b) == slot)
    buffer = {k: tf.where(into_slot[:, None],
                          tf.pad(example[k], [[0, n - tf.shape(example[k])[0]]]
                                 )[None], buffer[k])
              for k, n in zip(keys, lengths)}
    buffer_lengths = tf.where(into_slot[:, None], example_lengths[None],
                              buffer_lengths)
    buffered = tf.logical_or(buffered, into_slot)
    count = tf.reduce_sum(tf.cast(buffered, tf.int32))

    # 2. Once the buffer is full (or flushing), one example moves into the
    #    row: the largest that fits, else the row closes and the largest
    #    starts the next.
    move = tf.logical_or(tf.equal(count, b),
                         tf.logical_and(is_flush, count > 0))
    used = state['used']
    fits = tf.logical_and(
        buffered, tf.reduce_all(used[None] + buffer_lengths <= capacity,
                                axis=1))
    size = tf.reduce_sum(tf.cast(buffer_lengths, tf.float32)
                         / tf.cast(capacity, tf.float32), axis=1)
    row_open = state['examples'] > 0
    close = tf.logical_and(row_open, tf.logical_or(
        tf.logical_and(move, tf.logical_not(tf.reduce_any(fits))),
        tf.logical_and(is_flush, tf.equal(count, 0))))
    emitted = {**state['row'],
               **{f'{k}_segment_ids': v
                  for k, v in state['segment_ids'].items()},
               **{f'{k}_positions': v for k, v in state['positions'].items()}}
    keep = tf.logical_not(close)
    row = {k: tf.where(keep, v, tf.zeros_like(v))
           for k, v in state['row'].items()}
    segment_ids = {k: tf.where(keep, v, tf.zeros_like(v))
                   for k, v in state['segment_ids'].items()}
    positions = {k: tf.where(keep, v, tf.zeros_like(v))
                 for k, v in state['positions'].items()}
    used = tf.where(keep, used, tf.zeros_like(used))
    examples = tf.where(keep, state['examples'], 0)

    # A closed row is empty again, and every buffered example fits it.
    fits = tf.logical_or(fits, tf.logical_and(close, buffered))
    chosen = tf.argmax(tf.where(fits, size, -1.0), output_type=tf.int32)
    chosen_lengths = buffer_lengths[chosen] * tf.cast(move, tf.int32)
    for i, (k, n) in enumerate(zip(keys, lengths)):
      index = tf.range(n)
      start, end = used[i], used[i] + chosen_lengths[i]
      span = tf.logical_and(index >= start, index < end)
      # Buffered examples are zero-padded, so shifting one by `start` along
      # the row puts it at [start, end) (end <= n: it fits).
      row[k] = tf.where(span, tf.roll(buffer[k][chosen], start, axis=0),
                        row[k])
      segment_ids[k] = tf.where(span, examples + 1, segment_ids[k])
      positions[k] = tf.where(span, index - start, positions[k])
    new_state = {
        'buffer': buffer,
        'buffer_lengths': buffer_lengths,
        'buffered': tf.logical_and(
            buffered, tf.logical_not(
                tf.logical_and(move, tf.range(b) == chosen))),
        'row': row, 'segment_ids': segment_ids, 'positions': positions,
        'used': used + chosen_lengths,
        'examples': examples + tf.cast(move, tf.int32),
    }
    return new_state, (close, emitted)

  @tf.autograph.experimental.do_not_convert
  def closed(close, unused_row):
    return close

  @tf.autograph.experimental.do_not_convert
  def row_of(unused_close, row):
    return row

  return stream.scan(initial, step).filter(closed).map(row_of)
