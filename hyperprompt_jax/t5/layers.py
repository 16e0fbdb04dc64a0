"""T5 building blocks with t5x's parameter names, shapes and logical axes.

t5x is not on the package index, so its `examples/t5/layers.py` cannot be
imported, and flax.linen's `DenseGeneral` / `Embed` store kernels in other
shapes without logical axes, which t5x checkpoints and t5x's partitioner
need. These layers re-implement T5.1.1's blocks with t5x's names, 2-D
storage shapes (`[embed, joined_kv]`, ...) and logical axis names.

The modules know nothing of task conditioning. Attention takes an optional
key/value prefix, `[batch, prefix, heads, head_dim]` prepended to the
projected keys and values (always visible, no mask, no position bias), and,
for a prefix whose columns a method picks per query, the method's own
attention over it (`PrefixAttention`). Methods subclass a block through its
small overridable steps (`DenseGeneral.kernel`, `MlpBlock.dense` /
`intermediate`, `MultiHeadDotProductAttention.projections` / `attend`),
keeping t5x's parameter names.
"""

import functools
import operator
from typing import (Any, Callable, Iterable, NamedTuple, Optional, Sequence,
                    Union)

from flax import linen as nn
from flax.linen import partitioning as nn_partitioning
import jax
from jax import lax
from jax.experimental import layout as jax_layout
import jax.numpy as jnp
import numpy as np

from hyperprompt_jax.t5 import traced_mesh

param_with_axes = nn_partitioning.param_with_axes
with_sharding_constraint = nn_partitioning.with_sharding_constraint

Array = jax.Array
DType = Any
Initializer = Callable[..., Array]

# A method's attention over `[prefix; tokens]` for a prefix whose columns it
# chooses per query: `(query [batch, q_length, heads, head_dim], logits
# [batch, heads, q_length, kv_length], value [batch, kv_length, heads,
# head_dim], prefix_key, prefix_value, prefix_bias, dropout (rng, rate) or
# None, dtype) -> [batch, q_length, heads, head_dim]`.
PrefixAttention = Callable[..., Array]

# Large negative logit for masked attention columns (as t5x).
MASKED_LOGIT = -1e10


def _as_tuple(x: Union[int, Iterable[int]]) -> tuple[int, ...]:
  """`x` as a tuple of ints."""
  return tuple(x) if isinstance(x, Iterable) else (x,)


@jax.custom_vjp
def gradient_laid_out_as_stored(kernel: Array) -> Array:
  """The identity, whose gradient is laid out as the kernel is stored.

  A TPU's layout assignment may give a kernel's gradient the layout its dot
  prefers and carry the update in it, copying each float32 kernel to that
  layout and back every step (docs/performance.md, "On a TPU slice, from
  this host"). Asked for row major, XLA transposes the bfloat16 gradient
  once instead; where it did already, this changes nothing.
  """
  return kernel


def _gradient_laid_out_fwd(kernel):
  return kernel, None


def _gradient_laid_out_bwd(_, gradient):
  return (_row_major(gradient),)


@jax.custom_batching.custom_vmap
def _row_major(x: Array) -> Array:
  """`x` constrained to the row-major layout."""
  row_major = jax_layout.Layout(major_to_minor=tuple(range(x.ndim)))
  return jax_layout.with_layout_constraint(x, row_major)


@_row_major.def_vmap
def _row_major_vmap(axis_size, in_batched, x):
  # The batch axis leads here; row major over all axes is the default
  # layout. JAX's own rule keeps the batch axis where it lies (e.g. third)
  # and asks for that axis as the most major: a program's output in that
  # layout reads back wrong on XLA:CPU when indexed eagerly
  # (test_network.py).
  del axis_size, in_batched
  return _row_major(x), True


gradient_laid_out_as_stored.defvjp(_gradient_laid_out_fwd,
                                   _gradient_laid_out_bwd)


class DenseGeneral(nn.Module):
  """Bias-free linear map over `axis`, its kernel stored 2-D as in t5x.

  Attributes:
    features: the output dims.
    axis: the input dims contracted.
    dtype: dtype of the computation.
    kernel_init: initialiser of the kernel, stored float32 as
      `[prod(in dims), prod(features)]` (attention `query/kernel`:
      `[embed, heads * head_dim]`) and reshaped for the product.
    kernel_axes: the kernel's two logical axes.
  """

  features: Union[int, Sequence[int]]
  axis: Union[int, Sequence[int]] = -1
  dtype: DType = jnp.float32
  kernel_init: Initializer = nn.initializers.variance_scaling(
      1.0, 'fan_in', 'truncated_normal'
  )
  kernel_axes: tuple[str, ...] = ()

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """`[..., *in dims]` -> `[..., *features]`."""
    features = _as_tuple(self.features)
    axis = tuple(a % inputs.ndim for a in _as_tuple(self.axis))
    in_dims = tuple(inputs.shape[a] for a in axis)
    kernel = gradient_laid_out_as_stored(self.kernel(inputs))
    inputs = jnp.asarray(inputs, self.dtype)
    kernel = jnp.asarray(kernel, self.dtype).reshape(in_dims + features)
    contract = (axis, tuple(range(len(axis))))
    return lax.dot_general(inputs, kernel, (contract, ((), ())))

  def kernel(self, inputs: Array) -> Array:
    """The float32 `[prod(in dims), prod(features)]` kernel parameter."""
    axis = tuple(a % inputs.ndim for a in _as_tuple(self.axis))
    in_size = int(np.prod([inputs.shape[a] for a in axis]))
    return param_with_axes(
        'kernel',
        self.kernel_init,
        (in_size, int(np.prod(_as_tuple(self.features)))),
        jnp.float32,
        axes=self.kernel_axes,
    )


class Embed(nn.Module):
  """Token embedding `[vocab, embed]`; `attend` gives tied output logits.

  Attributes:
    num_embeddings: vocabulary size.
    features: embedding width.
    dtype: dtype of the embedded tokens.
    attend_dtype: dtype of `attend`'s logits.
    embedding_init: initialiser of the table.
    one_hot: look up by a one-hot matmul, which partitions where a gather
      does not.
  """

  num_embeddings: int
  features: int
  dtype: DType = jnp.float32
  attend_dtype: DType = jnp.float32
  embedding_init: Initializer = nn.initializers.normal(stddev=1.0)
  one_hot: bool = True

  def setup(self):
    self.embedding = param_with_axes(
        'embedding',
        self.embedding_init,
        (self.num_embeddings, self.features),
        jnp.float32,
        axes=('vocab', 'embed'),
    )

  def __call__(self, tokens: Array) -> Array:
    """`[...]` int tokens -> `[..., embed]`."""
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f'Token ids must be integers, got {tokens.dtype}.')
    table = jnp.asarray(self.embedding, self.dtype)
    if self.one_hot:
      ids = lax.iota(jnp.int32, self.num_embeddings)
      return jnp.dot((tokens[..., None] == ids).astype(self.dtype), table)
    return table[tokens]

  def attend(self, query: Array) -> Array:
    """`[..., embed]` -> `[..., vocab]` logits against the embedding table."""
    return jnp.dot(query, jnp.asarray(self.embedding, self.attend_dtype).T)


class LayerNorm(nn.Module):
  """T5's RMS layer norm: scale only, no centring, no bias.

  Attributes:
    epsilon: added to the mean square.
    dtype: dtype of the output.
  """

  epsilon: float = 1e-6
  dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """Normalises `[..., embed]` over its last axis."""
    x = jnp.asarray(x, jnp.float32)
    scale = param_with_axes(
        'scale', nn.initializers.ones, (x.shape[-1],), jnp.float32,
        axes=('embed',),
    )
    y = x * lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True)
                      + self.epsilon)
    return jnp.asarray(y, self.dtype) * jnp.asarray(scale, self.dtype)


def relative_position_bucket(
    relative_position: np.ndarray,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> np.ndarray:
  """Mesh-TF / T5 bucketing of relative positions.

  Half the buckets are exact small distances, the rest logarithmic up to
  `max_distance`.

  Args:
    relative_position: int `memory_position - query_position`, any shape.
    bidirectional: spend half the buckets on each sign (encoder).
    num_buckets: number of buckets.
    max_distance: distance where the last bucket starts.

  Returns:
    The bucket of each position, shaped as `relative_position`.
  """
  ret = np.zeros_like(relative_position)
  n = -relative_position
  if bidirectional:
    num_buckets //= 2
    ret += (n < 0).astype(np.int32) * num_buckets
    n = np.abs(n)
  else:
    n = np.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  val_if_large = max_exact + (
      np.log(n.astype(np.float32) / max_exact + np.finfo(np.float32).eps)
      / np.log(max_distance / max_exact)
      * (num_buckets - max_exact)
  ).astype(np.int32)
  val_if_large = np.minimum(val_if_large, num_buckets - 1)
  return ret + np.where(is_small, n, val_if_large)


class RelativePositionBiases(nn.Module):
  """T5 relative-position attention bias, shared by all layers of a stack.

  Attributes:
    num_buckets: position buckets (`relative_position_bucket`).
    max_distance: distance where the last bucket starts.
    num_heads: attention heads.
    dtype: dtype of the bias.
    embedding_init: initialiser of the `[heads, buckets]` table.
    form: 'one_hot' (t5x's contraction with a `[buckets, qlen, klen]`
      one-hot), 'gather', or 'auto': gather on XLA:CPU, which is slow to
      fold the one-hot constant; one-hot elsewhere, where the gather's
      gradient is a scatter-add serialised by colliding atomics.
  """

  num_buckets: int
  max_distance: int
  num_heads: int
  dtype: DType = jnp.float32
  embedding_init: Initializer = nn.initializers.variance_scaling(
      1.0, 'fan_avg', 'uniform'
  )
  form: str = 'auto'

  @nn.compact
  def __call__(self, qlen: int, klen: int, bidirectional: bool = True):
    """Returns the `[1, heads, qlen, klen]` bias."""
    rel = np.arange(klen)[None, :] - np.arange(qlen)[:, None]
    buckets = relative_position_bucket(
        rel, bidirectional, self.num_buckets, self.max_distance
    )
    table = param_with_axes(
        'rel_embedding',
        self.embedding_init,
        (self.num_heads, self.num_buckets),
        jnp.float32,
        axes=('heads', 'relpos_buckets'),
    )
    form = self.form
    if form == 'auto':
      form = ('gather' if traced_mesh.target_platform() == 'cpu'
              else 'one_hot')
    if form == 'gather':
      values = jnp.take(jnp.asarray(table, self.dtype),
                        jnp.asarray(buckets, jnp.int32), axis=1)
    else:
      one_hot = (buckets[None] == np.arange(self.num_buckets)[:, None, None])
      values = jnp.einsum('hb,bqk->hqk', jnp.asarray(table, self.dtype),
                          jnp.asarray(one_hot, self.dtype))
    return values[None]


def activation(name_or_fn: Union[str, Callable]) -> Callable:
  """'linear', a flax.linen activation's name, or a function -> a function."""
  if name_or_fn == 'linear':
    return lambda x: x
  if isinstance(name_or_fn, str):
    if not hasattr(nn, name_or_fn):
      raise ValueError(
          f'Unknown MLP activation {name_or_fn!r}: use "linear" or the name '
          'of a flax.linen activation such as "relu" or "gelu".'
      )
    return getattr(nn, name_or_fn)
  return name_or_fn


class MlpBlock(nn.Module):
  """T5 FFN: `wi` (or gated `wi_0`, `wi_1`, ...) -> activation product -> `wo`.

  Attributes:
    intermediate_dim: hidden width.
    activations: one per `wi_*`; `('relu',)` is T5 v1.0's FFN,
      `('gelu', 'linear')` T5.1.1's gated GELU.
    intermediate_dropout_rate: dropout on the hidden activations.
    dtype: dtype of the computation.
    kernel_init: initialiser of the kernels.
  """

  intermediate_dim: int = 2048
  activations: Sequence[Union[str, Callable]] = ('relu',)
  intermediate_dropout_rate: float = 0.1
  dtype: DType = jnp.float32
  kernel_init: Initializer = nn.initializers.variance_scaling(
      1.0, 'fan_in', 'truncated_normal'
  )

  @nn.compact
  def __call__(self, inputs: Array, deterministic: bool = False) -> Array:
    """`[batch, length, embed]` -> `[batch, length, embed]`."""
    x = self.intermediate(inputs)
    x = nn.Dropout(rate=self.intermediate_dropout_rate, broadcast_dims=(-2,))(
        x, deterministic=deterministic
    )
    x = with_sharding_constraint(x, ('batch', 'length', 'mlp'))
    return self.dense('wo', inputs.shape[-1], ('mlp', 'embed'))(x)

  def intermediate(self, inputs: Array) -> Array:
    """Activated `wi_*` product: `[batch, length, embed]` -> `[..., mlp]`."""
    hidden = []
    for i, act in enumerate(self.activations):
      name = 'wi' if len(self.activations) == 1 else f'wi_{i}'
      h = self.dense(name, self.intermediate_dim, ('embed', 'mlp'))(inputs)
      hidden.append(activation(act)(h))
    return functools.reduce(operator.mul, hidden)

  def dense(self, name: str, features: int,
            kernel_axes: tuple[str, str]) -> nn.Module:
    """The FFN's projection `name` ('wi*' or 'wo')."""
    return DenseGeneral(features, dtype=self.dtype,
                        kernel_init=self.kernel_init, kernel_axes=kernel_axes,
                        name=name)


# Collection and name of the attention probabilities sown when `apply` is
# given `mutable=[PROBE_COLLECTION]`.
PROBE_COLLECTION = 'intermediates'
ATTENTION_WEIGHTS = 'attention_weights'


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    dropout_rng: Optional[Array] = None,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    dtype: DType = jnp.float32,
    float32_logits: bool = False,
    on_weights: Optional[Callable[[Array], None]] = None,
    prefix_key: Optional[Array] = None,
    prefix_value: Optional[Array] = None,
    prefix_bias: Optional[Array] = None,
    prefix_attention: Optional[PrefixAttention] = None,
) -> Array:
  """Unscaled dot-product attention (T5 folds 1/sqrt(d_h) into the query init).

  With a prefix, each query attends over `[prefix; key]` under one softmax,
  computed as two blocks sharing its max and normaliser, since concatenated
  columns would copy the bias and logits (docs/performance.md, "Packing").
  A prefix whose columns differ per query comes with the method's own
  `prefix_attention`, which replaces the joint softmax.

  Args:
    query: `[batch, q_length, heads, head_dim]`.
    key: `[batch, kv_length, heads, head_dim]`.
    value: `[batch, kv_length, heads, head_dim]`.
    bias: broadcastable to `[batch, heads, q_length, kv_length]`.
    dropout_rng: key for attention dropout (broadcast along the query axis).
    dropout_rate: attention dropout rate.
    deterministic: disables dropout.
    dtype: dtype of the attention weights and output.
    float32_logits: compute logits and softmax in float32.
    on_weights: called with the attention probabilities `[batch, heads,
      q_length, prefix + kv_length]` (before dropout), e.g. to `sow` them.
    prefix_key: optional `[batch or 1, prefix, heads, head_dim]` columns in
      front of `key` (batch 1: the same columns for every row).
    prefix_value: `[batch or 1, prefix, heads, head_dim]`, with `prefix_key`.
    prefix_bias: broadcastable to `[batch, heads, q_length, prefix]`.
    prefix_attention: the attention over `[prefix; key]` when the method
      that hands the prefix chooses each query's columns itself (its
      `prefix_key` / `prefix_value` need not be `[batch, prefix, ...]`);
      called with the query, the token logits and values, the prefix, the
      dropout `(rng, rate)` or None and `dtype` (`PrefixAttention`).

  Returns:
    `[batch, q_length, heads, head_dim]`.
  """
  if float32_logits:
    query = query.astype(jnp.float32)
    key = key.astype(jnp.float32)
    if prefix_key is not None:
      prefix_key = prefix_key.astype(jnp.float32)
  logits = _attention_logits(query, key, bias)
  dropout = (dropout_rng, dropout_rate) if (
      not deterministic and dropout_rate > 0.0) else None
  if prefix_attention is not None:
    if on_weights is not None:
      raise ValueError('The attention probe reads unpacked rows only.')
    return prefix_attention(query, logits, value, prefix_key, prefix_value,
                            prefix_bias, dropout, dtype)
  if prefix_key is None:
    blocks = [jax.nn.softmax(logits).astype(dtype)]
    values = [value]
  else:
    blocks = _joint_softmax(_attention_logits(query, prefix_key, prefix_bias),
                            logits, dtype)
    values = [prefix_value, value]
  if on_weights is not None:
    on_weights(jnp.concatenate(blocks, axis=-1))
  if dropout is not None:
    widths = [w.shape[-1] for w in blocks]
    keep = dropout_keep(*dropout, dtype,
                         blocks[-1].shape[:-2] + (1, sum(widths)))
    blocks = [w * k for w, k in zip(
        blocks, jnp.split(keep, np.cumsum(widths)[:-1], axis=-1))]
  out = attend_values(blocks[0], values[0], dtype)
  for weights, block_values in zip(blocks[1:], values[1:]):
    out = out + attend_values(weights, block_values, dtype)
  return out


def _attention_logits(query: Array, keys: Array,
                      keys_bias: Optional[Array]) -> Array:
  """Logits `[batch, heads, q_length, k_length]`; `keys` may have batch 1."""
  if keys.shape[0] == 1 and query.shape[0] != 1:
    logits = jnp.einsum('bqhd,khd->bhqk', query, keys[0])
  else:
    logits = jnp.einsum('bqhd,bkhd->bhqk', query, keys)
  if keys_bias is not None:
    logits = logits + keys_bias.astype(logits.dtype)
  return logits


def attend_values(weights: Array, values: Array, dtype: DType) -> Array:
  """Weighted `values` (batch or 1 rows): `[batch, q_length, heads, dim]`."""
  values = values.astype(dtype)
  if values.shape[0] == 1 and weights.shape[0] != 1:
    return jnp.einsum('bhqk,khd->bqhd', weights, values[0])
  return jnp.einsum('bhqk,bkhd->bqhd', weights, values)


def _joint_softmax(prefix_logits: Array, logits: Array, dtype: DType
                   ) -> list[Array]:
  """softmax([prefix_logits; logits]) as two blocks, without concatenating."""
  top = lax.stop_gradient(jnp.maximum(
      prefix_logits.max(-1, keepdims=True), logits.max(-1, keepdims=True)))
  prefix_exp, token_exp = jnp.exp(prefix_logits - top), jnp.exp(logits - top)
  total = (prefix_exp.sum(-1, keepdims=True)
           + token_exp.sum(-1, keepdims=True))
  return [(prefix_exp / total).astype(dtype),
          (token_exp / total).astype(dtype)]


def dropout_keep(rng: Array, rate: float, dtype: DType,
                  shape: tuple[int, ...]) -> Array:
  """Attention dropout's keep mask `shape`, scaled by 1 / keep probability.

  `shape` is `[batch, heads, 1, columns]`: broadcast along the queries, as
  in t5x.
  """
  keep_prob = 1.0 - rate
  keep = jax.random.bernoulli(rng, keep_prob, shape)
  return keep.astype(dtype) / jnp.asarray(keep_prob, dtype)


def mask_to_bias(mask: Optional[Array], dtype: DType) -> Optional[Array]:
  """`[..., q, k]` 0/1 mask -> additive bias (0 where visible)."""
  if mask is None:
    return None
  return jnp.where(mask > 0, 0.0, MASKED_LOGIT).astype(dtype)


class Projections(NamedTuple):
  """An attention's four kernels (`DenseGeneral` modules)."""

  query: nn.Module
  key: nn.Module
  value: nn.Module
  out: nn.Module


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head attention with t5x's `query/key/value/out` kernels.

  Decoding keeps t5x's cache layout (`cached_key` / `cached_value`
  `[batch, heads, head_dim, max_length]`, `cache_index`), so t5x's beam
  search handles it unchanged. A key/value prefix given when the cache is
  made is kept as `cached_prefix_key` / `cached_prefix_value`
  (`[batch, prefix, heads, head_dim]`) for every decode step.

  Attributes:
    num_heads: attention heads.
    head_dim: width of each head's queries, keys and values.
    dtype: dtype of the computation.
    dropout_rate: attention dropout rate.
    kernel_init: initialiser of the kernels.
    float32_logits: logits and softmax in float32.
  """

  num_heads: int
  head_dim: int
  dtype: DType = jnp.float32
  dropout_rate: float = 0.0
  kernel_init: Initializer = nn.initializers.variance_scaling(
      1.0, 'fan_in', 'normal'
  )
  float32_logits: bool = False

  @nn.compact
  def __call__(
      self,
      inputs_q: Array,
      inputs_kv: Array,
      mask: Optional[Array] = None,
      bias: Optional[Array] = None,
      *,
      prefix_key: Optional[Array] = None,
      prefix_value: Optional[Array] = None,
      prefix_logit_bias: Optional[Array] = None,
      prefix_attention: Optional[PrefixAttention] = None,
      decode: bool = False,
      deterministic: bool = False,
  ) -> Array:
    """Attends `inputs_q` over `[prefix; inputs_kv]`.

    Args:
      inputs_q: `[batch, q_length, embed]`.
      inputs_kv: `[batch, kv_length, embed]`.
      mask: `[batch, 1, q_length, kv_length]` 0/1 mask over the token columns.
      bias: `[1, heads, q_length, kv_length]` bias over the token columns.
      prefix_key: optional `[batch or 1, prefix, heads, head_dim]` keys
        prepended after the key projection (batch 1: shared by every row);
        always visible, zero position bias.
      prefix_value: `[batch or 1, prefix, heads, head_dim]`, with
        `prefix_key`.
      prefix_logit_bias: optional `[heads]` logit bias on the prefix columns
        (zero when None).
      prefix_attention: the method's own attention over a prefix whose
        columns it chooses per query (`dot_product_attention`); not at
        decode steps.
      decode: use (and on the first call, create) the autoregressive cache.
      deterministic: disables dropout.

    Returns:
      `[batch, q_length, embed]`.
    """
    out, _, _ = self.attend(
        self.projections(inputs_q.shape[-1]), inputs_q, inputs_kv, mask,
        bias, prefix_key=prefix_key, prefix_value=prefix_value,
        prefix_logit_bias=prefix_logit_bias,
        prefix_attention=prefix_attention,
        decode=decode, deterministic=deterministic)
    return out

  def projections(self, features: int) -> 'Projections':
    """The `query`, `key`, `value` and `out` (back to `features`) kernels."""
    dense = functools.partial(
        DenseGeneral,
        axis=-1,
        features=(self.num_heads, self.head_dim),
        kernel_axes=('embed', 'joined_kv'),
        dtype=self.dtype,
    )
    # T5 has no explicit 1/sqrt(head_dim) on the logits: it is folded into
    # the query initialiser (equivalent under Adafactor).
    depth_scaling = jnp.sqrt(self.head_dim).astype(jnp.float32)
    query_init = lambda *a: self.kernel_init(*a) / depth_scaling
    return Projections(
        query=dense(kernel_init=query_init, name='query'),
        key=dense(kernel_init=self.kernel_init, name='key'),
        value=dense(kernel_init=self.kernel_init, name='value'),
        out=DenseGeneral(
            features=features,
            axis=(-2, -1),
            kernel_init=self.kernel_init,
            kernel_axes=('joined_kv', 'embed'),
            dtype=self.dtype,
            name='out',
        ),
    )

  def attend(self, proj: 'Projections', inputs_q, inputs_kv, mask, bias, *,
             prefix_key=None, prefix_value=None, prefix_logit_bias=None,
             prefix_attention=None, decode=False, deterministic=False):
    """`__call__`'s output, with the token keys and values before the cache."""
    if (prefix_key is None) != (prefix_value is None):
      raise ValueError('prefix_key and prefix_value must be given together.')
    if prefix_key is None and prefix_logit_bias is not None and not decode:
      raise ValueError('prefix_logit_bias needs prefix_key / prefix_value.')
    if prefix_attention is not None and (decode or prefix_key is None):
      raise ValueError('prefix_attention needs prefix_key / '
                       'prefix_value and cannot decode.')
    query = proj.query(inputs_q)
    key = proj.key(inputs_kv)
    value = proj.value(inputs_kv)
    token_key, token_value = key, value
    axes = ('batch', 'length', 'heads', 'kv')
    query = with_sharding_constraint(query, axes)
    key = with_sharding_constraint(key, axes)
    value = with_sharding_constraint(value, axes)

    if decode:
      key, value, mask, bias, prefix_key, prefix_value = self._use_cache(
          query, key, value, mask, bias, prefix_key, prefix_value
      )

    attention_bias = mask_to_bias(mask, self.dtype)
    if bias is not None:
      attention_bias = (
          bias if attention_bias is None else attention_bias + bias
      )
    # The prefix columns get no causal or padding mask and no relative-
    # position bias: zero, or `prefix_logit_bias [heads]`.
    prefix_bias = None
    if prefix_logit_bias is not None:
      prefix_bias = prefix_logit_bias.astype(self.dtype)[None, :, None, None]

    dropout_rng = None
    if not deterministic and self.dropout_rate > 0.0:
      dropout_rng = self.make_rng('dropout')
    x = dot_product_attention(
        query,
        key,
        value,
        bias=attention_bias,
        dropout_rng=dropout_rng,
        dropout_rate=self.dropout_rate,
        deterministic=deterministic,
        dtype=self.dtype,
        float32_logits=self.float32_logits,
        # The attention probe (`probe.py`): only when the caller asks for
        # the collection, so a normal call traces nothing more.
        on_weights=(self._sow_weights
                    if self.is_mutable_collection(PROBE_COLLECTION) else None),
        prefix_key=prefix_key,
        prefix_value=prefix_value,
        prefix_bias=prefix_bias,
        prefix_attention=prefix_attention,
    )
    return proj.out(x), token_key, token_value

  def _sow_weights(self, weights: Array) -> None:
    """`[batch, heads, q_length, prefix + kv_length]`, prefix columns first."""
    self.sow(PROBE_COLLECTION, ATTENTION_WEIGHTS, weights)

  def _use_cache(self, query, key, value, mask, bias, prefix_key,
                 prefix_value):
    """Creates the cache (first call) or appends one step to it."""
    is_initialized = self.has_variable('cache', 'cached_key')
    # [batch, length, heads, head_dim] is cached as [batch, heads, head_dim,
    # length] (t5x's layout: a one-hot update instead of a scatter).
    swap = lambda s: s[:-3] + (s[-2], s[-1], s[-3])
    cached_key = self.variable(
        'cache', 'cached_key', jnp.zeros, swap(key.shape), key.dtype
    )
    cached_value = self.variable(
        'cache', 'cached_value', jnp.zeros, swap(value.shape), value.dtype
    )
    cache_index = self.variable(
        'cache', 'cache_index', lambda: jnp.array(0, dtype=jnp.int32)
    )
    has_prefix = prefix_key is not None or self.has_variable(
        'cache', 'cached_prefix_key'
    )
    if has_prefix:
      if prefix_key is None and not is_initialized:
        raise ValueError('A prefixed attention cache needs the prefix.')
      # Filled with the real prefix when the cache is created; read after.
      cached_prefix_key = self.variable(
          'cache', 'cached_prefix_key', lambda: prefix_key
      )
      cached_prefix_value = self.variable(
          'cache', 'cached_prefix_value', lambda: prefix_value
      )
    if not is_initialized:
      return key, value, mask, bias, prefix_key, prefix_value

    batch, heads, head_dim, length = cached_key.value.shape
    if query.shape != (batch, 1, heads, head_dim):
      raise ValueError(
          'Autoregressive cache shape error: expected query shape '
          f'{(batch, 1, heads, head_dim)}, got {query.shape}.'
      )
    cur = cache_index.value
    one_hot = jax.nn.one_hot(cur, length, dtype=key.dtype)
    key = cached_key.value + jnp.moveaxis(key, -3, -1) * one_hot
    value = cached_value.value + jnp.moveaxis(value, -3, -1) * one_hot
    cached_key.value, cached_value.value = key, value
    cache_index.value = cur + 1
    key = jnp.moveaxis(key, -1, -3)
    value = jnp.moveaxis(value, -1, -3)
    # The single query sees the positions decoded so far, not the zeros.
    step_mask = jnp.broadcast_to(
        jnp.arange(length) <= cur, (batch, 1, 1, length)
    )
    mask = step_mask if mask is None else jnp.logical_and(mask, step_mask)
    if bias is not None:
      # Row `cur` of the full [1, heads, length, length] bias.
      bias = lax.dynamic_slice_in_dim(bias, cur, 1, axis=-2)
    if has_prefix:
      prefix_key = cached_prefix_key.value
      prefix_value = cached_prefix_value.value
    return key, value, mask, bias, prefix_key, prefix_value


def make_attention_mask(
    query_input: Array,
    key_input: Array,
    pairwise_fn: Callable = jnp.multiply,
    dtype: DType = jnp.float32,
) -> Array:
  """`[batch, q]`, `[batch, k]` -> `[batch, 1, q, k]` mask."""
  mask = pairwise_fn(query_input[..., :, None], key_input[..., None, :])
  return mask[..., None, :, :].astype(dtype)


def combine_masks(*masks: Optional[Array], dtype: DType = jnp.float32):
  """Logical AND of the masks that are not None (None if all are)."""
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  return functools.reduce(jnp.logical_and, masks).astype(dtype)


def make_decoder_mask(
    decoder_target_tokens: Array,
    dtype: DType,
    decoder_segment_ids: Optional[Array] = None,
) -> Array:
  """Causal AND non-padding (AND same-segment) `[batch, 1, len, len]` mask."""
  idx = jnp.broadcast_to(
      jnp.arange(decoder_target_tokens.shape[-1]), decoder_target_tokens.shape
  )
  causal = make_attention_mask(idx, idx, jnp.greater_equal, dtype)
  valid = decoder_target_tokens > 0
  padding = make_attention_mask(valid, valid, dtype=dtype)
  segments = None
  if decoder_segment_ids is not None:
    segments = make_attention_mask(
        decoder_segment_ids, decoder_segment_ids, jnp.equal, dtype
    )
  return combine_masks(causal, padding, segments, dtype=dtype)
