"""Independent numpy re-derivations of the papers' baselines: Houlsby
adapters, HyperFormer++'s generated adapters, and Prompt-Tuning's soft
prompts. One (task, layer, kind) at a time, from the definitions (Houlsby et
al. 2019; Karimi Mahabadi et al. 2021 and their `AdapterLayersOneHyperNet
Controller`); parameters read by path from a flat '/'-keyed dict.
"""

import numpy as np

KINDS = ('attention', 'mlp')


def relu(x):
  return np.maximum(x, 0)


def layer_norm(x, scale, bias, eps=1e-6):
  """Centred layer norm over the last axis."""
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * scale + bias


def adapter(h, down, down_bias, up, up_bias, norm=None):
  """h [length, d] -> h + norm(up(relu(down h)))."""
  out = relu(h @ down + down_bias) @ up + up_bias
  if norm is not None:
    out = layer_norm(out, *norm)
  return h + out


def vanilla_adapter_fn(p, task, stacks):
  """`numpy_t5` adapter_fn of one example's task (`stacks`: adapted ones)."""

  def fn(stack, layer, kind, h):
    if stack not in stacks:
      return h
    pre = f'{stack}/adapter/{kind}'
    get = lambda name: p[f'{pre}_{name}'][layer, task]
    return adapter(h, get('down'), get('down_bias'), get('up'),
                   get('up_bias'))

  return fn


def hyperformer_embedding(p, stack, task, layer, kind):
  """I = LN(h_t([e_task; z_layer; y_kind])) -> [t]."""
  pre = f'{stack}/hyperformer'
  x = np.concatenate([p[f'{pre}/task_embeddings'][task],
                      p[f'{pre}/layer_embeddings'][layer],
                      p[f'{pre}/kind_embeddings'][KINDS.index(kind)]])
  hidden = relu(x @ p[f'{pre}/task_projector_hidden']
                + p[f'{pre}/task_projector_hidden_bias'])
  out = (hidden @ p[f'{pre}/task_projector_output']
         + p[f'{pre}/task_projector_output_bias'])
  return layer_norm(out, p[f'{pre}/task_projector_norm_scale'],
                    p[f'{pre}/task_projector_norm_bias'])


def hyperformer_adapter_fn(p, task, stacks, emb_dim, bottleneck):
  """`numpy_t5` adapter_fn with HyperFormer++'s generated adapters."""

  def fn(stack, layer, kind, h):
    if stack not in stacks:
      return h
    pre = f'{stack}/hyperformer'
    i = hyperformer_embedding(p, stack, task, layer, kind)
    gen = lambda name: (i @ p[f'{pre}/{name}_generator']
                        + p[f'{pre}/{name}_generator_bias'])
    return adapter(
        h, gen('down').reshape(emb_dim, bottleneck), gen('down_bias'),
        gen('up').reshape(bottleneck, emb_dim), gen('up_bias'),
        norm=(gen('norm_scale'), gen('norm_bias')))

  return fn
