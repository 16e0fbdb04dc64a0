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
"""

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

from flax import linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hyperprompt_jax import adapters as adapters_lib
from hyperprompt_jax import hyperformer as hyperformer_lib
from hyperprompt_jax import hypergrid as hypergrid_lib
from hyperprompt_jax import hyperprompt as hyperprompt_lib
from hyperprompt_jax import layers
from hyperprompt_jax import methods
from hyperprompt_jax import prompt_tuning as prompt_tuning_lib

Array = jax.Array


class Prompts(NamedTuple):
  """One layer's attention prefix: keys and values `[batch, l, heads,
  head_dim]` (None at decode steps, where they live in the cache) and the
  optional `[heads]` logit bias."""

  keys: Optional[Array]
  values: Optional[Array]
  logit_bias: Optional[Array]

  def as_kwargs(self) -> dict[str, Any]:
    return dict(prefix_key=self.keys, prefix_value=self.values,
                prefix_logit_bias=self.logit_bias)


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
  """

  prompts: Optional[Prompts] = None
  cross_attention_prompts: bool = False
  adapters: Optional[adapters_lib.LayerAdapters] = None
  gating: Optional[hypergrid_lib.StackGating] = None

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

  def attention(self, attention: Callable[..., nn.Module], norm: nn.Module,
                inputs_q: Array, inputs_kv: Array, mask, bias, *,
                first_token: Callable[[], Array], deterministic: bool,
                **prefix) -> tuple[Array, dict[str, Array]]:
    """The attention the layer's FFN gates come from (encoder: the
    self-attention, decoder: the encoder-decoder attention).

    Args:
      attention: `(cls) -> module`: the layer's attention of class `cls`.
      norm: the layer norm in front of it.
      inputs_q, inputs_kv, mask, bias, deterministic, prefix: its inputs.
      first_token: `() -> [batch, embed]`, HyperGrid's first_token
        conditioning vector.

    Returns:
      The attention output and the FFN's gates (`{}` without gating).
    """
    if self.gating is None:
      out = attention(layers.MultiHeadDotProductAttention)(
          inputs_q, inputs_kv, mask, bias, deterministic=deterministic,
          **prefix)
      return out, {}
    return self.gating.attention(
        attention, norm, inputs_q, inputs_kv, mask, bias,
        first_token=first_token, deterministic=deterministic, **prefix)

  def mlp_class(self, gates: dict[str, Array]) -> Callable[..., nn.Module]:
    """The FFN block class with the layer's gates bound."""
    if not gates:
      return layers.MlpBlock
    return lambda **kwargs: hypergrid_lib.GatedMlpBlock(**kwargs, **gates)

  def adapt(self, y: Array, kind: str) -> Array:
    """A sublayer's output `y` through its `kind` adapter, if any."""
    return y if self.adapters is None else self.adapters(y, kind)


NONE = LayerConditioning()


def check_task_ids(task_ids: Optional[Array], batch: int, num_tasks: int):
  """Checks rank, batch size, dtype and, when concrete, the id range.

  Inside `jax.jit` the values are abstract and an out-of-range gather would
  clamp silently, so runners also validate batches on the host
  (`hyperprompt_jax.batches.validate_batch`).
  """
  if task_ids is None:
    return
  if task_ids.ndim != 1 or task_ids.shape[0] != batch:
    raise ValueError(
        f'task_ids must be int32 [batch] = [{batch}], got shape '
        f'{tuple(task_ids.shape)}.'
    )
  if not jnp.issubdtype(task_ids.dtype, jnp.integer):
    raise ValueError(f'task_ids must be integers, got {task_ids.dtype}.')
  if isinstance(task_ids, jax.core.Tracer):
    return
  ids = np.asarray(task_ids)  # concrete: check on the host, outside tracing
  low, high = int(ids.min()), int(ids.max())
  if low < 0 or high >= num_tasks:
    raise ValueError(
        f'task_ids must lie in [0, num_tasks) = [0, {num_tasks}), got ids '
        f'from {low} to {high}. Raise NUM_TASKS (T5Config.num_tasks) or fix '
        'the task list.'
    )


def refuse_packing(cfg, segment_ids) -> None:
  """Packed rows mix tasks, but task ids are per example."""
  if segment_ids is not None and methods.is_task_conditioned(cfg):
    raise ValueError(
        'Packed inputs (segment ids) reached a task-conditioned model: a '
        'packed row mixes tasks, but task ids are per example. Set '
        '`pack = False` in the DatasetConfig of the run (train and '
        'train_eval).'
    )


def input_valid(cfg, encoder_input_tokens: Array) -> Array:
  """`[batch, n + length]` valid positions of the encoder's output (n:
  Prompt-Tuning's soft tokens, always valid, else 0)."""
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
    task_ids: int32 `[batch]`, or None for a model without conditioning.
    token_valid: `[batch, length]`, the columns HyperGrid's task query sees
      (the encoder's tokens; for the decoder, `encoded`'s).
    decode: the decoder runs against its autoregressive cache.
  """

  def __init__(self, module: nn.Module, stack: str, num_layers: int,
               task_ids: Optional[Array], token_valid: Optional[Array],
               decode: bool = False):
    cfg = module.config
    self.config = cfg
    self.stack = stack
    self.task_ids = task_ids
    # Once the cache exists, everything that depends only on the task (and
    # `encoded`) is read from it: no generation at decode steps.
    cache_ready = decode and 'cache' in module.variables
    self._prompts = _generate_prompts(cfg, stack, num_layers,
                                      generate=not cache_ready)
    self._adapters = _adapter_weights(cfg, stack, num_layers)
    self._gating = _gating(cfg, stack, task_ids, token_valid, decode,
                           cache_ready)

  def inputs(self, embedded: Array) -> Array:
    """The stack's embedded inputs with Prompt-Tuning's soft prompts in
    front (encoder): `[batch, length, embed]` -> `[batch, n + length,
    embed]`."""
    cfg = self.config
    if self.stack != 'encoder' or cfg.prompt_tuning is None:
      return embedded
    return prompt_tuning_lib.TaskPrompts(
        cfg.prompt_tuning, cfg.num_tasks, cfg.emb_dim,
        name='prompt_tuning')(embedded, self.task_ids)

  def layer(self, m: int) -> LayerConditioning:
    """Layer m's conditioning."""
    prompts = None
    if self._prompts is not None:
      keys, values, logit_bias = self._prompts
      bias = None if logit_bias is None else logit_bias[m]
      if keys is not None:
        keys, values = hyperprompt_lib.gather_prompts(keys, values, m,
                                                      self.task_ids)
      prompts = Prompts(keys, values, bias)
    adapters = None
    if self._adapters is not None:
      weights, activation = self._adapters
      adapters = adapters_lib.LayerAdapters(weights, m, self.task_ids,
                                            activation)
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
  """`(weights [layers, tasks, ...], activation)` of the stack's adapters:
  Vanilla adapters are parameters, HyperFormer++ generates them once per
  forward for all T tasks. None without adapters."""
  if adapters_lib.is_active(cfg.adapter, stack):
    return (adapters_lib.VanillaAdapters(cfg.adapter, cfg.num_tasks,
                                         num_layers, cfg.emb_dim,
                                         name='adapter')(),
            cfg.adapter.activation)
  if adapters_lib.is_active(cfg.hyperformer, stack):
    return (hyperformer_lib.HyperFormerGenerator(
        cfg.hyperformer, cfg.num_tasks, num_layers, cfg.emb_dim,
        name='hyperformer')(), cfg.hyperformer.activation)
  return None


def _gating(cfg, stack: str, task_ids, token_valid, decode: bool,
            cache_ready: bool) -> Optional[hypergrid_lib.StackGating]:
  """HyperGrid's per-stack gating, or None when inactive."""
  hg = cfg.hypergrid
  if not hypergrid_lib.is_active(hg, stack):
    return None
  task_vectors = None
  if hg.conditioning == 'task_attention' and not cache_ready:
    task_vectors = hypergrid_lib.TaskEmbedding(
        cfg.num_tasks, cfg.emb_dim, name=hypergrid_lib.scope_name(hg))(
            task_ids)
  return hypergrid_lib.StackGating(hg, cfg.emb_dim, cfg.mlp_dim,
                                   task_vectors, token_valid, decode)
