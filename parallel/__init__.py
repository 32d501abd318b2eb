"""Parallelism applied to a built single-device model: dims, expert parallelism, pipeline, ZeRO, FP8."""
