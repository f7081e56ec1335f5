"""Command-line tools that are not the trainer: `python -m megatron_cispo.tools.make_tiny_hf`."""
