"""rollout_is: REINFORCE weighted by the raw ratio r = pi / pi_rollout, zero outside a trust band.

per-token loss = -sg(r) * A * log pi when 1-eps_low <= r <= 1+eps_high, else 0 (the zeroed
tokens stay in the denominator). Always anchored on the sampler's logprobs; where CISPO caps
an out-of-range weight, this loss drops the token (SkyRL's rollout_is).
"""
from __future__ import annotations

from torch import Tensor

from ..config import LossConfig
from .common import LossInputs, log_ratio, ratio_metrics
from .metrics import Metrics
from .registry import register_policy_loss


def rollout_is_bounds(cfg: LossConfig) -> tuple[float, float]:
    return 1.0 - cfg.rollout_is.eps_low, 1.0 + cfg.rollout_is.eps_high


@register_policy_loss("rollout_is", anchor="rollout", per_token=True, bounds=rollout_is_bounds)
def rollout_is_loss(cfg: LossConfig, x: LossInputs) -> tuple[Tensor, Metrics]:
    low, high = rollout_is_bounds(cfg)
    ratio = log_ratio(x.logprobs, x.anchor_logprobs).detach().exp()
    keep = (ratio >= low) & (ratio <= high)
    weight = ratio * keep
    m = Metrics()
    ratio_metrics(m, ratio, weight, x, low, high)
    m.frac("masked_frac", ~keep, x.mask)
    return -(weight * x.advantages) * x.logprobs, m
