"""The training loop, its configuration, checkpoints and metrics."""
