"""HyperPrompt (He et al., ICML 2022): hypernetwork-generated task prompts.

Every self-attention layer m of a stack gets, per task tau, `l` key and `l`
value vectors prepended after its K/V projections (Eqs. 1-2):

    K' = [P^m_{tau,k}; K],   V' = [P^m_{tau,v}; V],   P^m [l, heads, head_dim]

generated from a per-task global prompt P_tau [l, d] by a bottleneck
hypernetwork (Eqs. 3-4): P^m_{tau,k} = U^m_k(ReLU(D^m_k(P_tau))), with
D [d, b] and U [b, heads * head_dim], where

- **Share**: one (D, U) per layer, shared by the tasks;
- **Sep**: one (D, U) per layer and task (Eqs. 5-6);
- **Global**: (D, U) generated per layer and task by global hypernetworks
  W^{D_k}, W^{D_v} [t, d*b] and W^{U_k}, W^{U_v} [t, b*heads*head_dim] from a
  layer-aware task embedding I^m_tau = h_t([k_tau; z_m]) (Eqs. 7-8), with task
  embeddings k [T, t'], layer embeddings z [M, t'] and the task projector h_t
  = Dense(2t' -> e), ReLU, Dense(e -> t).

Where the paper is silent or loose: one P_tau feeds both the key and the
value hypernetworks, as Eqs. 3-6 write it (Sec. 3.3's prose says
"P_{tau,k/v}"); encoder and decoder have separate everything, as their
prompt lengths differ (Sec. 4.7) and App. A.1 counts one stack's parameters;
no biases or layer norms by default, so the parameter formula (Sec. 3.4,
App. A.1) is exact; the flattened W^D I is read row-major as [d, b] and
W^U I as [b, heads * head_dim] (a fixed order keeps checkpoints
compatible). All T tasks' prompts are computed once per forward
(`[layers, T, l, heads, head_dim]`) and gathered by task id, so their cost
does not grow with the batch.

Initialisation (the paper gives none): P_tau, k_tau, z_m ~ N(0, 1) like T5's
token embeddings; D, U and h_t fan-in scaled like T5's dense layers; the
global hypernetworks scaled so the generated D and U have fan-in variance
(1/d, 1/b), which makes prompt keys about as large as token keys at step 0.
"""

import functools
from typing import Any, Optional

from flax import linen as nn
from flax import struct
import jax
from jax import lax
import jax.numpy as jnp

from hyperprompt_jax.t5 import layers
from hyperprompt_jax.t5 import task_blocks as task_blocks_lib
from hyperprompt_jax.t5 import traced_mesh

Array = jax.Array
VARIANTS = ('share', 'sep', 'global', 'none')
PLACEMENTS = ('both', 'encoder', 'decoder')
PACKED_FORMS = ('auto', 'task_blocks', 'all_tasks')

# Read by `methods.REGISTRY`: the T5Config field of the config, parameter
# scopes, logical axis names, gin variant files, `check` and `is_active`.
CONFIG_FIELD = 'hyperprompt'
SCOPES = ('hyperprompt',)
AXIS_NAMES = ('tasks', 'prompt_length', 'hyper_layers', 'hyper_bottleneck',
              'task_embed', 'task_hidden')
VARIANT_FILES = ('variants/hyperprompt_share.gin',
                 'variants/hyperprompt_sep.gin',
                 'variants/hyperprompt_global.gin')


@struct.dataclass
class HyperPromptConfig:
  """HyperPrompt's settings (gin: `hyperprompt.HyperPromptConfig`).

  See gin/variants/hyperprompt_*.gin.

  Attributes:
    variant: 'share', 'sep', 'global' or 'none'.
    placement: the stacks with prompts: 'both', 'encoder' or 'decoder'.
    encoder_prompt_length: l in the encoder.
    decoder_prompt_length: l in the decoder.
    hypernet_reduction: r; the bottleneck is b = d / r.
    task_embed_dim: t', width of the task and layer embeddings.
    task_hidden_dim: e, hidden width of the task projector h_t.
    layer_task_embed_dim: t, width of I^m_tau.
    use_bias: biases in D / U, h_t and W^{D,U} (off: not in the paper's
      parameter formula).
    use_layer_norm: layer norm on the hypernetwork input (off, as above).
    learned_prompt_bias: per-layer, per-head logit bias on the prompt
      columns (off, as above).
    cross_attention_prompts: experimental, not in the paper: also prepend
      each decoder layer's prompts to its encoder-decoder attention.
    packed_form: how packed rows' queries reach their own task's prompts,
      with the same results (`resolve_packed_form`): 'task_blocks',
      'all_tasks' or 'auto'.
  """

  variant: str = 'global'
  placement: str = 'both'
  encoder_prompt_length: int = 16
  decoder_prompt_length: int = 6
  hypernet_reduction: int = 32
  task_embed_dim: int = 64
  task_hidden_dim: int = 128
  layer_task_embed_dim: int = 64
  use_bias: bool = False
  use_layer_norm: bool = False
  learned_prompt_bias: bool = False
  cross_attention_prompts: bool = False
  packed_form: str = 'auto'


def check_hyperprompt_config(cfg: HyperPromptConfig, emb_dim: int) -> None:
  """Raises ValueError on settings that cannot build HyperPrompt."""
  if cfg.variant not in VARIANTS:
    raise ValueError(f'HyperPromptConfig.variant must be one of {VARIANTS}, '
                     f'got {cfg.variant!r}.')
  if cfg.placement not in PLACEMENTS:
    raise ValueError(f'HyperPromptConfig.placement (PLACEMENT) must be one of '
                     f'{PLACEMENTS}, got {cfg.placement!r}.')
  check_packed_form(cfg.packed_form)
  for name in ('encoder_prompt_length', 'decoder_prompt_length'):
    if getattr(cfg, name) < 0:
      raise ValueError(f'HyperPromptConfig.{name} must be >= 0, got '
                       f'{getattr(cfg, name)}.')
  r = cfg.hypernet_reduction
  if r <= 0 or emb_dim % r:
    raise ValueError(
        f'HYPERNET_REDUCTION={r} must be a positive divisor of d_model='
        f'{emb_dim} (the bottleneck is b = d / r).'
    )
  for name in ('task_embed_dim', 'task_hidden_dim', 'layer_task_embed_dim'):
    if getattr(cfg, name) <= 0:
      raise ValueError(f'HyperPromptConfig.{name} must be positive.')


def check(cfg: HyperPromptConfig, model_config: Any) -> None:
  """Raises ValueError on settings that cannot build HyperPrompt."""
  check_hyperprompt_config(cfg, model_config.emb_dim)


def is_active(cfg: Optional[HyperPromptConfig], stack: str) -> bool:
  """Whether `stack` gets hyper-prompts."""
  return prompt_length_for(cfg, stack) > 0


def prompt_length_for(cfg: Optional[HyperPromptConfig], stack: str) -> int:
  """Prompt length of `stack` ('encoder' | 'decoder'); 0 when it has none."""
  if cfg is None or cfg.variant == 'none':
    return 0
  if cfg.placement not in ('both', stack):
    return 0
  return (cfg.encoder_prompt_length if stack == 'encoder'
          else cfg.decoder_prompt_length)


def _normal(stddev: float):
  """A normal initialiser."""
  return nn.initializers.normal(stddev=stddev)


def _fan_in(fan_in: int):
  """A normal initialiser of variance 1 / `fan_in`."""
  return _normal(fan_in ** -0.5)


class HyperPromptGenerator(nn.Module):
  """The hyper-prompts of one stack, for all tasks and layers.

  Parameters (under `<stack>/hyperprompt/`), with T tasks, M layers, l the
  prompt length, d = emb_dim, b = d / r, j = heads * head_dim:
    global_prompts [T, l, d]
    share:  {key,value}_down [M, d, b], {key,value}_up [M, b, j]
    sep:    {key,value}_down [T, M, d, b], {key,value}_up [T, M, b, j]
    global: task_embeddings [T, t'], layer_embeddings [M, t'],
            task_projector/{hidden [2t', e], output [e, t]},
            {key,value}_down_generator [t, d*b], {key,value}_up_generator
            [t, b*j]

  Attributes:
    config: the `HyperPromptConfig`.
    num_tasks: T.
    num_layers: M.
    prompt_length: l.
    emb_dim: d.
    num_heads: attention heads.
    head_dim: width of each head.
    dtype: dtype of the prompts.
  """

  config: HyperPromptConfig
  num_tasks: int
  num_layers: int
  prompt_length: int
  emb_dim: int
  num_heads: int
  head_dim: int
  dtype: Any = jnp.float32

  def _param(self, name, init, shape, axes):
    """A float32 parameter with logical `axes`, cast to `dtype`."""
    return jnp.asarray(
        layers.param_with_axes(name, init, shape, jnp.float32, axes=axes),
        self.dtype,
    )

  @nn.compact
  def __call__(self, generate: bool = True):
    """Returns `(keys, values, logit_bias)`.

    Args:
      generate: False skips the hypernetworks (decode steps read the prompts
        from the cache) and returns `(None, None, logit_bias)`.

    Returns:
      keys, values: `[layers, tasks, prompt_length, heads, head_dim]`.
      logit_bias: `[layers, heads]` learned bias on the prompt columns, or
        None.
    """
    cfg = self.config
    logit_bias = None
    if cfg.learned_prompt_bias:
      logit_bias = self._param('prompt_logit_bias', nn.initializers.zeros,
                               (self.num_layers, self.num_heads),
                               ('hyper_layers', 'heads'))
    if not generate:
      return None, None, logit_bias
    t_, m, l, d = self.num_tasks, self.num_layers, self.prompt_length, (
        self.emb_dim)
    b = d // cfg.hypernet_reduction
    j = self.num_heads * self.head_dim
    prompts = self._param('global_prompts', _normal(1.0), (t_, l, d),
                          ('tasks', 'prompt_length', 'embed'))
    if cfg.use_layer_norm and cfg.variant != 'global':
      prompts = layers.LayerNorm(dtype=self.dtype, name='prompt_norm')(prompts)

    if cfg.variant == 'global':
      down, up = self._global_hypernetworks(b, j)
      hypernets = {'key': (down[0], up[0]), 'value': (down[1], up[1])}
    else:
      lead = (m,) if cfg.variant == 'share' else (t_, m)
      lead_axes = (('hyper_layers',) if cfg.variant == 'share'
                   else ('tasks', 'hyper_layers'))
      hypernets = {
          kind: (
              self._param(f'{kind}_down', _fan_in(d), lead + (d, b),
                          lead_axes + ('embed', 'hyper_bottleneck')),
              self._param(f'{kind}_up', _fan_in(b), lead + (b, j),
                          lead_axes + ('hyper_bottleneck', 'joined_kv')),
          )
          for kind in ('key', 'value')
      }

    out = []
    for kind in ('key', 'value'):
      down, up = hypernets[kind]
      out.append(self._local_hypernetwork(kind, prompts, down, up, b, j))
    return out[0], out[1], logit_bias

  def _local_hypernetwork(self, kind, prompts, down, up, b, j):
    """Eqs. (3)-(6): U(ReLU(D(P_tau))) for every layer and task.

    Args:
      kind: 'key' or 'value'.
      prompts: `[T, l, d]` global prompts P_tau.
      down: D, `[M, d, b]` (shared by tasks) or `[T, M, d, b]`.
      up: U, `[M, b, j]` or `[T, M, b, j]`.
      b: bottleneck width.
      j: heads * head_dim.

    Returns:
      `[M, T, l, heads, head_dim]`.
    """
    if down.ndim == 3:  # Share
      hidden = jnp.einsum('tld,mdb->mtlb', prompts, down)
    else:
      hidden = jnp.einsum('tld,tmdb->mtlb', prompts, down)
    if self.config.use_bias:
      hidden = hidden + self._param(
          f'{kind}_down_bias', nn.initializers.zeros,
          (self.num_layers, b), ('hyper_layers', 'hyper_bottleneck'),
      )[:, None, None]
    hidden = jax.nn.relu(hidden)
    if up.ndim == 3:
      out = jnp.einsum('mtlb,mbj->mtlj', hidden, up)
    else:
      out = jnp.einsum('mtlb,tmbj->mtlj', hidden, up)
    if self.config.use_bias:
      out = out + self._param(
          f'{kind}_up_bias', nn.initializers.zeros,
          (self.num_layers, j), ('hyper_layers', 'joined_kv'),
      )[:, None, None]
    return out.reshape(out.shape[:-1] + (self.num_heads, self.head_dim))

  def _global_hypernetworks(self, b, j):
    """Eqs. (7)-(8): per-task, per-layer (D, U) from I^m_tau.

    Returns:
      `((D_k, D_v), (U_k, U_v))` with D `[T, M, d, b]` and U `[T, M, b, j]`.
    """
    cfg = self.config
    t_, m, d = self.num_tasks, self.num_layers, self.emb_dim
    te, th, t = (cfg.task_embed_dim, cfg.task_hidden_dim,
                 cfg.layer_task_embed_dim)
    task_emb = self._param('task_embeddings', _normal(1.0), (t_, te),
                           ('tasks', 'task_embed'))
    layer_emb = self._param('layer_embeddings', _normal(1.0), (m, te),
                            ('hyper_layers', 'task_embed'))
    # [T, M, 2t'] = [k_tau; z_m] for every (task, layer) pair.
    pairs = jnp.concatenate([
        jnp.broadcast_to(task_emb[:, None], (t_, m, te)),
        jnp.broadcast_to(layer_emb[None], (t_, m, te)),
    ], axis=-1)
    task_embedding = self._task_projector(pairs, 2 * te, th, t)  # [T, M, t]

    def generate(name, out_dim, fan_in):
      # Scaled so the generated matrix has fan-in variance 1 / fan_in.
      w = self._param(f'{name}_generator', _normal((t * fan_in) ** -0.5),
                      (t, out_dim), ('task_embed', 'hyper_bottleneck'))
      y = jnp.einsum('tmi,io->tmo', task_embedding, w)
      if cfg.use_bias:
        y = y + self._param(f'{name}_generator_bias', nn.initializers.zeros,
                            (out_dim,), ('hyper_bottleneck',))
      return y

    downs = tuple(generate(f'{k}_down', d * b, d).reshape(t_, m, d, b)
                  for k in ('key', 'value'))
    ups = tuple(generate(f'{k}_up', b * j, b).reshape(t_, m, b, j)
                for k in ('key', 'value'))
    return downs, ups

  def _task_projector(self, x, in_dim, hidden_dim, out_dim):
    """h_t: Dense(2t' -> e), ReLU, Dense(e -> t) [, layer norm]."""
    cfg = self.config
    # Logical axes: t' and t are `task_embed`, the hidden width e is
    # `task_hidden` (an array may not name one axis twice).
    for name, (fan_in, width), axes in (
        ('hidden', (in_dim, hidden_dim), ('task_embed', 'task_hidden')),
        ('output', (hidden_dim, out_dim), ('task_hidden', 'task_embed'))):
      kernel = self._param(f'task_projector_{name}', _fan_in(fan_in),
                           (fan_in, width), axes)
      x = x @ kernel
      if cfg.use_bias:
        x = x + self._param(f'task_projector_{name}_bias',
                            nn.initializers.zeros, (width,), axes[1:])
      if name == 'hidden':
        x = jax.nn.relu(x)
    if cfg.use_layer_norm:
      x = layers.LayerNorm(dtype=self.dtype, name='task_projector_norm')(x)
    return x


def gather_prompts(keys: Array, values: Array, layer: int,
                   task_ids: Optional[Array]) -> tuple[Array, Array]:
  """Layer `layer`'s prompts for each example: `[batch, l, heads, head_dim]`.

  Args:
    keys: `[layers, tasks, l, heads, head_dim]` from HyperPromptGenerator.
    values: same shape as keys.
    layer: the layer index m.
    task_ids: int32 `[batch]`.

  Returns:
    `(keys, values)` of the examples' tasks.
  """
  if task_ids is None:
    raise ValueError(
        'HyperPrompt needs task_ids (int32 [batch]) but none were given: pass '
        'task_ids to encode / decode / __call__ (the feature converter adds '
        'them).'
    )
  return (task_blocks_lib.take_tasks(keys[layer], task_ids),
          task_blocks_lib.take_tasks(values[layer], task_ids))


def check_packed_form(form: str) -> None:
  """Raises ValueError on an unknown `HyperPromptConfig.packed_form`."""
  if form not in PACKED_FORMS:
    raise ValueError(f'HyperPromptConfig.packed_form={form!r}; expected one '
                     f'of {list(PACKED_FORMS)}.')


def resolve_packed_form(form: str) -> str:
  """'task_blocks' or 'all_tasks' for a `HyperPromptConfig.packed_form`.

  'auto' is 'task_blocks' on a CPU, else 'all_tasks', which on a TPU moves
  fewer bytes and holds fewer temporaries at a few more FLOPs
  (docs/performance.md, "On a TPU slice, from this host").
  """
  check_packed_form(form)
  if form == 'auto':
    return ('task_blocks' if traced_mesh.target_platform() == 'cpu'
            else 'all_tasks')
  return form


def packed_prompt_attention(token_task_ids: Array, num_tasks: int,
                            prompt_length: int, packed_form: str = 'auto',
                            gradient_form: str = 'auto') -> 'OwnTaskPrompts':
  """Packed rows' prompt attention, shared by a stack's layers.

  Each token must see exactly its own task's `l` prompt columns.
  'task_blocks' lays the queries out in blocks of one task and scores each
  block against its task's prompts only; a block of c queries costs a copy
  of `2 l` prompt rows and each task pads up to c - 1 positions, so
  c = sqrt(2 l N / T), N a data shard's tokens (`task_blocks.block_size`).
  'all_tasks' scores each query against all `T * l` columns and masks all
  but its own: T times the prompts' work, no permutation of the queries.

  Args:
    token_task_ids: int32 `[batch, length]`, each token's task.
    num_tasks: T.
    prompt_length: l.
    packed_form: `HyperPromptConfig.packed_form`.
    gradient_form: `T5Config.gradient_form` of the blocks' gathers.

  Returns:
    The layers' `prefix_attention`.
  """
  if resolve_packed_form(packed_form) == 'all_tasks':
    return OwnTaskPrompts(query_tasks=token_task_ids)
  return OwnTaskPrompts(blocks=task_blocks_lib.batch_task_blocks(
      token_task_ids, num_tasks, 2 * prompt_length, gradient_form))


@struct.dataclass
class OwnTaskPrompts:
  """Packed rows' `prefix_attention`: over `[own task's prompts; tokens]`.

  Prompts and tokens each get their own softmax, scaled by its share of the
  joint normaliser, exp(lse_block - lse), per query. Made by
  `packed_prompt_attention`.

  Attributes:
    blocks: the queries' task blocks ('task_blocks' form), or None.
    query_tasks: int32 `[batch, q_length]`, each query's task ('all_tasks'
      form), or None.
  """

  blocks: Optional[task_blocks_lib.TaskBlocks] = None
  query_tasks: Optional[Array] = None

  def __call__(self, query: Array, logits: Array, value: Array,
               prefix_key: Array, prefix_value: Array,
               prefix_bias: Optional[Array],
               dropout: Optional[tuple[Array, float]], dtype: Any) -> Array:
    """Attention over `[own task's prompts; tokens]`.

    Args:
      query: `[batch, q_length, heads, head_dim]`.
      logits: the tokens' `[batch, heads, q_length, kv_length]`.
      value: the tokens' `[batch, kv_length, heads, head_dim]`.
      prefix_key: every task's prompt keys `[T, l, heads, head_dim]`.
      prefix_value: `[T, l, heads, head_dim]`.
      prefix_bias: optional bias broadcastable to `[1, heads, 1, 1]`.
      dropout: `(rng, rate)` or None.
      dtype: dtype of the attention weights and output.

    Returns:
      `[batch, q_length, heads, head_dim]`.
    """
    token_weights, token_lse = softmax_and_logsumexp(logits)
    token_weights = token_weights.astype(dtype)
    prefix_keep = None
    if dropout is not None:
      width = prefix_key.shape[0] * prefix_key.shape[1]
      keep = layers.dropout_keep(*dropout, dtype, token_weights.shape[:-2]
                                 + (1, width + token_weights.shape[-1]))
      prefix_keep, token_keep = keep[..., :width], keep[..., width:]
      token_weights = token_weights * token_keep
    if self.blocks is not None:
      prefix_out, prefix_lse = _own_task_prefix(
          query, prefix_key, prefix_value, prefix_bias, self.blocks,
          prefix_keep, dtype)
    else:
      prefix_out, prefix_lse = _all_tasks_prefix(
          query, prefix_key, prefix_value, prefix_bias, self.query_tasks,
          prefix_keep, dtype)
    lse = jnp.logaddexp(prefix_lse, token_lse)
    share = lambda block_lse: jnp.swapaxes(jnp.exp(block_lse - lse), 1, 2)
    out = (layers.attend_values(token_weights, value, dtype).astype(jnp.float32)
           * share(token_lse)
           + prefix_out.astype(jnp.float32) * share(prefix_lse))
    return out.astype(dtype)


@jax.custom_jvp
def softmax_and_logsumexp(x: Array) -> tuple[Array, Array]:
  """Softmax over the last axis and its log normaliser `[..., 1]`."""
  top = lax.stop_gradient(x.max(-1, keepdims=True))
  unnormalized = jnp.exp(x - top)
  total = unnormalized.sum(-1, keepdims=True)
  return unnormalized / total, jnp.log(total) + top


@softmax_and_logsumexp.defjvp
def _softmax_and_logsumexp_jvp(primals, tangents):
  """The derivative, written out as `jax.nn.softmax`'s is."""
  (x_dot,) = tangents
  y, lse = softmax_and_logsumexp(*primals)
  lse_dot = (y * x_dot).sum(-1, keepdims=True)
  return (y, lse), (y * (x_dot - lse_dot), lse_dot)


def _own_task_prefix(query: Array, keys: Array, values: Array,
                     logit_bias: Optional[Array],
                     blocks: task_blocks_lib.TaskBlocks,
                     keep: Optional[Array], dtype: Any
                     ) -> tuple[Array, Array]:
  """Each query's attention over its own task's prefix columns only.

  A block of one task's queries (`blocks`) is scored against that task's
  `l` columns only, not all `T * l` masked.

  Args:
    query: `[batch, q_length, heads, head_dim]`.
    keys: every task's prefix keys `[T, l, heads, head_dim]`.
    values: `[T, l, heads, head_dim]`.
    logit_bias: optional bias broadcastable to `[1, heads, 1, 1]`.
    blocks: the queries' task blocks.
    keep: dropout's scaled keep mask `[batch, heads, 1, T * l]`, or None.
    dtype: dtype of the attention weights and output.

  Returns:
    The prefix's output `[batch, q_length, heads, head_dim]` (its softmax
    over the `l` columns alone) and its log normaliser
    `[batch, heads, q_length, 1]`.
  """
  batch, length, heads, head_dim = query.shape
  num_tasks, prefix = keys.shape[:2]
  queries = blocks.to_blocks(query.reshape(batch * length, heads * head_dim))
  num_blocks, block = queries.shape[:2]
  queries = queries.reshape(num_blocks, block, heads, head_dim)
  logits = jnp.einsum(
      'kchd,klhd->khcl', queries,
      blocks.take(keys).astype(query.dtype))
  if logit_bias is not None:
    logits = logits + logit_bias.astype(logits.dtype)
  weights, lse = softmax_and_logsumexp(logits)  # [K, heads, block, l]
  weights = weights.astype(dtype)
  if keep is not None:
    # Each block position's row in its shard (the padding's is out of
    # range: 0) and task.
    shards = blocks.source.shape[0]
    by_row_task = keep[:, :, 0].reshape(batch, heads, num_tasks, prefix)
    by_row_task = by_row_task.transpose(0, 2, 1, 3).reshape(
        shards, batch // shards * num_tasks, heads, prefix)
    index = (blocks.source // length) * num_tasks + jnp.repeat(
        blocks.block_tasks, block, axis=1)
    position_keep = jax.vmap(
        lambda table, i: table.at[i].get(mode='fill', fill_value=0))(
            by_row_task, index)
    weights = weights * position_keep.reshape(
        num_blocks, block, heads, prefix).transpose(0, 2, 1, 3)
  out = jnp.einsum(
      'khcl,klhd->kchd', weights,
      blocks.take(values).astype(dtype))
  out = blocks.from_blocks(out.reshape(num_blocks, block, heads * head_dim))
  lse = blocks.from_blocks(lse[..., 0].transpose(0, 2, 1))  # [N, heads]
  return (out.reshape(batch, length, heads, head_dim),
          lse.reshape(batch, length, heads).transpose(0, 2, 1)[..., None])


# Rematerialised: the `[batch, heads, q_length, T * l]` logits and weights
# are recomputed from the kept query and prompts rather than held.
@functools.partial(jax.checkpoint, static_argnums=(6,))
def _all_tasks_prefix(query: Array, keys: Array, values: Array,
                      logit_bias: Optional[Array], query_tasks: Array,
                      keep: Optional[Array], dtype: Any
                      ) -> tuple[Array, Array]:
  """`_own_task_prefix` by masking all `T * l` columns to the query's task.

  Args:
    query: `[batch, q_length, heads, head_dim]`.
    keys: every task's prefix keys `[T, l, heads, head_dim]`.
    values: `[T, l, heads, head_dim]`.
    logit_bias: optional bias broadcastable to `[1, heads, 1, 1]`.
    query_tasks: int32 `[batch, q_length]`, each query's task.
    keep: dropout's scaled keep mask `[batch, heads, 1, T * l]`, or None.
    dtype: dtype of the attention weights and output.

  Returns:
    The prefix block's output `[batch, q_length, heads, head_dim]` and its
    softmax's log normaliser `[batch, heads, q_length, 1]`.
  """
  num_tasks, prefix, heads, head_dim = keys.shape
  columns = num_tasks * prefix
  logits = jnp.einsum(
      'bqhd,khd->bhqk', query,
      keys.reshape(columns, heads, head_dim).astype(query.dtype))
  if logit_bias is not None:
    logits = logits + logit_bias.astype(logits.dtype)
  own = query_tasks[:, None, :, None] == jnp.repeat(
      jnp.arange(num_tasks, dtype=query_tasks.dtype), prefix)
  # Finite (as every masked column's): a query of no task (padding) gets
  # no NaN.
  logits = jnp.where(own, logits,
                     jnp.asarray(layers.MASKED_LOGIT, logits.dtype))
  weights, lse = softmax_and_logsumexp(logits)  # [batch, heads, q, T * l]
  weights = weights.astype(dtype)
  if keep is not None:
    weights = weights * keep
  out = jnp.einsum('bhqk,khd->bqhd', weights,
                   values.reshape(columns, heads, head_dim).astype(dtype))
  return out, lse
