"""The t5x runner's side: the models and trainer that t5x's own train / eval
/ infer scripts build from `gin/t5x/` (`t5x_model`)."""
