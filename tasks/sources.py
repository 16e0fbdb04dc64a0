"""Data sources: prepared TFDS datasets (read-only) and the offline fixtures.

`PreparedTfdsDataSource` never downloads (`tfds.load` without data retries
the network for long), so a missing dataset fails at once, saying how to
prepare it. Its data directory is resolved when the data is first read, so
gin (parsed after tasks are registered) can set it:

  1. seqio's override (t5x's `--tfds_data_dir` flag sets it);
  2. gin: `TFDS_DATA_DIR` (`hyperprompt_jax.tasks.sources.tfds_data_dir`);
  3. TFDS's default (`$TFDS_DATA_DIR` or `~/tensorflow_datasets`).

`FixtureDataSource` reads the JSON-lines files shipped in `tasks/fixtures/`,
in the TFDS feature schema of the dataset they stand in for, so the same
preprocessors, postprocessors and metrics run on them.
"""

import json
import os
from typing import Any, Mapping, Optional

import gin
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

FIXTURES_DIR = os.path.join(os.path.dirname(__file__), 'fixtures')


@gin.configurable(module='hyperprompt_jax.tasks.sources')
def tfds_data_dir(data_dir: Optional[str] = None) -> Optional[str]:
  """The gin-set TFDS data directory (None: TFDS's default)."""
  return data_dir


def resolve_tfds_data_dir() -> Optional[str]:
  """seqio's override, else gin's TFDS data directory (None: TFDS's default)."""
  return seqio.utils._get_data_dir_override(None) or tfds_data_dir()  # pylint: disable=protected-access


def check_prepared(tfds_name: str, data_dir: Optional[str]) -> None:
  """Raises FileNotFoundError unless `tfds_name` is prepared in `data_dir`.

  Builds the TFDS builder only, which does not touch the network.
  """
  builder = tfds.builder(tfds_name, data_dir=data_dir)
  if builder.is_prepared():
    return
  raise FileNotFoundError(
      f'TFDS dataset {tfds_name} is not prepared in {builder.data_dir}. '
      'Downloads are off in this project. Prepare the run\'s datasets once '
      'on a machine with network access: `python -m '
      'hyperprompt_jax.prepare_data --gin_file=<the run\'s gin file> '
      '--data_dir=DIR --prepare` (TFDS\'s own builders), then point runs '
      'at that directory with --gin.TFDS_DATA_DIR="\'DIR\'" (t5x: '
      '--tfds_data_dir=DIR). For an offline run use the fixture_* tasks.')


class PreparedTfdsDataSource(seqio.TfdsDataSource):
  """A read-only `seqio.TfdsDataSource` that fails fast on missing data.

  Args:
    tfds_name: 'name/config:version', e.g. 'glue/cola:2.0.0'.
    splits: canonical split -> TFDS split, e.g. {'validation':
      'validation_matched'}; explicit so nothing is read before it is needed.
  """

  def __init__(self, tfds_name: str, splits: Mapping[str, str]):
    super().__init__(tfds_name=tfds_name, splits=dict(splits), read_only=True)
    self._tfds_name = tfds_name
    self._split_map = dict(splits)
    self._loaders: dict[Optional[str], seqio.utils.LazyTfdsLoader] = {}

  @property
  def tfds_dataset(self) -> seqio.utils.LazyTfdsLoader:
    """The loader of the resolved data directory, checked prepared."""
    data_dir = resolve_tfds_data_dir()
    if data_dir not in self._loaders:
      check_prepared(self._tfds_name, data_dir)
      self._loaders[data_dir] = seqio.utils.LazyTfdsLoader(
          self._tfds_name, data_dir=data_dir, split_map=self._split_map,
          read_only=True)
    return self._loaders[data_dir]


def _columns(examples: list, schema: Mapping[str, Any]) -> dict:
  """Examples -> a dict of column tensors for `from_tensor_slices`.

  A schema entry is a dtype name, a nested dict (a TFDS FeaturesDict) or
  `[dtype]`, a variable-length sequence (a ragged column whose slices are
  dense 1-D tensors).
  """
  out = {}
  for key, kind in schema.items():
    values = [ex[key] for ex in examples]
    if isinstance(kind, dict):
      out[key] = _columns(values, kind)
    elif isinstance(kind, list):
      out[key] = tf.ragged.constant(values, dtype=tf.as_dtype(kind[0]),
                                    ragged_rank=1)
    else:
      out[key] = tf.constant(values, dtype=tf.as_dtype(kind))
  return out


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """The JSON lines of `path`."""
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


class FixtureDataSource(seqio.DataSource):
  """Examples from `tasks/fixtures/<dataset>/<split>.jsonl`.

  Args:
    dataset: the fixture folder, e.g. 'glue_cola'.
    schema: feature -> dtype name (the TFDS feature schema), e.g.
      {'sentence': 'string', 'label': 'int64', 'idx': 'int32'}; nested dicts
      and `[dtype]` sequences as in TFDS.
    splits: canonical split -> file stem, e.g. {'validation':
      'validation_matched'}.
  """

  def __init__(self, dataset: str, schema: Mapping[str, Any],
               splits: Mapping[str, str]):
    self._dir = os.path.join(FIXTURES_DIR, dataset)
    self._schema = dict(schema)
    self._files = {s: os.path.join(self._dir, f'{stem}.jsonl')
                   for s, stem in splits.items()}
    super().__init__(splits=tuple(self._files))

  @property
  def supports_arbitrary_sharding(self) -> bool:
    """True: examples are read in memory, so any shard count works."""
    return True

  def list_shards(self, split: str) -> list[str]:
    """The split's one file."""
    return [self._files[split]]

  def _examples(self, split: str) -> list[dict[str, Any]]:
    """The split's examples."""
    path = self._files[split]
    if not os.path.exists(path):
      raise FileNotFoundError(
          f'fixture file {path} is missing; regenerate the fixtures with '
          '`python -m hyperprompt_jax.tasks.fixture_data`')
    return read_jsonl(path)

  def num_input_examples(self, split: str) -> int:
    """The split's number of examples."""
    return len(self._examples(split))

  def get_dataset(self, split: str = 'train', shuffle: bool = True,
                  seed: Optional[int] = None,
                  shard_info: Optional[seqio.ShardInfo] = None, *,
                  sequence_length=None, use_cached=False, num_epochs=1
                  ) -> tf.data.Dataset:
    """The split's examples in file order; the Task shuffles them.

    Built from tensors (not a Python generator) so that the runner can
    checkpoint the input pipeline's position.
    """
    del shuffle, seed, sequence_length, use_cached, num_epochs
    ds = tf.data.Dataset.from_tensor_slices(
        _columns(self._examples(split), self._schema))
    if shard_info:
      ds = ds.shard(shard_info.num_shards, shard_info.index)
    return ds
