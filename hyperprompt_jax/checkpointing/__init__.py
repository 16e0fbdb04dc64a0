"""Checkpoints: t5x's layouts read (`checkpoints`), the built-in runner's
saved and resumed (`checkpoint_manager`) with what each records of its run
(`run_record`), where a run's parameters start (`initial_checkpoint`), and
task parameters out of and into checkpoints (`task_params_export`,
`task_params_import`)."""
