"""T5 encoder-decoder (T5.1.1 by default, T5 v1.0 via config) with task ids.

Parameter names, shapes and logical axes are those of t5x's
`examples/t5/network.py`, so t5x checkpoints restore into it and t5x's
partitioner shards it. Every entry point takes `task_ids`: int32 `[batch]`,
or per token `[batch, length]` on packed rows. The plain network ignores
them; task-conditioned modules need them.

This file is the backbone only: each stack builds one
`conditioning.StackConditioning` and hands every layer its
`LayerConditioning`. The methods' equations live in `methods.REGISTRY`'s
modules (`hyperprompt.py`: HyperPrompt, Eqs. 1-8; `hypergrid.py`: HyperGrid,
Eqs. 3-8, and Output Gating; `adapters.py`, `hyperformer.py`,
`prompt_tuning.py`: the baselines).
"""

import dataclasses
import functools
from typing import Any, Optional, Sequence

from flax import linen as nn
from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from hyperprompt_jax import methods
from hyperprompt_jax.model import conditioning as conditioning_lib
from hyperprompt_jax.t5 import layers
from hyperprompt_jax.t5 import task_blocks

Array = jax.Array


@struct.dataclass
class T5Config:
  """Hyperparameters of the network (gin: `network.T5Config`).

  Defaults are T5.1.1-small's except the vocabulary, which must be set.

  Attributes:
    vocab_size: number of token ids.
    dtype: dtype of the activations; parameters are always float32.
    emb_dim: model width, `d_model`.
    num_heads: attention heads.
    num_encoder_layers: encoder layers.
    num_decoder_layers: decoder layers.
    head_dim: width of each head's queries, keys and values.
    mlp_dim: FFN hidden width.
    mlp_activations: ('gelu', 'linear') is T5.1.1's gated GELU; ('relu',)
      is T5 v1.0's FFN.
    dropout_rate: dropout rate throughout.
    logits_via_embedding: ties the output layer to the token embedding
      (T5 v1.0).
    float32_attention_logits: attention logits and softmax in float32 at
      bfloat16 activations. Off by default, as in t5x: no gain in scores,
      more memory (docs/performance.md, "Attention logits in float32").
    num_tasks: size of the task-id space; ids lie in `[0, num_tasks)`.
    check_traced_task_ids: out-of-range traced ids fail the compiled call,
      on any platform and mesh. The check is a host callback
      (`conditioning._call_on_host`), which costs JAX's fast dispatch and
      its persistent compilation cache (docs/operations.md, "Training with
      the built-in runner"); off only where batches are checked on the host
      first (`checked_on_host`). Concrete ids are always checked.
    remat_policy: rematerialisation of the layers in training
      (`REMAT_POLICIES`): 'none' keeps every activation, 'minimal' the
      matmul outputs, 'full' each layer's inputs only. Results are the same.
    gradient_form: gradients of the per-task gathers and adapters
      (`task_blocks`): 'written' (for XLA:CPU's kernels), 'autodiff' (for
      TPUs and GPUs) or 'auto' ('written' on CPU). Results are the same.
    hyperprompt: HyperPrompt's config, or None. One field per method of
      `methods.REGISTRY` (its CONFIG_FIELD); all None: plain multi-task T5.
    hypergrid: HyperGrid's (and Output Gating's) config, or None.
    adapter: Vanilla (Houlsby) adapters' config (a baseline), or None.
    hyperformer: HyperFormer++'s config (a baseline), or None.
    prompt_tuning: multi-task Prompt-Tuning's config (a baseline), or None.
  """

  vocab_size: int
  dtype: Any = jnp.float32
  emb_dim: int = 512
  num_heads: int = 6
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  head_dim: int = 64
  mlp_dim: int = 1024
  mlp_activations: Sequence[str] = ('gelu', 'linear')
  dropout_rate: float = 0.1
  logits_via_embedding: bool = False
  float32_attention_logits: bool = False
  num_tasks: int = 8
  check_traced_task_ids: bool = True
  remat_policy: str = 'none'
  gradient_form: str = 'auto'
  hyperprompt: Optional[methods.hyperprompt.HyperPromptConfig] = None
  hypergrid: Optional[methods.hypergrid.HyperGridConfig] = None
  adapter: Optional[methods.adapters.AdapterConfig] = None
  hyperformer: Optional[methods.hyperformer.HyperFormerConfig] = None
  prompt_tuning: Optional[methods.prompt_tuning.PromptTuningConfig] = None


def check_config(cfg: T5Config) -> None:
  """Raises ValueError on a configuration that cannot build a network."""
  for name in ('vocab_size', 'emb_dim', 'num_heads', 'head_dim', 'mlp_dim',
               'num_tasks'):
    if getattr(cfg, name) <= 0:
      raise ValueError(f'T5Config.{name} must be positive, got '
                       f'{getattr(cfg, name)}.')
  for name in ('num_encoder_layers', 'num_decoder_layers'):
    if getattr(cfg, name) < 0:
      raise ValueError(f'T5Config.{name} must be >= 0.')
  if not 0.0 <= cfg.dropout_rate < 1.0:
    raise ValueError(f'T5Config.dropout_rate must be in [0, 1), got '
                     f'{cfg.dropout_rate}.')
  if not cfg.mlp_activations:
    raise ValueError('T5Config.mlp_activations must name at least one.')
  if cfg.remat_policy not in REMAT_POLICIES:
    raise ValueError(f'REMAT_POLICY={cfg.remat_policy!r} (T5Config.'
                     f'remat_policy); expected one of {list(REMAT_POLICIES)}.')
  task_blocks.check_gradient_form(cfg.gradient_form)
  if cfg.adapter is not None and cfg.hyperformer is not None:
    raise ValueError(
        'T5Config.adapter (Vanilla Adapter) and T5Config.hyperformer '
        '(HyperFormer++) both adapt the same sublayers: include one of '
        'variants/adapter.gin and variants/hyperformer_pp.gin, not both.')
  methods.check(cfg)


# T5Config fields that change neither parameters nor results, only a step's
# memory or time (MAX_SEGMENTS: which examples share a packed row, recorded
# by the data record's PACKER). Not recorded, so a run may resume, or a
# reader load an older checkpoint, with another value.
MEMORY_CHOICES = ('T5Config.remat_policy', 'T5Config.gradient_form',
                  'T5Config.hyperprompt.packed_form',
                  'T5Config.hypergrid.packed_form',
                  'T5Config.hypergrid.max_segments')


def model_settings(config: Any, prefix: str = 'T5Config') -> dict[str, str]:
  """Flattens a config for the run record and task-parameter artifacts.

  Args:
    config: a dataclass config, such as `T5Config`.
    prefix: the name of `config` in the result.

  Returns:
    `{'T5Config.num_tasks': '8', 'T5Config.hyperprompt.prompt_length':
    '16', ...}`, values as `repr`, `MEMORY_CHOICES` left out.
  """
  out = {}
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    name = f'{prefix}.{field.name}'
    if name in MEMORY_CHOICES:
      continue
    if dataclasses.is_dataclass(value):
      out.update(model_settings(value, name))
    else:
      out[name] = repr(value)
  return out


# jax.checkpoint's policy of each REMAT_POLICY ('none': no remat).
REMAT_POLICIES = {
    'none': None,
    'minimal': jax.checkpoint_policies.dots_saveable,
    'full': jax.checkpoint_policies.nothing_saveable,
}


@functools.cache
def _remat(layer_cls: type[nn.Module], policy: str,
           static_argnums: tuple[int, ...]) -> type[nn.Module]:
  """`layer_cls` under `nn.remat`; the parameter paths do not change.

  `static_argnums` (`self` is 0) name the flags, compile-time constants.
  """
  return nn.remat(layer_cls, policy=REMAT_POLICIES[policy],
                  static_argnums=static_argnums)


def is_task_conditioned(cfg: T5Config) -> bool:
  """Whether any module of the network consumes `task_ids`."""
  return methods.is_task_conditioned(cfg)


def _dropout(cfg: T5Config, **kwargs) -> nn.Dropout:
  return nn.Dropout(rate=cfg.dropout_rate, **kwargs)


def _attention(cfg: T5Config, name: str, cls=layers.MultiHeadDotProductAttention
               ) -> nn.Module:
  return cls(
      num_heads=cfg.num_heads,
      head_dim=cfg.head_dim,
      dtype=cfg.dtype,
      dropout_rate=cfg.dropout_rate,
      float32_logits=cfg.float32_attention_logits,
      name=name,
  )


def _ffn_sublayer(cfg: T5Config, x, deterministic,
                  conditioning: conditioning_lib.LayerConditioning):
  """Pre-norm FFN, FFN adapter and residual, inside a layer's compact call."""
  y = layers.LayerNorm(dtype=cfg.dtype, name='pre_mlp_layer_norm')(x)
  y = conditioning.ffn(
      intermediate_dim=cfg.mlp_dim,
      activations=cfg.mlp_activations,
      intermediate_dropout_rate=cfg.dropout_rate,
      dtype=cfg.dtype,
      name='mlp',
  )(y, deterministic=deterministic)
  y = conditioning.adapt(y, 'mlp')
  y = _dropout(cfg, broadcast_dims=(-2,))(y, deterministic=deterministic)
  return y + x


class EncoderLayer(nn.Module):
  """Pre-norm self-attention + FFN block of the encoder."""

  config: T5Config
  relative_embedding: nn.Module

  @nn.compact
  def __call__(self, inputs, encoder_mask=None, deterministic=False,
               conditioning: conditioning_lib.LayerConditioning =
               conditioning_lib.NONE):
    """Applies the layer: `[batch, length, embed]` -> same shape."""
    cfg = self.config
    length = inputs.shape[-2]
    bias = self.relative_embedding(length, length, True)
    norm = layers.LayerNorm(dtype=cfg.dtype, name='pre_attention_layer_norm')
    x = norm(inputs)
    attention = _attention(cfg, 'attention', conditioning.attention_class)
    x, conditioning = conditioning.attend(
        attention, norm, x, x, encoder_mask, bias,
        first_token=lambda: norm(inputs), deterministic=deterministic,
        **conditioning.self_attention_prefix())
    x = conditioning.adapt(x, 'attention')
    x = _dropout(cfg, broadcast_dims=(-2,))(x, deterministic=deterministic)
    return _ffn_sublayer(cfg, x + inputs, deterministic, conditioning)


class DecoderLayer(nn.Module):
  """Pre-norm causal self-attention + cross-attention + FFN block."""

  config: T5Config
  relative_embedding: nn.Module

  @nn.compact
  def __call__(self, inputs, encoded, decoder_mask=None,
               encoder_decoder_mask=None, deterministic=False, decode=False,
               max_decode_length=None,
               conditioning: conditioning_lib.LayerConditioning =
               conditioning_lib.NONE):
    """Applies the layer: `[batch, target_length, embed]` -> same shape.

    A gated FFN's gates come from `encoded` through the cross-attention,
    never from target tokens.
    """
    cfg = self.config
    length = max_decode_length if decode and max_decode_length else (
        inputs.shape[-2]
    )
    bias = self.relative_embedding(length, length, False)
    x = layers.LayerNorm(
        dtype=cfg.dtype, name='pre_self_attention_layer_norm'
    )(inputs)
    x = _attention(cfg, 'self_attention')(
        x, x, decoder_mask, bias, deterministic=deterministic, decode=decode,
        **conditioning.self_attention_prefix(),
    )
    x = conditioning.adapt(x, 'attention')
    x = _dropout(cfg, broadcast_dims=(-2,))(x, deterministic=deterministic)
    x = x + inputs
    cross_norm = layers.LayerNorm(
        dtype=cfg.dtype, name='pre_cross_attention_layer_norm'
    )
    cross_attention = _attention(cfg, 'encoder_decoder_attention',
                                 conditioning.attention_class)
    y, conditioning = conditioning.attend(
        cross_attention, cross_norm, cross_norm(x), encoded,
        encoder_decoder_mask, None, first_token=lambda: encoded,
        deterministic=deterministic,
        **conditioning.cross_attention_prefix(self))
    y = _dropout(cfg, broadcast_dims=(-2,))(y, deterministic=deterministic)
    return _ffn_sublayer(cfg, y + x, deterministic, conditioning)


def _relative_position_biases(cfg: T5Config) -> layers.RelativePositionBiases:
  return layers.RelativePositionBiases(
      num_buckets=32,
      max_distance=128,
      num_heads=cfg.num_heads,
      dtype=cfg.dtype,
      name='relpos_bias',
  )


class Encoder(nn.Module):
  """Embedding, encoder layers and final norm."""

  config: T5Config
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, encoder_input_tokens, encoder_mask=None,
               deterministic=False, task_ids=None, encoder_positions=None,
               packed=False, segment_ids=None):
    """Encodes `[batch, length]` tokens to `[batch, n + length, embed]`.

    n is Prompt-Tuning's prompt length, else 0; `encoder_mask` covers
    n + length. On packed rows (`packed`), `task_ids` are per token and
    Prompt-Tuning's prompts fill reserved slots (n = 0).
    """
    cfg = self.config
    rel_emb = _relative_position_biases(cfg)
    conditioning = conditioning_lib.StackConditioning(
        self, 'encoder', cfg.num_encoder_layers, task_ids,
        conditioning_lib.input_valid(cfg, encoder_input_tokens, packed),
        packed=packed, positions=encoder_positions, segment_ids=segment_ids,
        kv_segment_ids=segment_ids)
    x = self.shared_embedding(encoder_input_tokens.astype(jnp.int32))
    x = conditioning.inputs(x)
    x = _dropout(cfg, broadcast_dims=(-2,))(x, deterministic=deterministic)
    x = x.astype(cfg.dtype)
    layer_cls = EncoderLayer
    if cfg.remat_policy != 'none':
      layer_cls = _remat(EncoderLayer, cfg.remat_policy, (3,))  # deterministic
    for i in range(cfg.num_encoder_layers):
      x = layer_cls(cfg, rel_emb, name=f'layers_{i}')(
          x, encoder_mask, deterministic, conditioning.layer(i))
    x = layers.LayerNorm(dtype=cfg.dtype, name='encoder_norm')(x)
    return _dropout(cfg)(x, deterministic=deterministic)


class Decoder(nn.Module):
  """Embedding, decoder layers, final norm and output logits."""

  config: T5Config
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, encoded, decoder_input_tokens, decoder_positions=None,
               decoder_mask=None, encoder_decoder_mask=None,
               deterministic=False, decode=False, max_decode_length=None,
               task_ids=None, encoder_valid=None, packed=False,
               segment_ids=None, encoder_segment_ids=None):
    """Returns float32 logits `[batch, target_length, vocab]`.

    `encoder_valid` (`[batch, encoded_length]`) marks the valid positions of
    `encoded`, over which HyperGrid queries the task. While decoding, what
    depends only on the task and `encoded` (hyper-prompts, HyperGrid's
    gates) is computed with the cache and read from it at every step.
    """
    cfg = self.config
    rel_emb = _relative_position_biases(cfg)
    conditioning = conditioning_lib.StackConditioning(
        self, 'decoder', cfg.num_decoder_layers, task_ids, encoder_valid,
        packed=packed, decode=decode, segment_ids=segment_ids,
        kv_segment_ids=encoder_segment_ids)
    y = self.shared_embedding(decoder_input_tokens.astype(jnp.int32))
    y = _dropout(cfg, broadcast_dims=(-2,))(y, deterministic=deterministic)
    y = y.astype(cfg.dtype)
    layer_cls = DecoderLayer
    if cfg.remat_policy != 'none' and not decode:  # decoding keeps no grads
      # deterministic, decode, max_decode_length
      layer_cls = _remat(DecoderLayer, cfg.remat_policy, (5, 6, 7))
    for i in range(cfg.num_decoder_layers):
      y = layer_cls(cfg, rel_emb, name=f'layers_{i}')(
          y, encoded, decoder_mask, encoder_decoder_mask, deterministic,
          decode, max_decode_length, conditioning.layer(i))
    y = layers.LayerNorm(dtype=cfg.dtype, name='decoder_norm')(y)
    y = _dropout(cfg, broadcast_dims=(-2,))(y, deterministic=deterministic)
    if cfg.logits_via_embedding:
      # Tied output layer, normalised as in T5 v1.0.
      return self.shared_embedding.attend(y) / jnp.sqrt(y.shape[-1])
    return layers.DenseGeneral(
        cfg.vocab_size,
        dtype=jnp.float32,  # float32 logits for a stable softmax
        kernel_axes=('embed', 'vocab'),
        name='logits_dense',
    )(y)


def _check_inputs(cfg: T5Config, name: str, tokens, task_ids,
                  segment_ids) -> Optional[Array]:
  """Checks the tokens and task ids; returns the ids as an array."""
  if tokens.ndim != 2:
    raise ValueError(f'{name} must be [batch, length], got shape '
                     f'{tokens.shape}.')
  task_ids = conditioning_lib.check_task_ids(cfg, task_ids, tokens,
                                             segment_ids)
  conditioning_lib.check_segments(cfg, segment_ids)
  return task_ids


class Transformer(nn.Module):
  """Encoder-decoder T5 with t5x's entry points plus `task_ids`.

  Attributes:
    config: the network's `T5Config`.
  """

  config: T5Config

  def setup(self):
    cfg = self.config
    check_config(cfg)
    self.shared_embedding = layers.Embed(
        num_embeddings=cfg.vocab_size,
        features=cfg.emb_dim,
        dtype=cfg.dtype,
        attend_dtype=jnp.float32,
        embedding_init=nn.initializers.normal(stddev=1.0),
        one_hot=True,
        name='token_embedder',
    )
    self.encoder = Encoder(cfg, self.shared_embedding)
    self.decoder = Decoder(cfg, self.shared_embedding)

  def encode(self, encoder_input_tokens, encoder_segment_ids=None,
             enable_dropout=True, task_ids=None, encoder_positions=None):
    """Encodes the inputs.

    Args:
      encoder_input_tokens: `[batch, length]` int tokens, 0 = padding.
      encoder_segment_ids: `[batch, length]` for packed rows: tokens attend
        only within their segment.
      enable_dropout: enables dropout (needs a 'dropout' rng).
      task_ids: int32 `[batch]`, or `[batch, length]` on packed rows.
      encoder_positions: `[batch, length]` for packed rows (Prompt-Tuning
        reads them).

    Returns:
      `[batch, n + length, embed]`, n being Prompt-Tuning's prompt length on
      unpacked rows, else 0.
    """
    cfg = self.config
    task_ids = _check_inputs(cfg, 'encoder_input_tokens',
                             encoder_input_tokens, task_ids,
                             encoder_segment_ids)
    packed = encoder_segment_ids is not None  # decided here, handed down
    valid = conditioning_lib.input_valid(cfg, encoder_input_tokens, packed)
    encoder_mask = layers.make_attention_mask(valid, valid, dtype=cfg.dtype)
    if packed:
      encoder_mask = layers.combine_masks(
          encoder_mask, layers.make_attention_mask(
              encoder_segment_ids, encoder_segment_ids, jnp.equal,
              dtype=cfg.dtype), dtype=cfg.dtype)
    return self.encoder(encoder_input_tokens, encoder_mask,
                        deterministic=not enable_dropout, task_ids=task_ids,
                        encoder_positions=encoder_positions, packed=packed,
                        segment_ids=encoder_segment_ids)

  def decode(self, encoded, encoder_input_tokens, decoder_input_tokens,
             decoder_target_tokens, encoder_segment_ids=None,
             decoder_segment_ids=None, decoder_positions=None,
             enable_dropout=True, decode=False, max_decode_length=None,
             task_ids=None):
    """Decodes given `encoded`.

    Args:
      encoded: `[batch, encoded_length, embed]`, from `encode`.
      encoder_input_tokens: `[batch, input_length]`, for the masks.
      decoder_input_tokens: `[batch, target_length]`, targets shifted right.
      decoder_target_tokens: `[batch, target_length]`, for the masks.
      encoder_segment_ids: `[batch, input_length]` for packed rows.
      decoder_segment_ids: `[batch, target_length]` for packed rows.
      decoder_positions: `[batch, target_length]`, kept for t5x.
      enable_dropout: enables dropout (needs a 'dropout' rng).
      decode: runs one step against the autoregressive cache (made by a
        first call with the full target shape: `init_cache`).
      max_decode_length: the cache's length, when `decode`.
      task_ids: int32 `[batch]`, or `[batch, target_length]` on packed rows.

    Returns:
      float32 logits `[batch, target_length, vocab]`.

    Raises:
      ValueError: on one segment-id array without the other, or packed rows
        with `decode`.
    """
    cfg = self.config
    task_ids = _check_inputs(cfg, 'decoder_input_tokens',
                             decoder_input_tokens, task_ids,
                             decoder_segment_ids)
    packed = decoder_segment_ids is not None  # decided here, handed down
    if packed != (encoder_segment_ids is not None):
      raise ValueError('Packed rows need both encoder_segment_ids and '
                       'decoder_segment_ids (the feature converter makes '
                       'both with pack=True); got only one.')
    # `encoded` covers the Prompt-Tuning prompt too (always valid).
    encoder_valid = conditioning_lib.input_valid(cfg, encoder_input_tokens,
                                                 packed)
    if decode:
      # Targets are not known while decoding: no decoder padding mask.
      decoder_mask = None
      encoder_decoder_mask = layers.make_attention_mask(
          jnp.ones_like(decoder_target_tokens), encoder_valid, dtype=cfg.dtype
      )
    else:
      decoder_mask = layers.make_decoder_mask(
          decoder_target_tokens, cfg.dtype, decoder_segment_ids
      )
      encoder_decoder_mask = layers.make_attention_mask(
          decoder_target_tokens > 0, encoder_valid, dtype=cfg.dtype
      )
    if packed:
      if decode:
        raise ValueError('Packed inputs cannot be decoded: '
                         '`encoder_segment_ids` was passed with decode=True.')
      encoder_decoder_mask = layers.combine_masks(
          encoder_decoder_mask, layers.make_attention_mask(
              decoder_segment_ids, encoder_segment_ids, jnp.equal,
              dtype=cfg.dtype), dtype=cfg.dtype)
    return self.decoder(
        encoded, decoder_input_tokens, decoder_positions=decoder_positions,
        decoder_mask=decoder_mask, encoder_decoder_mask=encoder_decoder_mask,
        deterministic=not enable_dropout, decode=decode,
        max_decode_length=max_decode_length, task_ids=task_ids,
        encoder_valid=encoder_valid, packed=packed,
        segment_ids=decoder_segment_ids,
        encoder_segment_ids=encoder_segment_ids)

  def init_cache(self, encoded, encoder_input_tokens, max_decode_length: int,
                 task_ids=None):
    """Creates the autoregressive cache; apply with `mutable=['cache']`.

    One decode call over the full target shape (t5x's convention) with the
    real task ids: what depends only on the task and `encoded` (HyperPrompt's
    decoder prompts, HyperGrid's decoder gates) is computed once, here, and
    kept in the cache. `create_cache` wraps it.
    """
    shape = jnp.ones((encoded.shape[0], max_decode_length), jnp.int32)
    self.decode(encoded, encoder_input_tokens, shape, shape,
                enable_dropout=False, decode=True,
                max_decode_length=max_decode_length, task_ids=task_ids)

  def __call__(
      self,
      encoder_input_tokens,
      decoder_input_tokens,
      decoder_target_tokens,
      encoder_segment_ids=None,
      decoder_segment_ids=None,
      encoder_positions=None,
      decoder_positions=None,
      *,
      enable_dropout: bool = True,
      decode: bool = False,
      task_ids=None,
      encoder_task_ids=None,
      decoder_task_ids=None,
  ):
    """Teacher-forced logits.

    Args:
      encoder_input_tokens: `[batch, input_length]` int tokens, 0 = padding.
      decoder_input_tokens: `[batch, target_length]`, targets shifted right.
      decoder_target_tokens: `[batch, target_length]`, for the masks.
      encoder_segment_ids: `[batch, input_length]` for packed rows.
      decoder_segment_ids: `[batch, target_length]` for packed rows.
      encoder_positions: `[batch, input_length]` for packed rows (T5's
        positions are relative; Prompt-Tuning's packed slots read them).
      decoder_positions: `[batch, target_length]`, kept for t5x.
      enable_dropout: enables dropout (needs a 'dropout' rng).
      decode: use the autoregressive cache.
      task_ids: int32 `[batch]`, ids in `[0, num_tasks)` (unpacked rows).
      encoder_task_ids: packed rows: int32 `[batch, input_length]`, each
        token's task (instead of `task_ids`).
      decoder_task_ids: packed rows: int32 `[batch, target_length]`.

    Returns:
      float32 logits `[batch, target_length, vocab]`.
    """
    if task_ids is not None and (encoder_task_ids is not None
                                 or decoder_task_ids is not None):
      raise ValueError('Pass task_ids (unpacked rows) or encoder_task_ids / '
                       'decoder_task_ids (packed rows), not both.')
    if (encoder_task_ids is None) != (decoder_task_ids is None):
      raise ValueError('encoder_task_ids and decoder_task_ids go together.')
    encoded = self.encode(
        encoder_input_tokens,
        encoder_segment_ids=encoder_segment_ids,
        enable_dropout=enable_dropout,
        task_ids=task_ids if encoder_task_ids is None else encoder_task_ids,
        encoder_positions=encoder_positions,
    )
    return self.decode(
        encoded,
        encoder_input_tokens,
        decoder_input_tokens,
        decoder_target_tokens,
        encoder_segment_ids=encoder_segment_ids,
        decoder_segment_ids=decoder_segment_ids,
        decoder_positions=decoder_positions,
        enable_dropout=enable_dropout,
        decode=decode,
        task_ids=task_ids if decoder_task_ids is None else decoder_task_ids,
    )


def init_variables(model: Transformer, rng: Array, input_length: int = 8,
                   target_length: int = 4, batch_size: int = 1):
  """Initialises `model` on placeholder tokens, task id 0.

  The parameters and their logical axes depend only on the configuration,
  not on the shapes. Every runner initialises through here.

  Args:
    model: the network.
    rng: the initialisation's PRNG key.
    input_length: length of the placeholder inputs.
    target_length: length of the placeholder targets.
    batch_size: rows of the placeholders.

  Returns:
    The variables: `params` and `params_axes`.
  """
  # numpy, not jnp: concrete ids are checked while tracing, so a compiled
  # init holds no host callback and JAX's compilation cache keeps it.
  encoder_tokens = np.ones((batch_size, input_length), np.int32)
  decoder_tokens = np.ones((batch_size, target_length), np.int32)
  return model.init(rng, encoder_tokens, decoder_tokens, decoder_tokens,
                    enable_dropout=False,
                    task_ids=np.zeros((batch_size,), np.int32))


def abstract_variables(model: Transformer, input_length: int = 8,
                       target_length: int = 4):
  """Shapes and dtypes of `init_variables`, without allocating anything.

  Cached per configuration, as a run asks several times and tracing costs a
  forward pass; each caller gets its own copy of the containers.
  """
  try:
    hash(model)  # the module hashes (and compares) by its configuration
  except TypeError:  # a configuration holding something unhashable
    return _abstract_variables.__wrapped__(model, input_length, target_length)
  return jax.tree.map(lambda x: x, _abstract_variables(
      model, input_length, target_length))


@functools.lru_cache(maxsize=64)
def _abstract_variables(model: Transformer, input_length: int,
                        target_length: int):
  return jax.eval_shape(lambda: init_variables(
      model, jax.random.PRNGKey(0), input_length, target_length))


def checked_on_host(model: Transformer) -> Transformer:
  """`model` without the compiled check of traced task ids.

  For programs whose every batch is checked on the host first
  (`batches.validate_batch`): the check's host callback would only repeat
  it, and keeps a program out of JAX's persistent compilation cache and off
  its fast dispatch (`T5Config.check_traced_task_ids`).
  """
  return model.clone(config=dataclasses.replace(
      model.config, check_traced_task_ids=False))


def create_cache(model: Transformer, params, encoded: Array,
                 encoder_input_tokens: Array, max_decode_length: int,
                 task_ids: Optional[Array] = None):
  """Returns the decoding cache of `Transformer.init_cache`.

  Args:
    model: the network.
    params: its parameters.
    encoded: `[batch, encoded_length, embed]`, from `Transformer.encode`.
    encoder_input_tokens: `[batch, input_length]`.
    max_decode_length: length of the targets to decode.
    task_ids: int32 `[batch]`.

  Returns:
    The `cache` collection, where greedy decoding and beam search start.
  """
  _, variables = model.apply(
      {'params': params}, encoded, encoder_input_tokens, max_decode_length,
      task_ids, mutable=['cache'], method=model.init_cache)
  return variables['cache']
