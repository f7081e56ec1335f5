"""Policy losses: a registry of per-token losses and `compute_policy_loss`, which runs one.

    out = compute_policy_loss(cfg, lp, advantages=a, loss_mask=m, old_logprobs=old)
    out.loss.backward()  # or sum out.loss_sum / out.denominator over microbatches and DP first
    out.metrics          # a Metrics: reducible parts; .values() gives the local numbers

Metric keys: "<policy_loss>/..." for what the loss computes (ratio_mean, ratio_min, ratio_max,
clip_frac_low, clip_frac_high, weight_mean, masked_frac, ...; same suffixes for every
built-in loss), "policy/..." (loss, tokens, nonfinite_dropped, kl, entropy), "tis/...",
"mismatch/..." (sampler vs trainer logprobs) and "correction/..." (loss.correction: mis_masked_frac,
geo_rs_dropped_frac, opsm_dropped_frac, ...; losses/corrections.py). Add a loss with
@register_policy_loss or the "megatron_cispo.policy_losses" entry-point group.
"""
from . import cispo, ppo, rollout_is  # noqa: F401  (registers the built-in losses)
from .aggregate import aggregate, finalize, token_weights
from .common import LOG_RATIO_CLAMP, LossInputs, kl_estimate, log_ratio
from .compute import PolicyLossOutput, compute_policy_loss, per_token_policy_loss, valid_tokens
from .registry import (
    ENTRY_POINT_GROUP,
    PolicyLoss,
    PolicyLossPluginError,
    available_policy_losses,
    check_loss_config,
    get_policy_loss,
    loss_settings,
    register_policy_loss,
    required_inputs,
)
from .metrics import Metrics

__all__ = [
    "ENTRY_POINT_GROUP", "LOG_RATIO_CLAMP", "LossInputs", "Metrics", "PolicyLoss", "PolicyLossOutput",
    "PolicyLossPluginError", "aggregate", "available_policy_losses", "check_loss_config", "compute_policy_loss", "finalize",
    "get_policy_loss", "kl_estimate", "log_ratio", "loss_settings", "per_token_policy_loss", "register_policy_loss",
    "required_inputs", "token_weights", "valid_tokens",
]
