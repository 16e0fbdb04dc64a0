"""The one name table between t5x's T5 parameters and transformers' T5.

Both directions (`to_t5x`, `to_hf`) are read from `table`, so a name or a
layout is written once. What the table encodes:

- Linear layers: t5x's kernel `[in, out]` is the transpose of PyTorch's
  `nn.Linear` weight `[out, in]`. Neither scales the attention logits by
  1 / sqrt(head_dim): both fold it into the query's initialisation, so
  trained query kernels map unchanged.
- The relative-position bias: t5x's `relpos_bias/rel_embedding
  [heads, buckets]` per stack is the transpose of transformers'
  `block.0.layer.0.SelfAttention.relative_attention_bias`, which every
  block reuses.
- Layer norms (RMS, scale only): `pre_*_layer_norm/scale` is the
  `layer.<k>.layer_norm.weight` of the sublayer it precedes; the stacks'
  final norms are `final_layer_norm`.
- The FFN: T5.1.1's gated GELU has `wi_0`, `wi_1`, T5 v1.0's ReLU `wi`;
  both have `wo`.
- `token_embedder/embedding [vocab, embed]` is `shared.weight` as is (the
  stacks' `embed_tokens` are tied to it). Untied output logits (T5.1.1,
  mT5, Flan-T5), `decoder/logits_dense/kernel [embed, vocab]`, are the
  transpose of `lm_head.weight`; T5 v1.0 ties them to the embedding
  (`logits_via_embedding`, transformers' `tie_word_embeddings`).
"""

import dataclasses
from typing import Mapping

import numpy as np

# transformers' names that may appear beside `table`'s without being
# parameters of their own: the tied copies of `shared.weight` (checked equal
# to it), and a cross-attention bias table old T5 checkpoints carry that
# transformers itself ignores (its `_keys_to_ignore_on_load_unexpected`).
TIED_COPIES = ('encoder.embed_tokens.weight', 'decoder.embed_tokens.weight')
IGNORED = ('decoder.block.0.layer.1.EncDecAttention.'
           'relative_attention_bias.weight',)
EMBEDDING = 'shared.weight'
LM_HEAD = 'lm_head.weight'


@dataclasses.dataclass(frozen=True)
class Backbone:
  """The dimensions that decide the T5 parameters' names and shapes.

  Attributes:
    vocab_size: number of token ids.
    emb_dim: d_model.
    num_heads: attention heads.
    head_dim: width of each head.
    mlp_dim: FFN hidden width.
    num_encoder_layers: encoder layers.
    num_decoder_layers: decoder layers.
    gated: `wi_0` / `wi_1` (two activations) instead of `wi`.
    tied: logits through the embedding: no `logits_dense` / `lm_head`.
    num_buckets: relative-position buckets.
  """

  vocab_size: int
  emb_dim: int
  num_heads: int
  head_dim: int
  mlp_dim: int
  num_encoder_layers: int
  num_decoder_layers: int
  gated: bool
  tied: bool
  num_buckets: int = 32

  @classmethod
  def of(cls, cfg) -> 'Backbone':
    """The backbone of a `network.T5Config`."""
    return cls(cfg.vocab_size, cfg.emb_dim, cfg.num_heads, cfg.head_dim,
               cfg.mlp_dim, cfg.num_encoder_layers, cfg.num_decoder_layers,
               len(cfg.mlp_activations) > 1, bool(cfg.logits_via_embedding))

  def size(self, dim: str) -> int:
    """The size of a dimension named in `Entry.dims`."""
    return {'vocab': self.vocab_size, 'embed': self.emb_dim,
            'heads': self.num_heads, 'joined': self.num_heads * self.head_dim,
            'mlp': self.mlp_dim, 'buckets': self.num_buckets}[dim]


@dataclasses.dataclass(frozen=True)
class Entry:
  """One backbone parameter in both namings.

  Attributes:
    t5x: its t5x path, '/'-joined.
    hf: its transformers name.
    transposed: whether transformers stores the transpose.
    dims: t5x's shape in dimension names (`Backbone.size`).
  """

  t5x: str
  hf: str
  transposed: bool
  dims: tuple[str, ...]

  def t5x_shape(self, backbone: Backbone) -> tuple[int, ...]:
    """The shape t5x stores."""
    return tuple(backbone.size(d) for d in self.dims)

  def hf_shape(self, backbone: Backbone) -> tuple[int, ...]:
    """The shape transformers stores."""
    shape = self.t5x_shape(backbone)
    return shape[::-1] if self.transposed else shape


# (t5x, transformers, transposed, t5x dims): once per model.
_MODEL = (
    ('token_embedder/embedding', EMBEDDING, False, ('vocab', 'embed')),
    ('encoder/relpos_bias/rel_embedding',
     'encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight',
     True, ('heads', 'buckets')),
    ('encoder/encoder_norm/scale', 'encoder.final_layer_norm.weight', False,
     ('embed',)),
    ('decoder/relpos_bias/rel_embedding',
     'decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight',
     True, ('heads', 'buckets')),
    ('decoder/decoder_norm/scale', 'decoder.final_layer_norm.weight', False,
     ('embed',)),
)
_UNTIED = (('decoder/logits_dense/kernel', LM_HEAD, True, ('embed', 'vocab')),)
# An attention block: t5x's projection, transformers' Linear.
_ATTENTION = (('query/kernel', 'q.weight', True, ('embed', 'joined')),
              ('key/kernel', 'k.weight', True, ('embed', 'joined')),
              ('value/kernel', 'v.weight', True, ('embed', 'joined')),
              ('out/kernel', 'o.weight', True, ('joined', 'embed')))
_GATED_MLP = (('wi_0/kernel', 'wi_0.weight', True, ('embed', 'mlp')),
              ('wi_1/kernel', 'wi_1.weight', True, ('embed', 'mlp')),
              ('wo/kernel', 'wo.weight', True, ('mlp', 'embed')))
_RELU_MLP = (('wi/kernel', 'wi.weight', True, ('embed', 'mlp')),
             ('wo/kernel', 'wo.weight', True, ('mlp', 'embed')))
# A layer of each stack: (t5x sublayer, transformers sublayer) pairs; an
# attention block or the MLP expands to its projections, a norm is a scale.
_ENCODER_LAYER = (
    ('pre_attention_layer_norm/scale', 'layer.0.layer_norm.weight'),
    ('attention', 'layer.0.SelfAttention'),
    ('pre_mlp_layer_norm/scale', 'layer.1.layer_norm.weight'),
    ('mlp', 'layer.1.DenseReluDense'),
)
_DECODER_LAYER = (
    ('pre_self_attention_layer_norm/scale', 'layer.0.layer_norm.weight'),
    ('self_attention', 'layer.0.SelfAttention'),
    ('pre_cross_attention_layer_norm/scale', 'layer.1.layer_norm.weight'),
    ('encoder_decoder_attention', 'layer.1.EncDecAttention'),
    ('pre_mlp_layer_norm/scale', 'layer.2.layer_norm.weight'),
    ('mlp', 'layer.2.DenseReluDense'),
)


def table(backbone: Backbone) -> list[Entry]:
  """Every backbone parameter of a model of this shape, in both namings."""
  entries = [Entry(*row) for row in _MODEL]
  if not backbone.tied:
    entries += [Entry(*row) for row in _UNTIED]
  mlp = _GATED_MLP if backbone.gated else _RELU_MLP
  for stack, layer, count in (
      ('encoder', _ENCODER_LAYER, backbone.num_encoder_layers),
      ('decoder', _DECODER_LAYER, backbone.num_decoder_layers)):
    for i in range(count):
      for ours, theirs in layer:
        t5x, hf = f'{stack}/layers_{i}/{ours}', f'{stack}.block.{i}.{theirs}'
        if ours.endswith('/scale'):
          entries.append(Entry(t5x, hf, False, ('embed',)))
          continue
        for t5x_name, hf_name, transposed, dims in (
            mlp if ours == 'mlp' else _ATTENTION):
          entries.append(Entry(f'{t5x}/{t5x_name}', f'{hf}.{hf_name}',
                               transposed, dims))
  return entries


# Each dimension by the config fields that set it, for the messages.
_HF_FIELDS = {'vocab': 'vocab_size', 'embed': 'd_model', 'heads': 'num_heads',
              'joined': 'num_heads * d_kv', 'mlp': 'd_ff',
              'buckets': 'relative_attention_num_buckets'}
_T5X_FIELDS = {'vocab': 'vocab_size', 'embed': 'emb_dim',
               'heads': 'num_heads', 'joined': 'num_heads * head_dim',
               'mlp': 'mlp_dim', 'buckets': 'relative-position buckets'}


def _listed(names, limit: int = 6) -> str:
  """The first `limit` sorted names, for a message."""
  names = sorted(names)
  more = f' ... ({len(names)} in all)' if len(names) > limit else ''
  return ', '.join(names[:limit]) + more


def _convert(array: np.ndarray, transposed: bool) -> np.ndarray:
  """`array` as contiguous float32, transposed if asked."""
  # bfloat16 / float16 files widen exactly; contiguous for the writers.
  array = np.asarray(array)
  if array.dtype != np.float32:
    array = array.astype(np.float32)
  return np.ascontiguousarray(array.T if transposed else array)


def to_t5x(tensors: Mapping[str, np.ndarray], backbone: Backbone,
           source: str = 'the safetensors') -> dict[str, np.ndarray]:
  """transformers' T5 tensors -> t5x's flat '/'-keyed parameters (float32).

  Args:
    tensors: `{name: array}` as `safetensors.numpy` reads them.
    backbone: the shape `config.json` gives (`model_config`).
    source: names the tensors' origin in errors.

  Returns:
    `{'encoder/layers_0/attention/query/kernel': [embed, joined], ...}`.

  Raises:
    ValueError: missing tensors, tensors T5 of this config lacks, a shape
      other than the config's, a tied copy that differs from the embedding.
  """
  entries = table(backbone)
  wanted = {e.hf for e in entries}
  allowed = set(TIED_COPIES) | set(IGNORED)
  if backbone.tied:
    allowed.add(LM_HEAD)  # some files keep the tied output layer's copy
  missing = wanted - set(tensors)
  if missing:
    raise ValueError(
        f'{source} lacks {len(missing)} tensors that config.json '
        f'({_describe(backbone)}) needs: {_listed(missing)}. Check '
        'feed_forward_proj (gated: wi_0 / wi_1; relu: wi), '
        'tie_word_embeddings (false needs lm_head.weight) and the layer '
        'counts.')
  extra = set(tensors) - wanted - allowed
  if extra:
    raise ValueError(
        f'{source} holds {len(extra)} tensors that T5 with config.json '
        f'({_describe(backbone)}) does not have: {_listed(extra)}. Is '
        'config.json the one of these weights (feed_forward_proj, '
        'num_layers, num_decoder_layers, tie_word_embeddings)?')
  _check_shapes(entries, backbone, {e.hf: tensors[e.hf] for e in entries},
                lambda e: e.hf, Entry.hf_shape, _HF_FIELDS, source)
  for copy in [c for c in (*TIED_COPIES, LM_HEAD) if c in tensors
               and c not in wanted]:
    if not np.array_equal(np.asarray(tensors[copy]),
                          np.asarray(tensors[EMBEDDING])):
      raise ValueError(
          f'{source}: {copy} differs from {EMBEDDING}, but the project ties '
          f'it to the token embedding'
          + ('; set tie_word_embeddings to false in config.json if the '
             'output layer is its own' if copy == LM_HEAD else '') + '.')
  return {e.t5x: _convert(tensors[e.hf], e.transposed) for e in entries}


def to_hf(params: Mapping[str, np.ndarray], backbone: Backbone,
          source: str = 'the checkpoint') -> dict[str, np.ndarray]:
  """t5x's flat '/'-keyed backbone parameters -> transformers' T5 tensors.

  Args:
    params: the backbone's parameters (no task-conditioned ones).
    backbone: the model's shape (`Backbone.of(T5Config)`).
    source: names the parameters' origin in errors.

  Returns:
    `{transformers name: float32 array}`, one `shared.weight` for the tied
    embedding copies.

  Raises:
    ValueError: missing or unexpected parameters, a shape other than the
      model's.
  """
  entries = table(backbone)
  wanted = {e.t5x for e in entries}
  missing, extra = wanted - set(params), set(params) - wanted
  if missing or extra:
    found = ([f'missing {_listed(missing)}'] if missing else []) + (
        [f'unexpected {_listed(extra)}'] if extra else [])
    raise ValueError(
        f'{source} is not the backbone of the gin model '
        f'({_describe(backbone, t5x=True)}): {"; ".join(found)}. Give the '
        'gin files the checkpoint was trained with.')
  _check_shapes(entries, backbone, params, lambda e: e.t5x, Entry.t5x_shape,
                _T5X_FIELDS, source)
  return {e.hf: _convert(params[e.t5x], e.transposed) for e in entries}


def _check_shapes(entries, backbone, arrays, name, shape_of, fields, source):
  """Raises ValueError naming every array of another shape than its entry's."""
  wrong = []
  for e in entries:
    got, want = tuple(np.shape(arrays[name(e)])), shape_of(e, backbone)
    if got != want:
      flip = shape_of is Entry.hf_shape and e.transposed
      dims = e.dims[::-1] if flip else e.dims
      wrong.append(f'{name(e)} is {list(got)}, the config gives {list(want)} '
                   f"([{', '.join(fields[d] for d in dims)}])")
  if wrong:
    raise ValueError(f'{source}: {len(wrong)} shapes do not match the '
                     f'config: ' + '; '.join(wrong[:4])
                     + (' ...' if len(wrong) > 4 else ''))


def _describe(b: Backbone, t5x: bool = False) -> str:
  """The backbone's shape in words, in t5x's or transformers' fields."""
  if t5x:
    return (f'vocab_size {b.vocab_size}, emb_dim {b.emb_dim}, num_heads '
            f'{b.num_heads}, head_dim {b.head_dim}, mlp_dim {b.mlp_dim}, '
            f'{b.num_encoder_layers} + {b.num_decoder_layers} layers, '
            f"{'gated' if b.gated else 'single'} FFN, "
            f"{'tied' if b.tied else 'untied'} logits")
  return (f'd_model {b.emb_dim}, {b.num_encoder_layers} + '
          f'{b.num_decoder_layers} layers, '
          f"{'gated' if b.gated else 'relu'} FFN, "
          f"{'tied' if b.tied else 'untied'} lm_head")
