"""The T5 network with task ids: the encoder-decoder (`network`) that composes
T5's primitives (`hyperprompt_jax.t5`) with the task-conditioning methods
(`hyperprompt_jax.methods`) through one conditioning object per layer
(`conditioning`), and its greedy decoder (`decoding`). It imports jax, flax
and numpy only, and nothing of the runner, evaluation or tasks above it."""
