"""CISPO: REINFORCE on log pi with a clipped, stop-gradient importance weight (MiniMax-M1).

per-token loss = -sg(clamp(r, low, high)) * A * log pi, r = pi / pi_anchor, with the anchor pi_old
or pi_rollout (cfg.cispo.anchor) and [low, high] = cfg.cispo.bounds() (offsets 1-eps_low, 1+eps_high
or the absolute clip_min, clip_max). Unlike PPO, capped tokens keep a gradient.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..config import LossConfig
from .common import LossInputs, log_ratio, ratio_metrics
from .metrics import Metrics
from .registry import register_policy_loss


@register_policy_loss("cispo", anchor=lambda cfg: cfg.cispo.anchor, anchor_key="cispo.anchor", per_token=True,
                      bounds=lambda cfg: cfg.cispo.bounds())
def cispo_loss(cfg: LossConfig, x: LossInputs) -> tuple[Tensor, Metrics]:
    c = cfg.cispo
    low, high = c.bounds()
    ratio = log_ratio(x.logprobs, x.anchor_logprobs).detach().exp()
    weight = ratio.clamp(low, high)
    drop = torch.zeros_like(x.mask)
    if c.token_mask:
        # MiniMax-M1's mask: drop the tokens PPO's clip would zero; they stay in the denominator.
        drop = ((x.advantages > 0) & (ratio > 1.0 + c.mask_eps_high)) | (
            (x.advantages < 0) & (ratio < 1.0 - c.mask_eps_low))
        weight = weight * (~drop)
    m = Metrics()
    ratio_metrics(m, ratio, weight, x, low, high)
    m.frac("masked_frac", drop, x.mask)
    return -(weight * x.advantages) * x.logprobs, m
