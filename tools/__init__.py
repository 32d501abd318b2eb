"""Command-line tools: convert_hf, schedule, size."""
