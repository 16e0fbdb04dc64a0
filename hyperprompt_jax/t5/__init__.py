"""T5's primitives, the ground floor of the network: t5x's T5.1.1 / T5 v1.0
layers (`layers`), packed rows' task blocks (`task_blocks`), the batch
features and their rules (`inputs`) and the losses (`losses`). They know no
method: `methods/` builds on them, and the network (`model/`) composes both.
They import jax, flax and numpy only."""
