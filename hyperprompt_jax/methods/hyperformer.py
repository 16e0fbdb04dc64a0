"""HyperFormer++ (Karimi Mahabadi et al., ACL 2021), a baseline.

One hypernetwork per stack generates every layer's per-task adapters. They
sit where the Vanilla Adapter's do (`adapters.py`: after the self-attention
and the FFN sublayers of every block), with a generated post layer norm:

    h -> h + LN_{gamma, beta}(W_up act(W_down h + b_down) + b_up).

Their weights come from a layer-aware task embedding, one per (task tau,
layer m, block kind k), as in the authors' `AdapterLayersOneHyperNetController`:

    I = LN(h_t([e_tau; z_m; y_k])),   h_t = Dense(3t' -> e), ReLU, Dense(e -> t)
    (W_down, b_down, W_up, b_up, gamma, beta) = linear generators of I

with task embeddings e [T, t'], layer-id embeddings z [M, t'], block-kind
embeddings y [2, t'], and each generator a Dense(t -> size) with bias. One
set of generators serves all tasks, layers and both kinds of a stack; the
encoder and the decoder have one each.

Defaults: the authors' t' = 512, e = 128, t = 64, and b = d / 16, which meet
the HyperPrompt paper's parameter budget (docs/methods.md, "Baselines").
Initialisation as the authors' code: embeddings N(0, 1), every Dense
N(0, 0.01^2) with zero bias, the projector's LN scale 1, bias 0.

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

# Read by `methods.REGISTRY`: the T5Config field of the config, parameter
# scopes, logical axis names, gin variant files, `check` and `is_active`.
CONFIG_FIELD = 'hyperformer'
SCOPES = ('hyperformer',)
AXIS_NAMES = ('tasks', 'hyper_layers', 'adapter_kinds', 'task_embed',
              'task_hidden')
VARIANT_FILES = ('variants/hyperformer_pp.gin',)
is_active = adapters.is_active


@struct.dataclass
class HyperFormerConfig:
  """HyperFormer++'s settings (gin: `hyperformer.HyperFormerConfig`).

  See gin/variants/hyperformer_pp.gin.

  Attributes:
    placement: the stacks with adapters: 'both', 'encoder' or 'decoder'.
    reduction: the adapters' bottleneck is b = d / reduction.
    task_embed_dim: t', width of the task, layer and kind embeddings.
    task_hidden_dim: e, hidden width of the task projector h_t.
    projected_dim: t, width of the layer-aware task embedding I.
    activation: the adapters' activation, a flax.linen name.
    packed_form: 'auto', 'task_blocks' or 'pallas' (`adapters.py`).
  """

  placement: str = 'both'
  reduction: int = 16
  task_embed_dim: int = 512
  task_hidden_dim: int = 128
  projected_dim: int = 64
  activation: str = 'relu'
  packed_form: str = 'auto'


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
  """Raises ValueError on settings that cannot build HyperFormer++."""
  check_hyperformer_config(cfg, model_config.emb_dim)


class HyperFormerGenerator(nn.Module):
  """The adapters of one stack, generated for all tasks and layers.

  Attributes:
    config: the `HyperFormerConfig`.
    num_tasks: T.
    num_layers: M.
    emb_dim: d.
    dtype: the activations' dtype (`T5Config.dtype`).
  """

  config: HyperFormerConfig
  num_tasks: int
  num_layers: int
  emb_dim: int
  dtype: Any = jnp.float32

  def _param(self, name, init, shape, axes):
    """A float32 parameter with logical `axes`."""
    return layers.param_with_axes(name, init, shape, jnp.float32, axes=axes)

  def _dense(self, x, name, out_dim, axes, dtype=jnp.float32):
    """Dense with bias and the authors' init, computed in `dtype`."""
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

    # The generated weights are activations the adapters take in the
    # network's dtype, so the generators compute in it, as every Dense does;
    # in float32 a bfloat16 step would carry `[2, M, T, d * b]` float32.
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

