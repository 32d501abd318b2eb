"""Command-line tools: convert_hf, size."""
