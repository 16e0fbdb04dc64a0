"""The pure training step both runners take, and its parts: the step and
the sharded train state (`trainer`), the optimizer (`optimizers`), t5x's
learning-rate schedules (`schedules`), MetaBalance (`metabalance`, and a
run's plan: `metabalance_plan`) and a run's settings as one checked object
(`run_settings`, bound by gin). No TensorFlow, seqio or orbax here."""
