"""seqio tasks and mixtures of the project (installed as `hyperprompt_jax.tasks`).

Importing this package registers the project's seqio tasks and mixtures (GLUE,
SuperGLUE, their proportional mixtures and the offline fixture tasks) as they
land; the stable task-id table lives here too.
"""
