"""The built-in training runner (`python -m hyperprompt_jax.train`): the
loop (`train`), its step (`trainer`, `optimizers`, `metabalance`: pure, no
TensorFlow, seqio, orbax or gin), t5x's learning-rate schedules
(`schedules`), the run's MetaBalance plan (`balancing`),
where its parameters start (`initial_checkpoint`), the data
(`input_pipeline`, `batches`), the devices and hosts (`partitioning`,
`multihost`), and what keeps a run safe (`checkpoints`,
`checkpoint_manager`, `run_lock`, `run_record`, `preemption`, `files`);
`gin_utils` is every command's gin and command-line layer."""
