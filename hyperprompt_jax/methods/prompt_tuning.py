"""Multi-task Prompt-Tuning: the HyperPrompt paper's modified baseline.

Lester et al. (2021) prepend a trainable soft prompt to the encoder's input
embeddings and train only the prompt. The HyperPrompt paper's baseline (§4)
trains the backbone too and gives each task its own prompt. Here each task
has `n` prompt vectors (`prompts [T, n, d]`, under
`encoder/prompt_tuning/`), gathered by task id and prepended to the token
embeddings before the embedding dropout. The encoder runs over
`n + input_length` positions (relative positions and masks cover the
prompt, always valid), so `encoded` is `[batch, n + input_length, d]`.
n = 12 by default (the paper gives none) meets the paper's parameter count
(docs/methods.md, "Baselines"). Initialisation: N(0, 1), as a fresh T5's
token embeddings.
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

# Read by `methods.REGISTRY`: the T5Config field of the config, parameter
# scopes, logical axis names, gin variant files, `check` and `is_active`.
CONFIG_FIELD = 'prompt_tuning'
SCOPES = ('prompt_tuning',)
AXIS_NAMES = ('tasks', 'prompt_length')
VARIANT_FILES = ('variants/prompt_tuning.gin',)


@struct.dataclass
class PromptTuningConfig:
  """Prompt-Tuning's settings (gin: `prompt_tuning.PromptTuningConfig`).

  Attributes:
    prompt_length: n, soft tokens per task.
  """

  prompt_length: int = 12


def check_prompt_tuning_config(cfg: PromptTuningConfig) -> None:
  """Raises ValueError on settings that cannot build Prompt-Tuning."""
  if cfg.prompt_length <= 0:
    raise ValueError('PromptTuningConfig.prompt_length (PROMPT_TUNING_LENGTH)'
                     f' must be positive, got {cfg.prompt_length}.')


def check(cfg: PromptTuningConfig, model_config: Any) -> None:
  """Raises ValueError on settings that cannot build Prompt-Tuning."""
  del model_config  # the prompts fit any model
  check_prompt_tuning_config(cfg)


def is_active(cfg: Optional[PromptTuningConfig], stack: str) -> bool:
  """The soft prompts enter the encoder's input only."""
  return cfg is not None and stack == 'encoder'


def prompt_length(cfg: Optional[PromptTuningConfig]) -> int:
  """Soft tokens prepended to the encoder input (0 without prompt tuning)."""
  return 0 if cfg is None else cfg.prompt_length


def extend_valid(cfg: Optional[PromptTuningConfig], valid: Array) -> Array:
  """`[batch, input_length]` validity -> `[batch, n + input_length]`."""
  n = prompt_length(cfg)
  if n == 0:
    return valid
  return jnp.concatenate(
      [jnp.ones(valid.shape[:-1] + (n,), valid.dtype), valid], axis=-1)


class TaskPrompts(nn.Module):
  """Per-task soft prompts prepended to the encoder's input embeddings.

  Attributes:
    config: the `PromptTuningConfig`.
    num_tasks: T.
    emb_dim: d.
  """

  config: PromptTuningConfig
  num_tasks: int
  emb_dim: int

  @nn.compact
  def __call__(self, embedded: Array, task_ids: Optional[Array],
               positions: Optional[Array] = None,
               valid: Optional[Array] = None) -> Array:
    """Adds each example's soft prompt to its embeddings.

    On packed rows the feature converter (`input_prompt_length = n`) put `n`
    placeholder tokens in front of every example; its positions `0..n-1`
    are the prompt's slots, so positions and masks match the unpacked row.

    Args:
      embedded: `[batch, length, d]` embedded tokens.
      task_ids: int32 `[batch]`; packed rows: `[batch, length]`.
      positions: packed rows: `[batch, length]`, each token's position in
        its example.
      valid: packed rows: `[batch, length]`, the non-padding tokens.

    Returns:
      `[batch, n + length, d]`, the prompt in front; packed rows: the same
      shape, the prompt in its slots.
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
