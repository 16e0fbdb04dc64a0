"""An independent numpy T5 forward pass, the reference the network is tested on.

Written from the T5 / T5.1.1 definitions (RMS layer norm, unscaled attention
with bucketed relative-position biases, gated-GELU or ReLU FFN, pre-norm
residual blocks), one example at a time in float64, with plain loops where
the network vectorises. It reads parameters by their t5x paths from a flat
'/'-keyed dict.
"""

import math

import numpy as np


def rms_norm(x, scale, eps=1e-6):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def bucket(relative_position, bidirectional, num_buckets=32, max_distance=128):
  """T5's bucket of `key_position - query_position`, one scalar at a time."""
  ret, n = 0, -relative_position
  if bidirectional:
    num_buckets //= 2
    if n < 0:
      ret += num_buckets
    n = abs(n)
  else:
    n = max(n, 0)
  max_exact = num_buckets // 2
  if n < max_exact:
    return ret + n
  large = max_exact + int(
      math.log(n / max_exact) / math.log(max_distance / max_exact)
      * (num_buckets - max_exact)
  )
  return ret + min(large, num_buckets - 1)


def relpos_bias(table, qlen, klen, bidirectional):
  """`[heads, buckets]` table -> `[heads, qlen, klen]` bias."""
  out = np.zeros((table.shape[0], qlen, klen))
  for i in range(qlen):
    for j in range(klen):
      out[:, i, j] = table[:, bucket(j - i, bidirectional)]
  return out


def attention(p, prefix, xq, xkv, visible, bias, heads, prompt_kv=None,
              record=None):
  """One example. `visible [q, k]` bool; `bias [heads, q, k]` or None.

  `prompt_kv`: optional `(keys, values)` `[l, heads, head_dim]` prepended to
  the keys / values, always visible, zero position bias. `record`: a list
  the probabilities `[heads, q, l + k]` are appended to.
  """
  wq, wk, wv, wo = (p[f'{prefix}/{n}/kernel'] for n in ('query', 'key',
                                                        'value', 'out'))
  dh = wq.shape[1] // heads
  q = (xq @ wq).reshape(len(xq), heads, dh)
  k = (xkv @ wk).reshape(len(xkv), heads, dh)
  v = (xkv @ wv).reshape(len(xkv), heads, dh)
  logits = np.einsum('qhd,khd->hqk', q, k)
  if bias is not None:
    logits = logits + bias
  logits = np.where(visible[None], logits, -1e10)
  if prompt_kv is not None:
    pk, pv = prompt_kv
    logits = np.concatenate([np.einsum('qhd,lhd->hql', q, pk), logits], -1)
    v = np.concatenate([pv, v], 0)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w = w / w.sum(-1, keepdims=True)
  if record is not None:
    record.append(w)
  out = np.einsum('hqk,khd->qhd', w, v).reshape(len(xq), heads * dh)
  return out @ wo


def mlp(p, prefix, x, gated, gates=None):
  """T5 FFN. `gates`: HyperGrid's `{'wi': G, 'wo': G}` full gates in the
  paper's `[d_model, d_ff]` orientation (kernel <- (1 + G) * kernel), or
  Output Gating's `{'out': g [d_ff]}`."""
  gates = gates or {}

  def kernel(name, target, transpose):
    w = p[f'{prefix}/{name}/kernel']
    g = gates.get(target)
    return w if g is None else w * (1 + (g.T if transpose else g))

  if gated:
    h = gelu_tanh(x @ kernel('wi_0', 'wi', False)) * (
        x @ kernel('wi_1', 'wi', False))
  else:
    h = np.maximum(x @ kernel('wi', 'wi', False), 0)
  if gates.get('out') is not None:
    h = h * gates['out']
  return h @ kernel('wo', 'wo', True)


def _no_adapter(stack, layer, kind, h):
  del stack, layer, kind
  return h


def encode(p, tokens, heads, num_layers, gated=True, prompts=None,
           gate_fn=None, adapter_fn=_no_adapter, soft_prompt=None,
           record=None):
  """One example `[length]` -> `[length, d]`. `prompts[i]`: layer i's (k, v).

  `gate_fn('encoder', i, normed_layer_input, valid)` -> layer i's FFN gates.
  `adapter_fn('encoder', i, kind, h)` -> the sublayer output h adapted
  (kind 'attention' or 'mlp'), before the residual. `soft_prompt [n, d]`:
  embeddings prepended to the tokens' (always valid): the output is then
  `[n + length, d]`. `record`: a list each layer's attention probabilities
  are appended to.
  """
  tokens = np.asarray(tokens)
  x = p['token_embedder/embedding'][tokens].astype(np.float64)
  valid = tokens > 0
  if soft_prompt is not None:
    x = np.concatenate([soft_prompt, x], 0)
    valid = np.concatenate([np.ones(len(soft_prompt), bool), valid])
  visible = valid[:, None] & valid[None, :]
  bias = relpos_bias(p['encoder/relpos_bias/rel_embedding'], len(x),
                     len(x), True)
  for i in range(num_layers):
    pre = f'encoder/layers_{i}'
    h = rms_norm(x, p[f'{pre}/pre_attention_layer_norm/scale'])
    gates = gate_fn('encoder', i, h, valid) if gate_fn else None
    x = x + adapter_fn('encoder', i, 'attention', attention(
        p, f'{pre}/attention', h, h, visible, bias, heads,
        None if prompts is None else prompts[i], record))
    h = rms_norm(x, p[f'{pre}/pre_mlp_layer_norm/scale'])
    x = x + adapter_fn('encoder', i, 'mlp', mlp(p, f'{pre}/mlp', h, gated,
                                                gates))
  return rms_norm(x, p['encoder/encoder_norm/scale'])


def decode(p, encoded, input_tokens, decoder_input_tokens, target_tokens,
           heads, num_layers, gated=True, tied=False, prompts=None,
           cross_prompts=False, gate_fn=None, adapter_fn=_no_adapter,
           soft_prompt_length=0):
  """One example -> logits `[target_length, vocab]` (teacher forcing).

  `cross_prompts`: also prepend layer i's prompts in cross-attention.
  `gate_fn('decoder', i, encoded, input_valid)` -> layer i's FFN gates.
  `adapter_fn('decoder', i, kind, h)`: as `encode`'s (kinds 'attention' for
  the self-attention, 'mlp'; none after the cross-attention).
  `soft_prompt_length`: `encoded` starts with that many (valid) prompt
  positions.
  """
  target_tokens = np.asarray(target_tokens)
  t = len(target_tokens)
  y = p['token_embedder/embedding'][np.asarray(decoder_input_tokens)]
  y = y.astype(np.float64)
  tvalid = target_tokens > 0
  causal = np.tril(np.ones((t, t), bool))
  self_visible = causal & tvalid[:, None] & tvalid[None, :]
  input_valid = np.concatenate([np.ones(soft_prompt_length, bool),
                                np.asarray(input_tokens) > 0])
  cross_visible = tvalid[:, None] & input_valid[None, :]
  bias = relpos_bias(p['decoder/relpos_bias/rel_embedding'], t, t, False)
  for i in range(num_layers):
    pre = f'decoder/layers_{i}'
    h = rms_norm(y, p[f'{pre}/pre_self_attention_layer_norm/scale'])
    y = y + adapter_fn('decoder', i, 'attention', attention(
        p, f'{pre}/self_attention', h, h, self_visible, bias, heads,
        None if prompts is None else prompts[i]))
    h = rms_norm(y, p[f'{pre}/pre_cross_attention_layer_norm/scale'])
    y = y + attention(p, f'{pre}/encoder_decoder_attention', h, encoded,
                      cross_visible, None, heads,
                      prompts[i] if cross_prompts else None)
    h = rms_norm(y, p[f'{pre}/pre_mlp_layer_norm/scale'])
    gates = (gate_fn('decoder', i, encoded, input_valid)
             if gate_fn else None)
    y = y + adapter_fn('decoder', i, 'mlp', mlp(p, f'{pre}/mlp', h, gated,
                                                gates))
  y = rms_norm(y, p['decoder/decoder_norm/scale'])
  if tied:
    return y @ p['token_embedder/embedding'].T / math.sqrt(y.shape[-1])
  return y @ p['decoder/logits_dense/kernel']
