"""Independent numpy re-derivation of HyperPrompt's Eqs. (3)-(8).

Loops over tasks and layers, one (task, layer) pair at a time, from the
paper's definitions; reads parameters by path from a flat '/'-keyed dict.
"""

import numpy as np


def relu(x):
  return np.maximum(x, 0)


def local_hypernetwork(prompt, down, up, heads):
  """Eqs. (3)-(6): U(ReLU(D(P_tau))) for one task and layer -> [l, h, dh]."""
  out = relu(prompt @ down) @ up
  return out.reshape(prompt.shape[0], heads, -1)


def layer_aware_task_embedding(p, pre, task, layer):
  """I^m_tau = h_t([k_tau; z_m]), h_t = Dense, ReLU, Dense (no biases)."""
  x = np.concatenate([p[f'{pre}/task_embeddings'][task],
                      p[f'{pre}/layer_embeddings'][layer]])
  return relu(x @ p[f'{pre}/task_projector_hidden']) @ p[
      f'{pre}/task_projector_output']


def stack_prompts(p, stack, variant, num_layers, heads):
  """{(task, layer): (keys [l, h, dh], values [l, h, dh])} for one stack."""
  pre = f'{stack}/hyperprompt'
  prompts = p[f'{pre}/global_prompts']
  num_tasks, _, d = prompts.shape
  out = {}
  for task in range(num_tasks):
    for layer in range(num_layers):
      kv = []
      for kind in ('key', 'value'):
        if variant == 'share':
          down = p[f'{pre}/{kind}_down'][layer]
          up = p[f'{pre}/{kind}_up'][layer]
        elif variant == 'sep':
          down = p[f'{pre}/{kind}_down'][task, layer]
          up = p[f'{pre}/{kind}_up'][task, layer]
        else:  # global, Eqs. (7)-(8)
          i = layer_aware_task_embedding(p, pre, task, layer)
          down = (i @ p[f'{pre}/{kind}_down_generator']).reshape(d, -1)
          up = (i @ p[f'{pre}/{kind}_up_generator']).reshape(down.shape[1],
                                                             -1)
        kv.append(local_hypernetwork(prompts[task], down, up, heads))
      out[task, layer] = tuple(kv)
  return out
