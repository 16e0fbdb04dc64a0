"""HyperFormer++ (Karimi Mahabadi et al., ACL 2021): one hypernetwork per stack
generates every layer's per-task adapters.

The adapters sit where the Vanilla Adapter's do (`adapters.py`: after the
self-attention and the FFN sublayers of every block), with a generated post
layer norm:

    h -> h + LN_{gamma, beta}(W_up act(W_down h + b_down) + b_up).

Their weights come from a layer-aware task embedding, one per (task tau,
layer m, block kind k), as in the authors' `AdapterLayersOneHyperNetController`:

    I = LN(h_t([e_tau; z_m; y_k])),   h_t = Dense(3t' -> e), ReLU, Dense(e -> t)
    (W_down, b_down, W_up, b_up, gamma, beta) = linear generators of I

with task embeddings e [T, t'], layer-id embeddings z [M, t'], block-kind
embeddings y [2, t'], and each generator a Dense(t -> size) with bias. One
set of generators serves all tasks, layers and both kinds of a stack; the
encoder and the decoder have one each.

Defaults: the authors' t' = 512, e = 128, t = 64, and bottleneck b = d / 16
(their default reduction factor), which is the HyperPrompt paper's budget at
T5.1.1-base, T = 8: 1.04x parameters with adapters in both stacks, 1.02x in
the decoder only. Initialisation as the authors' code: embeddings N(0, 1),
every Dense N(0, 0.01^2) with zero bias, the projector's LN scale 1, bias 0.

Adapters for all T tasks are generated once per forward (`[M, T, ...]`) and
gathered by task id, so generation costs per task, not per example.
Parameters (under `<stack>/hyperformer/`), s = d*b:
    task_embeddings [T, t'], layer_embeddings [M, t'], kind_embeddings [2, t'],
    task_projector_{hidden [3t', e], output [e, t]} (+ _bias),
    task_projector_norm_{scale, bias} [t],
    {down, up}_generator [t, s], {down, up}_generator_bias [s],
    down_bias_generator [t, b], up_bias_generator [t, d],
    norm_{scale, bias}_generator [t, d] (each + _bias)
"""

from typing import Any

from flax import linen as nn
from flax import struct
import jax
import jax.numpy as jnp

from hyperprompt_jax.methods import adapters
from hyperprompt_jax.t5 import layers

Array = jax.Array
INIT_STDDEV = 1e-2  # the authors' linear_layer init

# The method's face (read by `methods.REGISTRY`): the T5Config field that
# holds its config, its parameter scopes and logical axis names, the gin
# variant files that select it, `check` and `is_active`.
CONFIG_FIELD = 'hyperformer'
SCOPES = ('hyperformer',)
AXIS_NAMES = ('tasks', 'hyper_layers', 'adapter_kinds', 'task_embed',
              'task_hidden')
VARIANT_FILES = ('variants/hyperformer_pp.gin',)
is_active = adapters.is_active


@struct.dataclass
class HyperFormerConfig:
  """gin: `hyperformer.HyperFormerConfig` (see gin/variants/hyperformer_pp.gin)."""

  placement: str = 'both'   # 'both' | 'encoder' | 'decoder'
  reduction: int = 16       # adapter bottleneck b = d / reduction
  task_embed_dim: int = 512  # t': task, layer and kind embeddings
  task_hidden_dim: int = 128  # e: hidden width of the task projector h_t
  projected_dim: int = 64   # t: the layer-aware task embedding I
  activation: str = 'relu'  # of the adapters (flax.linen name)
  packed_form: str = 'auto'  # 'auto' | 'task_blocks' | 'pallas' (adapters.py)


def check_hyperformer_config(cfg: HyperFormerConfig, emb_dim: int) -> None:
  """Raises ValueError on settings that cannot build HyperFormer++."""
  adapters.check_placement(cfg.placement, 'HyperFormerConfig')
  adapters.check_reduction(cfg.reduction, emb_dim, 'HYPERFORMER_REDUCTION')
  adapters.check_packed_form(cfg.packed_form, 'HyperFormerConfig')
  for name in ('task_embed_dim', 'task_hidden_dim', 'projected_dim'):
    if getattr(cfg, name) <= 0:
      raise ValueError(f'HyperFormerConfig.{name} must be positive, got '
                       f'{getattr(cfg, name)}.')
  layers.activation(cfg.activation)


def check(cfg: HyperFormerConfig, model_config: Any) -> None:
  check_hyperformer_config(cfg, model_config.emb_dim)


class HyperFormerGenerator(nn.Module):
  """The adapters of one stack, generated for all tasks and layers."""

  config: HyperFormerConfig
  num_tasks: int
  num_layers: int
  emb_dim: int
  dtype: Any = jnp.float32  # the activations' (T5Config.dtype)

  def _param(self, name, init, shape, axes):
    return layers.param_with_axes(name, init, shape, jnp.float32, axes=axes)

  def _dense(self, x, name, out_dim, axes, dtype=jnp.float32):
    """Dense with bias over the last axis of `x`, the authors' init,
    computed in `dtype` (operands cast to it, as t5x's DenseGeneral)."""
    kernel = self._param(name, nn.initializers.normal(INIT_STDDEV),
                         (x.shape[-1], out_dim), axes)
    bias = self._param(f'{name}_bias', nn.initializers.zeros, (out_dim,),
                       axes[1:])
    return (jnp.asarray(x, dtype) @ jnp.asarray(kernel, dtype)
            + jnp.asarray(bias, dtype))

  @nn.compact
  def __call__(self) -> dict[str, adapters.AdapterWeights]:
    """Returns `{kind: AdapterWeights}` with `[M, T, ...]` arrays."""
    cfg = self.config
    t_, m, d = self.num_tasks, self.num_layers, self.emb_dim
    b = d // cfg.reduction
    te = cfg.task_embed_dim
    normal = nn.initializers.normal(1.0)
    task_emb = self._param('task_embeddings', normal, (t_, te),
                           ('tasks', 'task_embed'))
    layer_emb = self._param('layer_embeddings', normal, (m, te),
                            ('hyper_layers', 'task_embed'))
    kind_emb = self._param('kind_embeddings', normal,
                           (len(adapters.KINDS), te),
                           ('adapter_kinds', 'task_embed'))
    # [K, M, T, 3t'] = [e_tau; z_m; y_k] for every (kind, layer, task).
    shape = (len(adapters.KINDS), m, t_, te)
    pairs = jnp.concatenate([
        jnp.broadcast_to(task_emb[None, None], shape),
        jnp.broadcast_to(layer_emb[None, :, None], shape),
        jnp.broadcast_to(kind_emb[:, None, None], shape),
    ], axis=-1)
    hidden = jax.nn.relu(self._dense(pairs, 'task_projector_hidden',
                                     cfg.task_hidden_dim,
                                     ('task_embed', 'task_hidden')))
    projected = self._dense(hidden, 'task_projector_output',
                            cfg.projected_dim, ('task_hidden', 'task_embed'))
    projected = adapters.layer_norm(  # I: [K, M, T, t]
        projected,
        self._param('task_projector_norm_scale', nn.initializers.ones,
                    (cfg.projected_dim,), ('task_embed',)),
        self._param('task_projector_norm_bias', nn.initializers.zeros,
                    (cfg.projected_dim,), ('task_embed',)))

    # The generators make the adapters' weights, activations of the network
    # that the adapters take in its dtype: they compute in it, as every
    # Dense of the network does. In float32 a bfloat16 step of HyperFormer++
    # wrote, split and differentiated [2, M, T, d * b] float32 twice a
    # stack.
    def generate(name, size, out_axis, out_shape):
      y = self._dense(projected, f'{name}_generator', size,
                      ('task_embed', out_axis), self.dtype)
      return y.reshape(shape[:3] + out_shape)  # [K, M, T, *out_shape]

    down = generate('down', d * b, 'hyper_bottleneck', (d, b))
    up = generate('up', b * d, 'hyper_bottleneck', (b, d))
    down_bias = generate('down_bias', b, 'adapter_bottleneck', (b,))
    up_bias = generate('up_bias', d, 'embed', (d,))
    norm_scale = generate('norm_scale', d, 'embed', (d,))
    norm_bias = generate('norm_bias', d, 'embed', (d,))
    # Per kind by `adapters.unstack`: the gradients meet in one concatenate.
    generated = zip(*(adapters.unstack(a) for a in (
        down, down_bias, up, up_bias, norm_scale, norm_bias)))
    return {
        kind: adapters.AdapterWeights(*arrays)
        for kind, arrays in zip(adapters.KINDS, generated)
    }

