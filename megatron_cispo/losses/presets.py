"""Kept so that imports from before the presets moved beside config (megatron_cispo/presets.py)
still work: `from megatron_cispo.losses.presets import from_framework` (what docs/mapping.md
showed), PRESETS and the framework classes."""
from ..presets import PRESETS, TRL, MsSwift, NemoRL, Slime, SkyRL, Verl, from_framework

__all__ = ["PRESETS", "from_framework", "SkyRL", "MsSwift", "TRL", "Verl", "NemoRL", "Slime"]
