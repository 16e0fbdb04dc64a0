"""The built-in runner (`python -m hyperprompt_jax.train`): the loop
(`training_loop`, which calls the evaluation the train command hands it),
one trainer a directory (`run_lock`) and saving at the next step on a
preemption signal (`preemption`). Its step is `training/`, its checkpoints
`checkpointing/`, its hosts and data `common/`."""
