"""megatron_cispo: CISPO for Megatron RL policy steps.

Data flow: LossConfig (config) -> token_logprobs (logprobs) -> compute_policy_loss (losses:
ratio against the anchor, clamp, aggregation) -> policy_step (exact reduction over
microbatches and data-parallel ranks inside megatron-core's schedules).
Names load on first use, so `import megatron_cispo` costs nothing and pulls no megatron-core.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LossConfig": "megatron_cispo.config",
    "token_logprobs": "megatron_cispo.logprobs",
    "compute_policy_loss": "megatron_cispo.losses",
    "register_policy_loss": "megatron_cispo.losses",
    "get_policy_loss": "megatron_cispo.losses",
    "available_policy_losses": "megatron_cispo.losses",
    "PolicyLossOutput": "megatron_cispo.losses",
    "policy_step": "megatron_cispo.policy_step",
    "make_forward_step": "megatron_cispo.policy_step",
    "check_megatron_config": "megatron_cispo.policy_step",
    "init_distributed": "megatron_cispo.runtime",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatron_cispo' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])


__all__ = list(_EXPORTS)
