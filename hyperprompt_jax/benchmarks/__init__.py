"""Measurements printed side by side in one run (`python -m
hyperprompt_jax.benchmark`, `python -m hyperprompt_jax.param_table`)."""
