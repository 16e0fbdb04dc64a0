"""The T5 network: t5x's T5.1.1 / T5 v1.0 layers (`layers`), the encoder-
decoder that conditions them on the task (`network`, `conditioning`), its
batch features (`inputs`), its losses and its decoder (`losses`,
`decoding`). It imports jax, flax and numpy only, and nothing of the runner,
evaluation or tasks above it."""
