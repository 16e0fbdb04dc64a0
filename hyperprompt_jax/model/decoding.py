"""Greedy decoding with the autoregressive cache, for the built-in runner.

The network keeps t5x's cache layout, so t5x runs decode with t5x's beam
search; without t5x the runner decodes greedily here, as t5x's evaluation
does by default (`num_decodes=1`). The `lax.while_loop` stops once every row
has produced EOS, so short answers cost a few steps.

As in t5x, the cache is made with the real `task_ids`
(`network.create_cache`); the decoder's hyper-prompts and HyperGrid gates
are computed then and read back at every step.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp

from hyperprompt_jax.model import network

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
