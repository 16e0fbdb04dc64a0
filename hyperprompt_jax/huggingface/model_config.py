"""transformers' T5 `config.json` <-> the project's `network.T5Config`.

`from_hf` maps a T5 / T5.1.1 / LM-adapted / Flan-T5 / mT5 config, naming
any field the network cannot represent; `to_hf` writes the config of the
same network for `T5ForConditionalGeneration`; `gin_text` writes a model
gin file like `gin/models/*.gin`.

The mapping: d_model -> emb_dim, num_heads, d_kv -> head_dim, d_ff ->
mlp_dim, num_layers -> num_encoder_layers, num_decoder_layers (default
num_layers), vocab_size, dropout_rate; feed_forward_proj -> mlp_activations
('relu' -> ('relu',), 'gated-gelu' -> ('gelu', 'linear'), ...); tie_word_
embeddings (transformers' default: true) -> logits_via_embedding.
"""

import math
from typing import Any, Mapping

from hyperprompt_jax.model import network

# transformers' model types with T5's architecture (mT5 differs only in its
# vocabulary and untied logits). umT5 ('umt5') has a relative-position table
# per layer, which the project's network does not.
MODEL_TYPES = ('t5', 'mt5')
# What the network fixes (`network._relative_position_biases`,
# `layers.LayerNorm`) and its token conventions (padding and the decoder's
# first input are id 0, as seqio's feature converter makes them).
FIXED = {'relative_attention_num_buckets': 32,
         'relative_attention_max_distance': 128,
         'layer_norm_epsilon': 1e-6,
         'pad_token_id': 0,
         'decoder_start_token_id': 0}
# transformers' activation (its ACT2FN name) -> the project's (a flax.linen
# function name, `layers.activation`), where both are the same function.
# transformers' 'gelu' is the exact (erf) GELU; flax's `gelu` is the tanh
# approximation, transformers' 'gelu_new' ('gated-gelu' means it).
ACTIVATIONS = {'relu': 'relu', 'gelu_new': 'gelu',
               'gelu_pytorch_tanh': 'gelu', 'silu': 'silu', 'swish': 'silu'}
# The project's activation -> the name written into config.json.
_HF_ACTIVATION = {'relu': 'relu', 'gelu': 'gelu_new', 'silu': 'silu'}
_REQUIRED = ('vocab_size', 'd_model', 'd_kv', 'd_ff', 'num_heads',
             'num_layers')
# transformers' encoder-only classes: no decoder to convert.
_ENCODER_ONLY = ('T5EncoderModel', 'MT5EncoderModel')


def activations(feed_forward_proj: str) -> tuple[str, ...]:
  """transformers' `feed_forward_proj` -> `T5Config.mlp_activations`.

  Args:
    feed_forward_proj: such as 'relu' or 'gated-gelu'.

  Returns:
    Such as `('relu',)` or `('gelu', 'linear')`.

  Raises:
    ValueError: an activation the network has no identical function for.
  """
  parts = str(feed_forward_proj).split('-')
  gated = len(parts) == 2 and parts[0] == 'gated'
  name = 'gelu_new' if feed_forward_proj == 'gated-gelu' else parts[-1]
  if (len(parts) > 2 or (len(parts) == 2 and not gated)
      or name not in ACTIVATIONS):
    raise ValueError(
        f'config.json: feed_forward_proj {feed_forward_proj!r} cannot be '
        'represented: the network has ' + ', '.join(
            f"{'gated-' if g else ''}{n}" for g in (False, True)
            for n in ('relu', 'gelu_new', 'silu'))
        + " ('gated-gelu' is gated-gelu_new; transformers' 'gelu' is the "
        "exact erf GELU, the network's the tanh approximation).")
  return (ACTIVATIONS[name], 'linear') if gated else (ACTIVATIONS[name],)


def from_hf(config: Mapping[str, Any], num_tasks: int = 8
            ) -> network.T5Config:
  """A transformers T5 `config.json` (as a dict) -> `network.T5Config`.

  Args:
    config: the parsed config.json.
    num_tasks: the task-id space of the model (no field of a T5 config).

  Returns:
    The config of the same network (float32 activations: set the dtype in
    gin, `gin_text`).

  Raises:
    ValueError: naming the field the network cannot represent.
  """
  model_type = config.get('model_type')
  if model_type not in MODEL_TYPES:
    raise ValueError(
        f'config.json: model_type {model_type!r} is not T5: this converts '
        f'transformers\' T5 encoder-decoders (model_type {" or ".join(MODEL_TYPES)}'
        ': T5, T5.1.1, LM-adapted, Flan-T5, mT5)'
        + ('; umT5 has a relative-position table per layer, the network '
           'one per stack' if model_type == 'umt5' else '') + '.')
  if not config.get('is_encoder_decoder', True):
    raise ValueError('config.json: is_encoder_decoder is false: the network '
                     'is an encoder-decoder; give a T5ForConditionalGeneration '
                     'checkpoint.')
  encoder_only = set(config.get('architectures') or ()) & set(_ENCODER_ONLY)
  if encoder_only:
    raise ValueError(f'config.json: architectures {sorted(encoder_only)} is '
                     'an encoder alone; give a T5ForConditionalGeneration '
                     'checkpoint (encoder and decoder).')
  absent = [f for f in _REQUIRED if f not in config]
  if absent:
    raise ValueError(f'config.json lacks {", ".join(absent)}.')
  for field, fixed in FIXED.items():
    value = config.get(field, fixed)
    if value is not None and value != fixed and not (
        isinstance(fixed, float) and math.isclose(value, fixed)):
      raise ValueError(
          f'config.json: {field} is {value!r}; the network fixes {fixed!r}.')
  num_decoder_layers = config.get('num_decoder_layers')
  if num_decoder_layers is None:
    num_decoder_layers = config['num_layers']  # transformers' default
  for field, value in (('num_layers', config['num_layers']),
                       ('num_decoder_layers', num_decoder_layers)):
    if value < 1:
      raise ValueError(f'config.json: {field} is {value}; each stack needs '
                       'a layer (its first holds the relative-position '
                       'bias).')
  cfg = network.T5Config(
      vocab_size=int(config['vocab_size']),
      emb_dim=int(config['d_model']),
      num_heads=int(config['num_heads']),
      head_dim=int(config['d_kv']),
      mlp_dim=int(config['d_ff']),
      num_encoder_layers=int(config['num_layers']),
      num_decoder_layers=int(num_decoder_layers),
      mlp_activations=activations(config.get('feed_forward_proj', 'relu')),
      dropout_rate=float(config.get('dropout_rate', 0.1)),
      # transformers ties (and scales the decoder output) unless false.
      logits_via_embedding=config.get('tie_word_embeddings', True) is not False,
      num_tasks=num_tasks,
  )
  network.check_config(cfg)
  return cfg


def to_hf(cfg: network.T5Config) -> dict[str, Any]:
  """`network.T5Config` -> transformers' T5 `config.json`.

  Args:
    cfg: the network's config.

  Returns:
    The config.json's dict.

  Raises:
    ValueError: activations transformers' T5 has no name for.
  """
  acts = tuple(cfg.mlp_activations)
  gated = len(acts) == 2 and acts[1] == 'linear'
  if not (len(acts) == 1 or gated) or acts[0] not in _HF_ACTIVATION:
    raise ValueError(
        f'T5Config.mlp_activations {acts} has no transformers '
        "feed_forward_proj: it has ('relu',), ('gelu',), ('silu',) and "
        "their gated forms (('gelu', 'linear'), ...).")
  name = _HF_ACTIVATION[acts[0]]
  for field in ('num_encoder_layers', 'num_decoder_layers'):
    if getattr(cfg, field) < 1:
      raise ValueError(f'T5Config.{field} is {getattr(cfg, field)}: '
                       "transformers' T5 keeps the relative-position bias "
                       'in a stack\'s first layer.')
  return {
      'architectures': ['T5ForConditionalGeneration'],
      'model_type': 't5',
      'is_encoder_decoder': True,
      'vocab_size': cfg.vocab_size,
      'd_model': cfg.emb_dim,
      'd_kv': cfg.head_dim,
      'd_ff': cfg.mlp_dim,
      'num_heads': cfg.num_heads,
      'num_layers': cfg.num_encoder_layers,
      'num_decoder_layers': cfg.num_decoder_layers,
      'feed_forward_proj': ('gated-gelu' if gated and name == 'gelu_new'
                            else f'gated-{name}' if gated else name),
      'tie_word_embeddings': bool(cfg.logits_via_embedding),
      'dropout_rate': cfg.dropout_rate,
      'initializer_factor': 1.0,
      'eos_token_id': 1,
      'use_cache': True,
      'torch_dtype': 'float32',
      **FIXED,
  }


def gin_text(cfg: network.T5Config, source: str) -> str:
  """The model gin file of `cfg`, like `gin/models/*.gin`.

  Args:
    cfg: the network's config.
    source: what the model was converted from, for the file's header.

  Returns:
    The gin text, for a run file to include before a variant.
  """
  acts = ', '.join(repr(a) for a in cfg.mlp_activations)
  acts = f'({acts},)' if len(cfg.mlp_activations) == 1 else f'({acts})'
  return f"""# The T5 of {source}, converted by python -m hyperprompt_jax.convert.
#
# Required to be set: nothing.
# Commonly overridden:
#   DROPOUT_RATE      (default: config.json's dropout_rate).
#   ACTIVATION_DTYPE  (default 'bfloat16', as the shipped models).
#
# Include first, then a variant (gin/variants/) and a run file; start from
# the converted checkpoint with INITIAL_CHECKPOINT_PATH.
from __gin__ import dynamic_registration

from hyperprompt_jax.model import network

DROPOUT_RATE = {cfg.dropout_rate!r}
ACTIVATION_DTYPE = 'bfloat16'

network.Transformer.config = @network.T5Config()
network.T5Config:
  vocab_size = {cfg.vocab_size}
  dtype = %ACTIVATION_DTYPE
  emb_dim = {cfg.emb_dim}
  num_heads = {cfg.num_heads}
  num_encoder_layers = {cfg.num_encoder_layers}
  num_decoder_layers = {cfg.num_decoder_layers}
  head_dim = {cfg.head_dim}
  mlp_dim = {cfg.mlp_dim}
  mlp_activations = {acts}
  dropout_rate = %DROPOUT_RATE
  logits_via_embedding = {bool(cfg.logits_via_embedding)}
  float32_attention_logits = False
"""
