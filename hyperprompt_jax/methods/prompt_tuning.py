"""Multi-task Prompt-Tuning: the HyperPrompt paper's modified baseline.

Lester et al. (2021) prepend a trainable soft prompt to the encoder's input
embeddings and train only the prompt. The HyperPrompt paper's baseline (§4)
(1) trains the prompts and the backbone, and (2) gives each task its own
prompt, all tasks co-trained. Here each task has `n` prompt vectors
(`prompts [T, n, d]`, under `encoder/prompt_tuning/`), gathered by task id and
prepended to the token embeddings before the embedding dropout; the encoder
then runs over `n + input_length` positions (relative positions cover the
prompt too), the prompt positions are always valid in the encoder's
self-attention and the decoder's cross-attention, and `encoded` is
`[batch, n + input_length, d]`. At T5.1.1-base with T = 8 and n = 12
(default; the paper does not give its length) the prompts are 1.0003x the
parameters, the paper's figure. Initialisation: N(0, 1), as the token
embeddings of a freshly initialised T5.
"""

from typing import Any, Optional

from flax import linen as nn
from flax import struct
import jax
import jax.numpy as jnp

from hyperprompt_jax.t5 import inputs
from hyperprompt_jax.t5 import layers
from hyperprompt_jax.t5 import task_blocks

PROMPT_SLOT_TOKEN = inputs.PROMPT_SLOT_TOKEN

Array = jax.Array

# The method's face (read by `methods.REGISTRY`): the T5Config field that
# holds its config, its parameter scopes and logical axis names, the gin
# variant files that select it, `check` and `is_active`.
CONFIG_FIELD = 'prompt_tuning'
SCOPES = ('prompt_tuning',)
AXIS_NAMES = ('tasks', 'prompt_length')
VARIANT_FILES = ('variants/prompt_tuning.gin',)


@struct.dataclass
class PromptTuningConfig:
  """gin: `prompt_tuning.PromptTuningConfig` (gin/variants/prompt_tuning.gin)."""

  prompt_length: int = 12  # n soft tokens per task


def check_prompt_tuning_config(cfg: PromptTuningConfig) -> None:
  if cfg.prompt_length <= 0:
    raise ValueError('PromptTuningConfig.prompt_length (PROMPT_TUNING_LENGTH)'
                     f' must be positive, got {cfg.prompt_length}.')


def check(cfg: PromptTuningConfig, model_config: Any) -> None:
  del model_config  # the prompts fit any model
  check_prompt_tuning_config(cfg)


def is_active(cfg: Optional[PromptTuningConfig], stack: str) -> bool:
  """The soft prompts enter the encoder's input only."""
  return cfg is not None and stack == 'encoder'


def prompt_length(cfg: Optional[PromptTuningConfig]) -> int:
  """Soft tokens prepended to the encoder input (0 without prompt tuning)."""
  return 0 if cfg is None else cfg.prompt_length


def extend_valid(cfg: Optional[PromptTuningConfig], valid: Array) -> Array:
  """`[batch, input_length]` token validity -> `[batch, n + input_length]`,
  the prompt positions valid: the encoder's key / query mask and the
  decoder's cross-attention mask."""
  n = prompt_length(cfg)
  if n == 0:
    return valid
  return jnp.concatenate(
      [jnp.ones(valid.shape[:-1] + (n,), valid.dtype), valid], axis=-1)


class TaskPrompts(nn.Module):
  """Per-task soft prompts prepended to the encoder's input embeddings."""

  config: PromptTuningConfig
  num_tasks: int
  emb_dim: int

  @nn.compact
  def __call__(self, embedded: Array, task_ids: Optional[Array],
               positions: Optional[Array] = None,
               valid: Optional[Array] = None) -> Array:
    """Unpacked: `[batch, length, d]` embeddings and `task_ids [batch]` ->
    `[batch, n + length, d]`, each example's prompt in front.

    Packed (`task_ids`, `positions` and `valid` `[batch, length]`: each
    token's task, its position in its example, non-padding): each example's
    soft prompt in its reserved slots, shape unchanged. The feature
    converter (`input_prompt_length = n`) put `n` placeholder tokens in front
    of every packed example, so positions `0..n-1` of each segment are its
    prompt slots; relative positions and masks then match the unpacked
    `[prompt; tokens]` row exactly.
    """
    if task_ids is None:
      raise ValueError(
          'Prompt-Tuning needs task_ids (int32 [batch]) but none were given: '
          'pass task_ids to encode / __call__ (the feature converter adds '
          'them).')
    n = self.config.prompt_length
    prompts = layers.param_with_axes(
        'prompts', nn.initializers.normal(1.0),
        (self.num_tasks, n, self.emb_dim),
        jnp.float32, axes=('tasks', 'prompt_length', 'embed'))
    if positions is not None:  # packed rows
      chosen = prompts[task_ids, jnp.minimum(positions, n - 1)]
      is_slot = (positions < n) & valid
      return jnp.where(is_slot[..., None], chosen.astype(embedded.dtype),
                       embedded)
    chosen = task_blocks.take_tasks(prompts, task_ids).astype(embedded.dtype)
    return jnp.concatenate([chosen, embedded], axis=1)
