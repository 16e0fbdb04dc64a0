"""hyperprompt_jax: HyperPrompt and HyperGrid multi-task T5 in JAX / Flax."""

__version__ = '0.1.0'
