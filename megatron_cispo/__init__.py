"""megatron_cispo: CISPO for Megatron RL policy steps.

Data flow: LossConfig (config) -> token_logprobs (logprobs) -> compute_policy_loss (losses:
ratio against the anchor, clamp, aggregation) -> policy_step / make_forward_step (step: the
megatron-core plugin, exact reduction over microbatches and data-parallel ranks).

The public names, all importable from `megatron_cispo` (docs/architecture.md has the map):

    LossConfig              config.py   the loss: section of an experiment, as frozen dataclasses
    token_logprobs          logprobs.py vocab-parallel token logprobs (and entropy) from sharded logits
    fused_token_logprobs    fused_head.py the same from hidden states and the output weight, no logits
    KeptSet                 kept_set.py a sampler's kept token sets (vLLM's compressed rows), for keep=
    compute_policy_loss     losses/     one microbatch: (loss_sum, denominator, Metrics)
    PolicyLossOutput        losses/     what compute_policy_loss returns
    Metrics                 losses/     the one metric type: reducible sums, mins, maxs, totals
    register_policy_loss    losses/     decorator that adds a loss to the registry
    get_policy_loss         losses/     look a registered loss up by name
    available_policy_losses losses/     names of the built-in and plugin losses
    check_loss_config       losses/     the registry's rules for a config (cached per config)
    Rollouts                step/       a DP-local batch of sequences for policy_step
    StepConfig              step/       minibatches, microbatches, epochs, temperature
    policy_step             step/       one RL update through megatron-core's schedules
    make_forward_step       step/       forward_step for get_forward_backward_func (the plugin)
    make_loss_func          step/       only the loss_func, for your own forward_step
    check_megatron_config   step/       fail fast on a model config that breaks the loss contract
    set_megatron_hooks      step/       set the loop hooks megatron's schedules read, as Megatron-LM's train()
    reduce_metrics          step/       exact Metrics reduction over a process group

Names load on first use, so `import megatron_cispo` pulls no megatron-core and never touches
torch.cuda; it warns once if the installed megatron-core is outside the supported range (mcore.py). Distributed init and the CPU compatibility layer are ours (megatron_cispo.runner),
never the library's.
"""
import importlib

from .mcore import warn_if_untested

__version__ = "0.1.0"
warn_if_untested()  # reads megatron/core/package_info.py as text: imports no megatron-core

_EXPORTS = {
    "LossConfig": "megatron_cispo.config",
    "token_logprobs": "megatron_cispo.logprobs",
    "fused_token_logprobs": "megatron_cispo.fused_head",
    "KeptSet": "megatron_cispo.kept_set",
    "compute_policy_loss": "megatron_cispo.losses",
    "PolicyLossOutput": "megatron_cispo.losses",
    "Metrics": "megatron_cispo.losses",
    "register_policy_loss": "megatron_cispo.losses",
    "get_policy_loss": "megatron_cispo.losses",
    "available_policy_losses": "megatron_cispo.losses",
    "check_loss_config": "megatron_cispo.losses",
    "Rollouts": "megatron_cispo.step",
    "StepConfig": "megatron_cispo.step",
    "policy_step": "megatron_cispo.step",
    "make_forward_step": "megatron_cispo.step",
    "make_loss_func": "megatron_cispo.step",
    "check_megatron_config": "megatron_cispo.step",
    "set_megatron_hooks": "megatron_cispo.step",
    "reduce_metrics": "megatron_cispo.step",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatron_cispo' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])


__all__ = list(_EXPORTS)
