"""Kept so `from megatron_cispo.losses.presets import from_framework`, the import docs/mapping.md
showed before the presets moved beside config (megatron_cispo/presets.py), still works."""
from ..presets import PRESETS, from_framework

__all__ = ["PRESETS", "from_framework"]
