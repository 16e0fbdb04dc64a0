"""Hugging Face T5 checkpoints in and out (`python -m hyperprompt_jax.convert`).

`weight_names` holds the one name table between t5x's parameter paths and
transformers' tensor names, `model_config` the mapping between transformers'
T5 `config.json` and `network.T5Config` (with what it refuses), and
`conversion` reads and writes the two formats. Nothing here needs PyTorch or
transformers: safetensors files are read and written as numpy arrays.
"""
