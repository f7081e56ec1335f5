"""Helpers below hf, rollout and runner: megatron's parameter names (param_names.py) and durable
writes with one-line failures (files.py)."""
