"""PPO clipped surrogate, anchored on pi_old, with optional dual clip (Ye et al. 2020).

per-token loss = -min(r * A, clip(r, 1-eps_low, 1+eps_high) * A), r = pi / pi_old; with
dual_clip = c and A < 0 the loss is further bounded by -c * A.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..config import LossConfig
from .common import LossInputs, log_ratio, ratio_metrics
from .metrics import Metrics
from .registry import register_policy_loss


def ppo_bounds(cfg: LossConfig) -> tuple[float, float]:
    return 1.0 - cfg.ppo.eps_low, 1.0 + cfg.ppo.eps_high


@register_policy_loss("ppo", anchor="old", per_token=True, bounds=ppo_bounds)
def ppo_loss(cfg: LossConfig, x: LossInputs) -> tuple[Tensor, Metrics]:
    p, a = cfg.ppo, x.advantages
    low, high = ppo_bounds(cfg)
    ratio = log_ratio(x.logprobs, x.anchor_logprobs).exp()
    unclipped = -a * ratio
    clipped = -a * ratio.clamp(low, high)
    loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(x.mask)
    if p.dual_clip is not None:
        dual = (a < 0) & (loss > -p.dual_clip * a)
        loss = torch.where(dual, -p.dual_clip * a, loss)
    # The gradient coefficient on -A * grad(log pi) is r where the unclipped branch is live, else 0.
    live = (unclipped >= clipped) & ~dual
    weight = ratio.detach() * live
    m = Metrics()
    ratio_metrics(m, ratio, weight, x, low, high)
    m.frac("masked_frac", ~live, x.mask)
    m.frac("dual_clip_frac", dual, x.mask)
    return loss, m
