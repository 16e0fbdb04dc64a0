"""The built-in training runner (`python -m hyperprompt_jax.train`): the
loop (`train`, which calls the evaluation the train command hands it) and
its settings (`run_settings`), its step (`trainer`, `optimizers`,
`metabalance`: pure, no TensorFlow, seqio, orbax or gin), t5x's learning-rate schedules (`schedules`), the run's
MetaBalance plan (`balancing`), where its parameters start
(`initial_checkpoint`), the data (`input_pipeline`, `batches`), the devices
and hosts (`partitioning`, `multihost`), what keeps a run safe
(`checkpoints`, `checkpoint_manager`, `run_lock`, `run_record`,
`preemption`), and task parameters out of and into checkpoints
(`export_task_params`, `import_task_params`); `gin_utils` is every
command's gin and command-line layer."""
