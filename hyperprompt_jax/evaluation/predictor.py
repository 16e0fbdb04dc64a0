"""Batched, sharded greedy prediction for seqio's `Evaluator` and inference.

`decoding.greedy_decode` on the device mesh: one compiled program per input
length, every batch checked on the host first.
"""

from typing import Any, Mapping

from flax.linen import partitioning as nn_partitioning
import jax
import numpy as np

from hyperprompt_jax.common import batches
from hyperprompt_jax.common import multihost
from hyperprompt_jax.common import partitioning
from hyperprompt_jax.model import decoding
from hyperprompt_jax.model import network

PyTree = Any


class Predictor:
  """Batched, sharded greedy prediction for seqio's `Evaluator`.

  Batches have a fixed size (the last one padded), so every task of a
  mixture reuses one compiled program per input length. Every process reads
  the whole (deterministic) evaluation set in order, each device takes its
  rows, and the output is replicated, so each process scores what a single
  process would.

  Args:
    model: the network.
    params_axes: the logical axes of its parameters (from `model.init`);
      `set_params` places each checkpoint's parameters on the mesh by them.
    mesh: the ('data', 'model') device mesh.
    batch_size: examples per decode call; divisible by the data shards.
    max_decode_length: the most target tokens to produce.
  """

  def __init__(self, model: network.Transformer, params_axes: PyTree,
               mesh: jax.sharding.Mesh, batch_size: int,
               max_decode_length: int):
    if batch_size % mesh.shape['data']:
      data = mesh.shape['data']
      raise ValueError(
          f'The eval batch size {batch_size} (EVAL_BATCH_SIZE) does not '
          f"divide over the mesh's {data} data shards: set "
          f'--gin.EVAL_BATCH_SIZE to a multiple of {data} (e.g. '
          f'{-(-batch_size // data) * data}), or shard the model over more '
          'devices (MESH_MODEL) to have fewer data shards.')
    self.model = model
    # `predict` checks every batch on the host before it is decoded.
    self._decode_model = network.checked_on_host(model)
    self.mesh = mesh
    self.batch_size = batch_size
    self.max_decode_length = max_decode_length
    self.rules = partitioning.logical_axis_rules()
    self.param_shardings = partitioning.parameter_shardings(
        params_axes, mesh, self.rules)
    self.batch_sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec('data'))
    self.params = None
    self._decode = jax.jit(
        self._decode_fn,
        in_shardings=(self.param_shardings, self.batch_sharding,
                      self.batch_sharding),
        out_shardings=jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec()))

  def _decode_fn(self, params, tokens, task_ids):
    """Greedy decoding under the predictor's axis rules."""
    with nn_partitioning.axis_rules(self.rules):
      return decoding.greedy_decode(self._decode_model, params, tokens,
                                    task_ids, self.max_decode_length)

  def decode_function(self):
    """The jitted decode with the predictor's shardings.

    Returns:
      `(params, tokens [batch, length], task_ids [batch])` ->
      `[batch, max_decode_length]`, for batches checked on the host.
    """
    return self._decode

  def set_params(self, params: PyTree) -> None:
    """Places `params` on the mesh (replacing the previous checkpoint's)."""
    self.params = jax.device_put(params, self.param_shardings)

  def predict(self, batch: Mapping[str, np.ndarray]) -> np.ndarray:
    """Decodes a batch of n <= batch_size examples.

    Args:
      batch: `encoder_input_tokens [n, length]` and `task_ids [n]`.

    Returns:
      `[n, max_decode_length]` tokens.
    """
    if self.params is None:
      raise ValueError('Predictor.set_params() was not called.')
    tokens = np.asarray(batch['encoder_input_tokens'], np.int32)
    n = len(tokens)
    ids = np.asarray(batch.get('task_ids', np.zeros(n)), np.int32)
    if n > self.batch_size:
      raise ValueError(f'{n} examples exceed the batch size {self.batch_size}.')
    # Inside jit an out-of-range task or token id would clamp silently.
    batches.validate_batch(
        {'encoder_input_tokens': tokens, 'task_ids': ids},
        self.model.config.num_tasks, self.model.config.vocab_size,
        required=('encoder_input_tokens', 'task_ids'))
    pad = self.batch_size - n
    if pad:
      tokens = np.pad(tokens, ((0, pad), (0, 0)))
      ids = np.pad(ids, (0, pad))
    # Every process holds the same batch: each device takes its rows.
    tokens, ids = jax.device_put((tokens, ids), self.batch_sharding)
    with jax.set_mesh(self.mesh):
      out = self._decode(self.params, tokens, ids)
    return multihost.host_value(out)[:n]

  def predict_fn(self, dataset) -> list[tuple[int, list[int]]]:
    """seqio's `PredictFnCallable`: enumerated features -> `[(i, tokens)]`."""
    results = []
    for index, features in dataset.batch(self.batch_size).as_numpy_iterator():
      tokens = self.predict(features)
      results.extend((int(i), t.tolist()) for i, t in zip(index, tokens))
    return results


def make_predictor(model: network.Transformer,
                   task_feature_lengths: Mapping[str, int],
                   mesh: jax.sharding.Mesh, batch_size: int
                   ) -> tuple[Predictor, PyTree]:
  """A `Predictor` of the targets' length, and the abstract parameters.

  Args:
    model: the network.
    task_feature_lengths: `{'inputs': length, 'targets': length}`.
    mesh: the ('data', 'model') device mesh.
    batch_size: examples per decode call.

  Returns:
    `(predictor, abstract params)`, the shapes a checkpoint must match.
  """
  abstract = network.abstract_variables(model, task_feature_lengths['inputs'],
                                        task_feature_lengths['targets'])
  predictor = Predictor(model, abstract['params_axes'], mesh, batch_size,
                        task_feature_lengths['targets'])
  return predictor, abstract['params']
