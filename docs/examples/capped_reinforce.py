"""A policy loss as a plugin: one file and one registration (docs/algorithm.md, "Adding a loss").

    MEGATRON_CISPO_PLUGINS=capped_reinforce python -m megatron_cispo.train CONFIG loss.policy_loss=capped_reinforce
    (with docs/examples on PYTHONPATH; an installed package declares the entry point
    `megatron_cispo.policy_losses: capped_reinforce = my_pkg.capped_reinforce` instead)

REINFORCE on log pi with the importance weight r = pi / pi_rollout capped from above at CAP, stop-gradient:
CISPO's clamp without a lower bound. It declares what the registry asks of a loss: its anchor, that
each token's loss reads only that token (per_token: loss.head=fused_grad forms its gradient chunk by
chunk), the bounds it applies (the Megatron-LM drop-in's truncated fractions) and its own settings,
which the YAML writes under the loss's name (loss.capped_reinforce.cap: 3.0, or the override
loss.capped_reinforce.cap=3). tests/unit/test_plugin_example.py loads this file as a plugin and checks
each claim.
"""
from dataclasses import dataclass

from megatron_cispo.losses import Metrics, loss_settings, register_policy_loss
from megatron_cispo.losses.common import log_ratio, ratio_metrics

CAP = 2.0  # the default


@dataclass(frozen=True)
class CappedReinforceConfig:
    cap: float = CAP  # the importance weight's ceiling

    def __post_init__(self):
        if not self.cap > 0:
            raise ValueError(f"cap must be > 0, got {self.cap}")


def bounds(cfg):
    """The weight's range as the loss applies it: [0, cap]."""
    return 0.0, loss_settings(cfg).cap


@register_policy_loss("capped_reinforce", anchor="rollout", per_token=True, bounds=bounds,
                      config=CappedReinforceConfig)
def capped_reinforce(cfg, x):
    """x: LossInputs ([b, s] fp32 logprobs, anchor_logprobs = pi_rollout's, advantages, mask)."""
    low, high = bounds(cfg)
    ratio = log_ratio(x.logprobs, x.anchor_logprobs).detach().exp()
    weight = ratio.clamp(max=high)
    m = Metrics()
    ratio_metrics(m, ratio, weight, x, low, high)  # capped_reinforce/ratio_mean, clip_frac_high, ...
    return -(weight * x.advantages) * x.logprobs, m
