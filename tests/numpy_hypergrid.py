"""Independent numpy re-derivation of HyperGrid (Eqs. 2-7) and its
conditioning vector (Eq. 6), one example at a time."""

import numpy as np

import numpy_t5


def sigmoid(x):
  return 1 / (1 + np.exp(-x))


def block_repeat(grid, d_model, d_ff):
  """psi: value (i, j) of the `[rows, cols]` grid fills block (i, j)."""
  rows, cols = grid.shape
  out = np.zeros((d_model, d_ff))
  for m in range(d_model):
    for f in range(d_ff):
      out[m, f] = grid[m * rows // d_model, f * cols // d_ff]
  return out


def conditioning(p, cfg, stack, layer, context, valid, task, heads):
  """c for one example: MHSA([T; X])_0 with the layer's own attention, or the
  first token."""
  hg = cfg.hypergrid
  if hg.conditioning == 'first_token':
    return context[0]
  pre = f'{stack}/layers_{layer}'
  norm, attn = (('pre_attention_layer_norm', 'attention') if stack == 'encoder'
                else ('pre_cross_attention_layer_norm',
                      'encoder_decoder_attention'))
  scope = 'output_gating' if hg.variant == 'output_gating' else 'hypergrid'
  t = numpy_t5.rms_norm(p[f'{stack}/{scope}/task_embeddings'][task],
                        p[f'{pre}/{norm}/scale'])
  keys = np.concatenate([t[None], context])
  visible = np.concatenate([[True], valid])[None]
  return numpy_t5.attention(p, f'{pre}/{attn}', t[None], keys, visible, None,
                            heads)[0]


def gates(p, cfg, stack, layer, c):
  """The layer's FFN gates from c (numpy_t5.mlp's `gates`)."""
  hg = cfg.hypergrid
  pre = f'{stack}/layers_{layer}'
  d, f = cfg.emb_dim, cfg.mlp_dim
  if hg.variant == 'output_gating':
    g = sigmoid(c @ p[f'{pre}/output_gating/gate_projection'])
    return {'out': np.repeat(g, f // g.shape[0])}
  hp = f'{pre}/hypergrid'
  if hg.variant == 'l':
    grid = sigmoid(c @ p[f'{hp}/local_rows'])[:, None]
  else:
    rows = (p[f'{hp}/global_rows'] if hg.variant == 'gl'
            else c @ p[f'{hp}/local_rows'])
    cols = (p[f'{hp}/global_cols'] if hg.variant == 'lg'
            else c @ p[f'{hp}/local_cols'])
    grid = sigmoid(np.outer(rows, cols))
  if hg.scalar:
    grid = np.full((1, 1), grid.mean())
  full = block_repeat(grid, d, f)
  targets = {'wo': ['wo'], 'wi': ['wi'], 'both': ['wi', 'wo']}[hg.target]
  return {t: full for t in targets}


def gate_fn(p, cfg, task):
  """numpy_t5's `gate_fn` for one example of task `task`."""

  def fn(stack, layer, context, valid):
    if cfg.hypergrid.placement not in ('both', stack):
      return None
    c = conditioning(p, cfg, stack, layer, context, valid, task,
                     cfg.num_heads)
    return gates(p, cfg, stack, layer, c)

  return fn
