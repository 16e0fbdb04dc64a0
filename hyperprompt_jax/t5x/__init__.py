"""The t5x runner's side: what t5x's scripts build from `gin/t5x/`."""
