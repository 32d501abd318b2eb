"""Training entry point, loop, data, checkpoints and logging."""
