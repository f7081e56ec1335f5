"""MEGATRON_CISPO_PLUGINS=pkg.mod,other.mod: import plugin modules before training starts.

A plugin module registers losses with @register_policy_loss on import (the alternative to the
"megatron_cispo.policy_losses" entry-point group when the plugin is not an installed package).
Called by the Megatron-LM launcher; call load_plugins() yourself in a custom entry point.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Optional

ENV_VAR = "MEGATRON_CISPO_PLUGINS"


class PluginImportError(ImportError):
    """A module named in MEGATRON_CISPO_PLUGINS could not be imported."""


def plugin_modules(value: Optional[str] = None) -> list[str]:
    """Module names in `value` (default: the environment variable), comma-separated, blanks skipped."""
    value = os.environ.get(ENV_VAR, "") if value is None else value
    return [name.strip() for name in value.split(",") if name.strip()]


def load_plugins(value: Optional[str] = None) -> list[ModuleType]:
    """Import every listed module once (Python caches imports), in order; returns the modules."""
    modules = []
    for name in plugin_modules(value):
        try:
            modules.append(importlib.import_module(name))
        except Exception as e:
            raise PluginImportError(
                f"{ENV_VAR}: importing plugin module {name!r} failed ({type(e).__name__}: {e}); "
                "check the name and that its package is on PYTHONPATH") from e
    return modules
