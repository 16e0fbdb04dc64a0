"""Task conditioning of a stack, handed to its layers one object per layer.

Each stack of `network.py` builds a `StackConditioning` once per forward and
gives layer m its `LayerConditioning`: the self-attention's key/value prefix
(HyperPrompt), the cross-attention's (experimental), its sublayers' adapters
(Vanilla Adapter, HyperFormer++) and its FFN's gating (HyperGrid, Output
Gating). Prompt-Tuning's soft prompts enter at the stack's input. The
methods' equations live in their modules; this file only wires them, so a
new method touches its module, the registry (`methods.py`) and this file.

Per-task work is done once per forward for all T tasks (hyper-prompts
`[layers, T, l, heads, head_dim]`, generated adapters) and gathered by task
id, so its cost does not grow with the batch.

Task ids are `[batch]` on unpacked rows. On packed rows (`segment_ids`
given) they are per token, `[batch, length]`, one id per segment, and each
token is conditioned by its own example's task: its prompt columns
(`hyperprompt.packed_prompt_attention`), adapter, soft-prompt slots and
HyperGrid gates (one vector per segment, at most
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
  """One layer's attention prefix.

  Attributes:
    keys: `[batch, l, heads, head_dim]`; packed rows: every task's,
      `[T, l, heads, head_dim]`. None at decode steps (they are cached).
    values: as `keys`.
    logit_bias: optional `[heads]` bias of the prefix's logits.
    attention: packed rows: each query's attention over its own task's
      prompts.
  """

  keys: Optional[Array]
  values: Optional[Array]
  logit_bias: Optional[Array]
  attention: Optional[hyperprompt_lib.OwnTaskPrompts] = None

  def as_kwargs(self) -> dict[str, Any]:
    """The attention's `prefix_*` keyword arguments."""
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
    """The prefix of the encoder-decoder attention, if it takes `prompts`.

    At decode steps the prompts are read from `layer`'s self-attention cache.
    """
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
    """Class of the attention the FFN gates come from (decoder: the cross)."""
    if self.gating is None:
      return layers.MultiHeadDotProductAttention
    return self.gating.attention_class

  def attend(self, attention: nn.Module, norm: nn.Module, inputs_q: Array,
             inputs_kv: Array, mask, bias, *,
             first_token: Callable[[], Array], deterministic: bool,
             **prefix) -> tuple[Array, 'LayerConditioning']:
    """Runs the attention; with gating, also makes the layer's FFN gates.

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
    """The FFN block (`layers.MlpBlock`'s kwargs), gated once `attend` ran."""
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
  """Checks task ids against the tokens and `[0, num_tasks)`.

  Concrete ids are checked here, on the host. Traced ids are checked by the
  compiled program (`_call_on_host`), which then fails with a
  `jax.errors.JaxRuntimeError` carrying the same message, since an
  out-of-range gather would silently clamp or fill NaN; unless
  `T5Config.check_traced_task_ids` is off (`network.checked_on_host`).

  Args:
    cfg: the `T5Config`.
    task_ids: int32 `[batch]`; packed rows: `[batch, length]`, one id per
      segment. A list or numpy array is converted. None for no ids.
    tokens: `[batch, length]`, the tokens the ids go with.
    segment_ids: `[batch, length]` for packed rows.

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
  """Checks packed rows of a per-example gated model (HyperGrid).

  At most `max_segments` contiguous examples a row; traced ids are checked
  (the bound only) by the compiled program, as in `check_task_ids`.
  """
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
  """The compiled side of `check_segments`; `high` may come batched."""
  inputs_lib.check_segment_bound('segment_ids', int(np.max(high)), bound)


def _check_in_graph(num_tasks: int, task_ids: Array) -> None:
  """Compiles a host check that traced `task_ids` lie in `[0, num_tasks)`."""
  low, high = jnp.min(task_ids), jnp.max(task_ids)
  _raise_in_graph((low < 0) | (high >= num_tasks),
                  functools.partial(_check_task_id_range, num_tasks), low,
                  high)


def _raise_in_graph(bad: Array, check: Callable[..., None],
                    *values: Array) -> None:
  """Compiles `check(*values)` on the host, called when traced `bad` holds.

  Its raise fails the call with a `JaxRuntimeError`. A host callback, not
  checkify, which would need every caller (t5x's steps, a user's `jit`) to
  wrap its function; the `cond` keeps Python off the path of valid inputs.
  """
  jax.lax.cond(bad, lambda: _call_on_host(check, *values), lambda: None)


def _call_on_host(check: Callable[..., None], *values: Array) -> None:
  """`check(*values)` on the host, in the form the compiled platform takes.

  CPU, GPU: partitioned, so every device calls it on the replicated scalars
  and fails alike (one device failing alone would leave the others waiting
  at their next collective until XLA aborts). JAX lowers no partitioned
  callback for a TPU, so there the first device calls it; the host answers
  that device whether it raised or not (XLA's `pjrt/host_callback.cc`), so
  none waits. Compiled for TPU slices in `tests/test_task_id_checks.py`,
  not run on one.
  """

  def call(partitioned: bool) -> Callable[[], None]:
    return lambda: jax.debug.callback(check, *values, partitioned=partitioned)

  jax.lax.platform_dependent(tpu=call(False), default=call(True))


def _check_task_id_range(num_tasks: int, low, high) -> None:
  """Raises ValueError unless ids `low`..`high` lie in `[0, num_tasks)`."""
  low, high = int(np.min(low)), int(np.max(high))
  if low < 0 or high >= num_tasks:
    raise ValueError(
        f'task_ids must lie in [0, num_tasks) = [0, {num_tasks}), got ids '
        f'from {low} to {high}. Raise NUM_TASKS (T5Config.num_tasks) or fix '
        'the task list.')


def input_valid(cfg, encoder_input_tokens: Array, packed: bool = False
                ) -> Array:
  """`[batch, n + length]` valid positions of the encoder's output.

  n is the number of Prompt-Tuning's soft tokens (always valid), else 0, and
  0 on packed rows, whose prompts fill reserved slots.
  """
  if packed:
    return encoder_input_tokens > 0
  return prompt_tuning_lib.extend_valid(cfg.prompt_tuning,
                                        encoder_input_tokens > 0)


class StackConditioning:
  """The task conditioning of one stack for one forward (or decode step).

  Construct it inside the stack's compact `__call__`, so that the
  stack-level parameters (hyper-prompt generators, adapter tables,
  HyperGrid's task embedding, soft prompts) live in the stack's scope.

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
    # Once the cache exists, what depends only on the task and `encoded` is
    # read from it: no generation at decode steps.
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
    """Adds Prompt-Tuning's soft prompts to the encoder's embedded inputs.

    `[batch, length, embed]` -> `[batch, n + length, embed]`; packed rows
    keep their shape, the prompts filling each example's reserved slots.
    """
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
  """HyperPrompt's `(keys, values, logit_bias)`, all tasks and layers, or None.

  Keys and values are None when not `generate` (decode steps: cached).
  """
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
  """`(weights, activation, packed_form)` of the stack's adapters, or None.

  `weights[m]` is layer m's `{kind: AdapterWeights [tasks, ...]}`: Vanilla
  adapters' parameters, or HyperFormer++'s, generated for all tasks.
  """
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
  """HyperGrid's gating of the stack (packed: per segment), or None."""
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
