"""Task conditioning of a stack, handed to its layers one object per layer.

The backbone (`network.py`) knows one interface: each stack builds a
`StackConditioning` once per forward, from the configuration, the stack,
the task ids and the token validity, and gives layer m its
`LayerConditioning`: the self-attention's key/value prefix (HyperPrompt),
the cross-attention's (experimental), the adapters of its sublayers
(Vanilla Adapter, HyperFormer++) and the gating of its FFN (HyperGrid,
Output Gating). Prompt-Tuning's soft prompts enter at the stack's input.
Each method's equations live in its own module; this file only wires them:
a new method touches its module, the registry (`methods.py`) and this file.

Per-task work is done here once per forward for all T tasks (hyper-prompts
`[layers, T, l, heads, head_dim]`, generated adapters) and gathered by task
id, so its cost does not grow with the batch.

Task ids come in two shapes. Unpacked rows (one example per row): `[batch]`.
Packed rows (several examples per row, `segment_ids` given): per token,
`[batch, length]` like the tokens, one id per segment; each token is then
conditioned by its own example's task: its task's prompt columns only
(`hyperprompt.packed_prompt_attention`), its task's adapter, its task's
soft prompt in the slots the packer reserved, its example's HyperGrid /
Output Gating gates (one conditioning vector per segment, from that
segment's tokens only; at most
`HyperGridConfig.max_segments` segments a row).
"""

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

from flax import linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hyperprompt_jax.methods import adapters as adapters_lib
from hyperprompt_jax.methods import hyperformer as hyperformer_lib
from hyperprompt_jax.methods import hypergrid as hypergrid_lib
from hyperprompt_jax.methods import hyperprompt as hyperprompt_lib
from hyperprompt_jax.methods import prompt_tuning as prompt_tuning_lib
from hyperprompt_jax.t5 import inputs as inputs_lib
from hyperprompt_jax.t5 import layers

Array = jax.Array


class Prompts(NamedTuple):
  """One layer's attention prefix: keys and values `[batch, l, heads,
  head_dim]` (None at decode steps, where they live in the cache), the
  optional `[heads]` logit bias and, for packed rows, HyperPrompt's
  attention over each query's own task's prompts (keys and values then hold
  every task's prompts, `[T, l, heads, head_dim]`)."""

  keys: Optional[Array]
  values: Optional[Array]
  logit_bias: Optional[Array]
  attention: Optional[hyperprompt_lib.OwnTaskPrompts] = None

  def as_kwargs(self) -> dict[str, Any]:
    kwargs = dict(prefix_key=self.keys, prefix_value=self.values,
                  prefix_logit_bias=self.logit_bias)
    if self.attention is not None:
      kwargs['prefix_attention'] = self.attention
    return kwargs


@dataclasses.dataclass(frozen=True)
class LayerConditioning:
  """What one layer receives from its stack's task conditioning.

  Attributes:
    prompts: the self-attention's key/value prefix (HyperPrompt).
    cross_attention_prompts: whether a decoder layer also prefixes its
      encoder-decoder attention with `prompts` (experimental option).
    adapters: the layer's `adapters.LayerAdapters` (after the attention and
      FFN sublayers; none after the cross-attention).
    gating: the stack's `hypergrid.StackGating` (HyperGrid, Output Gating).
    gates: the layer's FFN gates, once its gating attention made them
      (`attend`).
  """

  prompts: Optional[Prompts] = None
  cross_attention_prompts: bool = False
  adapters: Optional[adapters_lib.LayerAdapters] = None
  gating: Optional[hypergrid_lib.StackGating] = None
  gates: Optional[hypergrid_lib.FfnGates] = None

  def self_attention_prefix(self) -> dict[str, Any]:
    """Keyword arguments of the self-attention's key/value prefix."""
    return {} if self.prompts is None else self.prompts.as_kwargs()

  def cross_attention_prefix(self, layer: nn.Module) -> dict[str, Any]:
    """The same prompts for the encoder-decoder attention when
    `cross_attention_prompts` is on (at decode steps read back from `layer`'s
    self-attention cache)."""
    if self.prompts is None or not self.cross_attention_prompts:
      return {}
    prompts = self.prompts
    if prompts.keys is None:
      cache = layer.variables['cache']['self_attention']
      prompts = prompts._replace(keys=cache['cached_prefix_key'],
                                 values=cache['cached_prefix_value'])
    return prompts.as_kwargs()

  @property
  def attention_class(self) -> type[layers.MultiHeadDotProductAttention]:
    """The class of the attention the layer's FFN gates come from (encoder:
    the self-attention, decoder: the encoder-decoder attention)."""
    if self.gating is None:
      return layers.MultiHeadDotProductAttention
    return self.gating.attention_class

  def attend(self, attention: nn.Module, norm: nn.Module, inputs_q: Array,
             inputs_kv: Array, mask, bias, *,
             first_token: Callable[[], Array], deterministic: bool,
             **prefix) -> tuple[Array, 'LayerConditioning']:
    """Runs that attention; with gating, its FFN gates come back inside the
    returned conditioning (the layer's FFN is then `ffn`'s gated block).

    Args:
      attention: the layer's attention, of class `attention_class`.
      norm: the layer norm in front of it.
      inputs_q, inputs_kv, mask, bias, deterministic, prefix: its inputs.
      first_token: `() -> [batch, embed]`, HyperGrid's first_token
        conditioning vector.

    Returns:
      The attention output and the layer's conditioning with its gates.
    """
    if self.gating is None:
      return attention(inputs_q, inputs_kv, mask, bias,
                       deterministic=deterministic, **prefix), self
    out, gates = self.gating.attend(
        attention, norm, inputs_q, inputs_kv, mask, bias,
        first_token=first_token, deterministic=deterministic, **prefix)
    return out, dataclasses.replace(self, gates=gates)

  def ffn(self, **kwargs) -> nn.Module:
    """The layer's FFN block (`layers.MlpBlock`'s arguments): gated by the
    layer's gates once `attend` made them."""
    if self.gates is None:
      return layers.MlpBlock(**kwargs)
    return hypergrid_lib.GatedMlpBlock(gates=self.gates, **kwargs)

  def adapt(self, y: Array, kind: str) -> Array:
    """A sublayer's output `y` through its `kind` adapter, if any."""
    return y if self.adapters is None else self.adapters(y, kind)


# A pytree (its arrays the leaves), so that a layer under `nn.remat`
# (T5Config.remat_policy) takes it as an argument like any array.
jax.tree_util.register_dataclass(
    LayerConditioning, data_fields=['prompts', 'adapters', 'gating', 'gates'],
    meta_fields=['cross_attention_prompts'])

NONE = LayerConditioning()


def check_task_ids(cfg, task_ids, tokens: Array,
                   segment_ids: Optional[Array] = None) -> Optional[Array]:
  """Checks the task ids against the tokens and their values against
  `[0, num_tasks)`; returns them as an array.

  Unpacked: int32 `[batch]`. Packed (`segment_ids` given): int32 `[batch,
  length]` like `tokens`, one id per segment, and every configured method
  must support packed rows. A list or numpy array of ids is converted with
  `jnp.asarray`.

  Concrete ids are checked here, on the host. Traced ids (inside `jax.jit`,
  `jax.grad`, a decoding loop, t5x's steps) are checked by the compiled
  program, on any platform and mesh (`_call_on_host`), which then fails
  with a `jax.errors.JaxRuntimeError` carrying the same message: an
  out-of-range gather would otherwise clamp (another task's output) or fill
  NaN, silently. Off with `T5Config.check_traced_task_ids = False`, where
  every batch is validated on the host first (`network.checked_on_host`:
  the built-in runner's steps and decodes, t5x's steps behind the project's
  feature converter), since a host callback keeps a program out of JAX's
  persistent compilation cache and off its fast dispatch.

  Returns:
    `task_ids` as an array (None stays None).

  Raises:
    ValueError: ids of the wrong type, shape or dtype, or concrete ids out of
      range.
  """
  packed = segment_ids is not None
  if packed:
    if tuple(segment_ids.shape) != tuple(tokens.shape):
      raise ValueError(f'segment ids {tuple(segment_ids.shape)} must have the '
                       f'shape of the tokens {tuple(tokens.shape)}.')
  if task_ids is None:
    return None
  if not isinstance(task_ids, jax.Array):
    given = task_ids
    try:
      # numpy, not jnp: under tracing jnp.asarray makes concrete ids a
      # tracer, which would move their check into the compiled program.
      task_ids = np.asarray(given)
      if task_ids.dtype == object:
        raise TypeError('not an array of numbers')
    except (TypeError, ValueError) as e:
      raise ValueError(
          'task_ids must be an int32 array (or a list of ints), got '
          f'{type(given).__name__}: {e}') from e
  expected = tuple(tokens.shape) if packed else tokens.shape[:1]
  if tuple(task_ids.shape) != expected:
    if packed:
      raise ValueError(
          'Packed rows (segment ids given) take per-token task ids int32 '
          f'[batch, length] = {list(expected)}, got shape '
          f'{tuple(task_ids.shape)}: pass encoder_task_ids / decoder_task_ids '
          'as the feature converter makes them with pack=True.')
    raise ValueError(
        f'task_ids must be int32 [batch] = [{expected[0]}], got shape '
        f'{tuple(task_ids.shape)}' + (
            ' (per-token ids need the segment ids of packed rows)'
            if task_ids.ndim == 2 else '') + '.')
  if not jnp.issubdtype(task_ids.dtype, jnp.integer):
    raise ValueError(f'task_ids must be integers, got {task_ids.dtype}.')
  if task_ids.size == 0:
    return task_ids
  if isinstance(task_ids, jax.core.Tracer):
    if cfg.check_traced_task_ids:
      _check_in_graph(cfg.num_tasks, task_ids)
    return task_ids
  ids = np.asarray(task_ids)  # concrete: check on the host, outside tracing
  _check_task_id_range(cfg.num_tasks, ids.min(), ids.max())
  if packed and not isinstance(segment_ids, jax.core.Tracer):
    inputs_lib.check_one_task_per_segment('task_ids', ids,
                                          np.asarray(segment_ids))
  return task_ids


def check_segments(cfg, segment_ids: Optional[Array]) -> None:
  """Packed rows of a model that gates per example (HyperGrid, Output
  Gating): at most `max_segments` examples a row, each contiguous
  (`inputs.check_segments`). Concrete ids are checked on the host; traced
  ones by the compiled program (the bound only), as task ids are
  (`check_task_ids`), unless `check_traced_task_ids` is off."""
  bound = hypergrid_lib.max_segments(cfg.hypergrid)
  if segment_ids is None or bound is None or segment_ids.size == 0:
    return
  if not isinstance(segment_ids, jax.core.Tracer):
    inputs_lib.check_segments('segment_ids', np.asarray(segment_ids), bound)
  elif cfg.check_traced_task_ids:
    high = jnp.max(segment_ids)
    _raise_in_graph(high > bound,
                    functools.partial(_check_segment_bound, bound), high)


def _check_segment_bound(bound: int, high) -> None:
  """The compiled side of `check_segments` (under `vmap`, `high` may come
  batched)."""
  inputs_lib.check_segment_bound('segment_ids', int(np.max(high)), bound)


def _check_in_graph(num_tasks: int, task_ids: Array) -> None:
  """Makes the compiled program call `_check_task_id_range` on the host when
  traced `task_ids` leave `[0, num_tasks)`."""
  low, high = jnp.min(task_ids), jnp.max(task_ids)
  _raise_in_graph((low < 0) | (high >= num_tasks),
                  functools.partial(_check_task_id_range, num_tasks), low,
                  high)


def _raise_in_graph(bad: Array, check: Callable[..., None],
                    *values: Array) -> None:
  """Makes the compiled program call `check(*values)` on the host when the
  traced scalar `bad` holds; its raise fails the call with a
  `JaxRuntimeError` carrying the message.

  A host callback, not checkify, which would need every caller (t5x's
  steps, a user's own `jit`) to wrap its function. The `cond` keeps Python
  off the device path for valid inputs (decode loops run it every step).
  """
  jax.lax.cond(bad, lambda: _call_on_host(check, *values), lambda: None)


def _call_on_host(check: Callable[..., None], *values: Array) -> None:
  """`check(*values)` on the host, in the form the compiled platform takes
  (picked where the program is lowered: a CPU host may compile for a TPU).

  CPU, GPU: `partitioned`: every device calls it with the reduced
  (replicated) scalars and fails alike; one device failing alone would
  leave the others waiting at their next collective (on an 8-device CPU
  mesh: 40 s, then XLA aborts the process). JAX lowers no partitioned
  callback for a TPU (`NotImplementedError`), so there the program's first
  device calls it: the host answers that device whether the callback raised
  or not (XLA's `pjrt/host_callback.cc`), so no device waits on it, and the
  raise fails the call (on a multi-host slice, in that device's process).
  Compiled for TPU slices here (`tests/test_task_id_checks.py`), not run on
  one.
  """

  def call(partitioned: bool) -> Callable[[], None]:
    return lambda: jax.debug.callback(check, *values, partitioned=partitioned)

  jax.lax.platform_dependent(tpu=call(False), default=call(True))


def _check_task_id_range(num_tasks: int, low, high) -> None:
  """Raises ValueError unless the ids from `low` to `high` lie in `[0,
  num_tasks)` (host side of `check_task_ids`, also its compiled callback;
  under `vmap` `low` and `high` may come batched)."""
  low, high = int(np.min(low)), int(np.max(high))
  if low < 0 or high >= num_tasks:
    raise ValueError(
        f'task_ids must lie in [0, num_tasks) = [0, {num_tasks}), got ids '
        f'from {low} to {high}. Raise NUM_TASKS (T5Config.num_tasks) or fix '
        'the task list.')


def input_valid(cfg, encoder_input_tokens: Array, packed: bool = False
                ) -> Array:
  """`[batch, n + length]` valid positions of the encoder's output (n:
  Prompt-Tuning's soft tokens, always valid, else 0; packed rows hold the
  prompts in reserved slots, so n = 0 there)."""
  if packed:
    return encoder_input_tokens > 0
  return prompt_tuning_lib.extend_valid(cfg.prompt_tuning,
                                        encoder_input_tokens > 0)


class StackConditioning:
  """The task conditioning of one stack for one forward (or decode step).

  Construct it inside the stack's compact `__call__`: the stack-level
  parameters (hyper-prompt generators, adapter tables, HyperGrid's task
  embedding, Prompt-Tuning's prompts) are created in the stack's scope.

  Args:
    module: the stack (`network.Encoder` / `network.Decoder`).
    stack: 'encoder' or 'decoder'.
    num_layers: the stack's layers.
    task_ids: int32 `[batch]`; packed rows: `[batch, length]`, each token's
      task; None for a model without conditioning.
    token_valid: `[batch, length]`, the columns HyperGrid's task query sees
      (the encoder's tokens; for the decoder, `encoded`'s).
    packed: the rows are packed (decided by the network from the segment
      ids): task ids are per token.
    decode: the decoder runs against its autoregressive cache.
    positions: packed encoder rows: `[batch, length]` position of each token
      in its example (Prompt-Tuning's slots are positions `0..n-1`).
    segment_ids: packed rows: `[batch, length]`, the stack's tokens'
      segments (HyperGrid gates each segment by its own example).
    kv_segment_ids: packed rows: `[batch, kv_length]`, the segments of the
      columns of `token_valid` (the encoder's tokens).
  """

  def __init__(self, module: nn.Module, stack: str, num_layers: int,
               task_ids: Optional[Array], token_valid: Optional[Array],
               packed: bool = False, decode: bool = False,
               positions: Optional[Array] = None,
               segment_ids: Optional[Array] = None,
               kv_segment_ids: Optional[Array] = None):
    cfg = module.config
    self.config = cfg
    self.stack = stack
    self.task_ids = task_ids
    self.packed = packed
    self._positions = positions
    self._token_valid = token_valid
    # Once the cache exists, everything that depends only on the task (and
    # `encoded`) is read from it: no generation at decode steps.
    cache_ready = decode and 'cache' in module.variables
    self._prompts = _generate_prompts(cfg, stack, num_layers,
                                      generate=not cache_ready)
    self._prompt_attention = None
    if packed and self._prompts is not None:
      self._prompt_attention = hyperprompt_lib.packed_prompt_attention(
          task_ids, cfg.num_tasks,
          hyperprompt_lib.prompt_length_for(cfg.hyperprompt, stack),
          cfg.hyperprompt.packed_form, cfg.gradient_form)
    self._adapters = _adapter_weights(cfg, stack, num_layers)
    self._gating = _gating(cfg, stack, task_ids, token_valid, decode,
                           cache_ready, segment_ids if packed else None,
                           kv_segment_ids if packed else None)

  def inputs(self, embedded: Array) -> Array:
    """The stack's embedded inputs with Prompt-Tuning's soft prompts (encoder):
    in front, `[batch, length, embed]` -> `[batch, n + length, embed]`, or,
    packed, in each example's reserved slots (shape unchanged)."""
    cfg = self.config
    if self.stack != 'encoder' or cfg.prompt_tuning is None:
      return embedded
    prompts = prompt_tuning_lib.TaskPrompts(
        cfg.prompt_tuning, cfg.num_tasks, cfg.emb_dim, name='prompt_tuning')
    if not self.packed:
      return prompts(embedded, self.task_ids)
    if self._positions is None:
      raise ValueError(
          'Packed Prompt-Tuning needs encoder_positions (the soft prompt '
          'fills positions 0..n-1 of each packed example): pass the '
          'converter\'s encoder_positions.')
    return prompts(embedded, self.task_ids, self._positions,
                   self._token_valid)

  def layer(self, m: int) -> LayerConditioning:
    """Layer m's conditioning."""
    prompts = None
    if self._prompts is not None:
      keys, values, logit_bias = self._prompts
      bias = None if logit_bias is None else logit_bias[m]
      if self.packed:
        # Every task's prompts `[T, l, heads, head_dim]`; each query attends
        # over its own task's (`hyperprompt.packed_prompt_attention`).
        prompts = Prompts(keys[m], values[m], bias, self._prompt_attention)
      else:
        if keys is not None:
          keys, values = hyperprompt_lib.gather_prompts(keys, values, m,
                                                        self.task_ids)
        prompts = Prompts(keys, values, bias)
    adapters = None
    if self._adapters is not None:
      weights, activation, packed_form = self._adapters
      adapters = adapters_lib.LayerAdapters(weights[m], self.task_ids,
                                            activation, self.packed,
                                            self.config.gradient_form,
                                            packed_form)
    hp = self.config.hyperprompt
    return LayerConditioning(
        prompts=prompts,
        cross_attention_prompts=bool(hp and hp.cross_attention_prompts),
        adapters=adapters,
        gating=self._gating)


def _generate_prompts(cfg, stack: str, num_layers: int, generate: bool):
  """HyperPrompt's `(keys, values, logit_bias)` of all T tasks and layers,
  generated once (keys / values None when `generate` is off: decode steps
  read them from the attention caches); None without hyper-prompts."""
  length = hyperprompt_lib.prompt_length_for(cfg.hyperprompt, stack)
  if length == 0:
    return None
  return hyperprompt_lib.HyperPromptGenerator(
      config=cfg.hyperprompt,
      num_tasks=cfg.num_tasks,
      num_layers=num_layers,
      prompt_length=length,
      emb_dim=cfg.emb_dim,
      num_heads=cfg.num_heads,
      head_dim=cfg.head_dim,
      dtype=cfg.dtype,
      name='hyperprompt',
  )(generate=generate)


def _adapter_weights(cfg, stack: str, num_layers: int):
  """`(weights, activation, packed_form)` of the stack's adapters,
  `weights[m]` layer m's `{kind: AdapterWeights [tasks, ...]}`
  (`adapters.per_layer`): Vanilla adapters are parameters, HyperFormer++
  generates them once per forward for all T tasks. None without
  adapters."""
  if adapters_lib.is_active(cfg.adapter, stack):
    weights = adapters_lib.VanillaAdapters(
        cfg.adapter, cfg.num_tasks, num_layers, cfg.emb_dim, name='adapter')()
    method = cfg.adapter
  elif adapters_lib.is_active(cfg.hyperformer, stack):
    weights = hyperformer_lib.HyperFormerGenerator(
        cfg.hyperformer, cfg.num_tasks, num_layers, cfg.emb_dim,
        dtype=cfg.dtype, name='hyperformer')()
    method = cfg.hyperformer
  else:
    return None
  return (adapters_lib.per_layer(weights), method.activation,
          method.packed_form)


def _gating(cfg, stack: str, task_ids, token_valid, decode: bool,
            cache_ready: bool, segment_ids: Optional[Array] = None,
            kv_segment_ids: Optional[Array] = None
            ) -> Optional[hypergrid_lib.StackGating]:
  """HyperGrid's per-stack gating, or None when inactive. Packed rows
  (`segment_ids` given) get one task vector per segment, its example's."""
  hg = cfg.hypergrid
  if not hypergrid_lib.is_active(hg, stack):
    return None
  if segment_ids is not None and (kv_segment_ids is None or decode):
    raise ValueError('Packed HyperGrid gates need the encoder\'s segment ids '
                     'and cannot decode.')
  task_vectors = None
  if hg.conditioning == 'task_attention' and not cache_ready:
    if segment_ids is not None:
      task_ids = hypergrid_lib.segment_task_ids(task_ids, segment_ids,
                                                hg.max_segments)
    task_vectors = hypergrid_lib.TaskEmbedding(
        cfg.num_tasks, cfg.emb_dim, name=hypergrid_lib.scope_name(hg))(
            task_ids)
  return hypergrid_lib.StackGating(hg, cfg.emb_dim, cfg.mlp_dim,
                                   task_vectors, token_valid, decode,
                                   segment_ids, kv_segment_ids)
