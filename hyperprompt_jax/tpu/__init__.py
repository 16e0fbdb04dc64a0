"""TPU slices and the figures of programs compiled for them."""
