"""Greedy decoding with the autoregressive cache, and the batched predictor.

The network keeps t5x's cache layout, so a t5x run decodes it with t5x's
beam search (`t5x.decoding`); the built-in runner, which has no t5x, decodes
greedily here, as t5x's evaluation does by default for classification-style
tasks (`num_decodes=1`). The loop is a `lax.while_loop` that stops once every
row has produced EOS, so short answers cost a few steps, not
`max_decode_length`.

Task conditioning follows t5x: the cache is created with the real `task_ids`
(`network.create_cache`, shared with the t5x model), which is when the
decoder's hyper-prompts and HyperGrid gates are computed and stored; decode
steps read them back from the cache.
"""

from typing import Any, Mapping, Optional

from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import numpy as np

from hyperprompt_jax.model import network
from hyperprompt_jax.runner import batches
from hyperprompt_jax.runner import multihost
from hyperprompt_jax.runner import partitioning

PyTree = Any
EOS_ID = 1  # T5's (and seqio's ByteVocabulary's) end-of-sequence id.


def greedy_decode(model: network.Transformer, params: PyTree,
                  encoder_input_tokens: jax.Array,
                  task_ids: Optional[jax.Array], max_decode_length: int,
                  eos_id: int = EOS_ID) -> jax.Array:
  """Greedy decoding of a batch.

  Args:
    model: the network.
    params: its parameters.
    encoder_input_tokens: int32 `[batch, input_length]`, 0 = padding.
    task_ids: int32 `[batch]` (None for a model without task conditioning).
    max_decode_length: the most tokens to produce.
    eos_id: the end-of-sequence id; it ends a row's decoding.

  Returns:
    int32 `[batch, max_decode_length]`: the produced tokens, EOS included,
    zeros after it.
  """
  batch = encoder_input_tokens.shape[0]
  encoded = model.apply({'params': params}, encoder_input_tokens,
                        enable_dropout=False, task_ids=task_ids,
                        method=model.encode)
  cache = network.create_cache(model, params, encoded, encoder_input_tokens,
                               max_decode_length, task_ids)

  def step(carry):
    i, cache, token, out, done = carry
    logits, new = model.apply(
        {'params': params, 'cache': cache}, encoded, encoder_input_tokens,
        token, token, enable_dropout=False, decode=True,
        max_decode_length=max_decode_length, task_ids=task_ids,
        mutable=['cache'], method=model.decode)
    next_token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    next_token = jnp.where(done, 0, next_token)
    out = jax.lax.dynamic_update_slice(out, next_token[:, None], (0, i))
    done = done | (next_token == eos_id)
    return i + 1, new['cache'], next_token[:, None], out, done

  def not_finished(carry):
    i, _, _, _, done = carry
    return (i < max_decode_length) & ~jnp.all(done)

  start = jnp.zeros((batch, 1), jnp.int32)  # T5's decoder start token is 0.
  out = jnp.zeros((batch, max_decode_length), jnp.int32)
  carry = (jnp.array(0), cache, start, out,
           jnp.zeros((batch,), bool))
  return jax.lax.while_loop(not_finished, step, carry)[3]


class Predictor:
  """Batched, sharded greedy prediction for seqio's `Evaluator`.

  Batches have a fixed size (the last one is padded), so every task of a
  mixture reuses one compiled program per input length.

  Several processes (one per host) run the same evaluation: each reads the
  whole evaluation set in the same order (seqio's evaluation datasets are
  deterministic), places the batch on the global mesh (each device takes
  its rows), and gets every prediction back (the output is replicated), so
  each process scores what a single process would.

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
      raise ValueError(f'The eval batch size {batch_size} does not divide '
                       f"over the mesh's {mesh.shape['data']} data shards.")
    self.model = model
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
    with nn_partitioning.axis_rules(self.rules):
      return greedy_decode(self.model, params, tokens, task_ids,
                           self.max_decode_length)

  def set_params(self, params: PyTree) -> None:
    """Places `params` on the mesh (replacing the previous checkpoint's)."""
    self.params = jax.device_put(params, self.param_shardings)

  def predict(self, batch: Mapping[str, np.ndarray]) -> np.ndarray:
    """`[n, max_decode_length]` tokens for a batch of n <= batch_size
    examples (`encoder_input_tokens`, `task_ids`)."""
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
    """seqio's `PredictFnCallable`: an enumerated dataset of model features
    -> `[(index, output token ids)]`."""
    results = []
    for index, features in dataset.batch(self.batch_size).as_numpy_iterator():
      tokens = self.predict(features)
      results.extend((int(i), t.tolist()) for i, t in zip(index, tokens))
    return results


def make_predictor(model: network.Transformer,
                   task_feature_lengths: Mapping[str, int],
                   mesh: jax.sharding.Mesh, batch_size: int
                   ) -> tuple[Predictor, PyTree]:
  """A `Predictor` decoding up to the targets' length, and the model's
  abstract parameters (the shapes a checkpoint must match)."""
  abstract = network.abstract_variables(model, task_feature_lengths['inputs'],
                                        task_feature_lengths['targets'])
  predictor = Predictor(model, abstract['params_axes'], mesh, batch_size,
                        task_feature_lengths['targets'])
  return predictor, abstract['params']
