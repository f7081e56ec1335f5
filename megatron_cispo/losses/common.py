"""Shared pieces of every policy loss: inputs, guarded ratios, the common ratio metrics, KL and TIS.

Pure tensor math on [b, s] fp32 tensors; no process groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from ..config import KLConfig, TISConfig
from .metrics import Metrics

# seq_sum(x [b, s]) -> [b, s]: each token gets the sum of x over its whole sequence. One row per
# sequence by default; the policy step passes a segment sum over a packed row, reduced over CP.
SeqSum = Callable[[Tensor], Tensor]


def row_sum(x: Tensor) -> Tensor:
    """The default SeqSum: every row of [b, s] is one sequence."""
    return x.sum(-1, keepdim=True).expand_as(x)


# exp(20) ~ 4.9e8 is far past any clip bound yet keeps exp() and its grad finite in fp32.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    """What compute_policy_loss hands every registered loss; all [b, s] fp32.

    logprobs: current policy, with grad. anchor_logprobs: pi_old or pi_rollout, whichever
    the loss's anchor names. At invalid positions (mask False) every tensor holds 0.
    """

    logprobs: Tensor
    anchor_logprobs: Tensor
    advantages: Tensor
    mask: Tensor  # bool


def log_ratio(logprobs: Tensor, anchor: Tensor) -> Tensor:
    """log(pi / pi_anchor), clamped to +-LOG_RATIO_CLAMP; keeps the grad of `logprobs`."""
    return (logprobs - anchor).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def ratio_metrics(m: Metrics, ratio: Tensor, weight: Tensor, x: LossInputs, low: float, high: float) -> None:
    """Keys shared by all built-in losses, so dashboards can compare them suffix by suffix.

    weight is the stop-gradient coefficient on -A * grad(log pi) for each token.
    """
    m.mean("ratio_mean", ratio, x.mask)
    m.min_max("ratio", ratio, x.mask)
    m.frac("clip_frac_low", ratio < low, x.mask)
    m.frac("clip_frac_high", ratio > high, x.mask)
    m.mean("weight_mean", weight, x.mask)


def kl_estimate(estimator: str, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi; grad flows through logprobs.

    With d = log(pi_ref / pi): k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1 (Schulman 2020). Their
    expected gradients differ: on-policy, k1's is 0, k2's is grad KL(pi || pi_ref) and k3's is
    grad KL(pi_ref || pi), per token with the context held fixed (docs/algorithm.md, "KL estimators").
    """
    d = log_ratio(ref_logprobs, logprobs)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"kl.estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def tis_weights(tis: TISConfig, old: Tensor, rollout: Tensor, mask: Tensor, m: Metrics,
                seq_sum: SeqSum = row_sum) -> Tensor:
    """Detached truncated-IS weights min(pi_old / pi_rollout, cap), [b, s].

    Per sequence, every token carries its sequence's weight exp(sum of log-ratios), and the
    metrics weigh each token 1/len so that they are means over sequences.
    """
    d = torch.where(mask, old - rollout, 0.0).detach()
    if tis.level == "token":
        w = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(max=tis.cap)
        per = torch.ones_like(w)
    elif tis.level == "sequence":
        w = seq_sum(d).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(max=tis.cap)
        per = 1.0 / seq_sum(mask.float()).clamp(min=1.0)
    else:
        raise ValueError(f"tis.level must be 'token' or 'sequence' here, got {tis.level!r}")
    m.weighted_mean("tis/weight_mean", w, per, mask)
    m.weighted_mean("tis/capped_frac", (w >= tis.cap).float(), per, mask)
    return w


def kl_penalty(kl: KLConfig, logprobs: Tensor, ref: Tensor, mask: Tensor, m: Metrics,
               rollout: Optional[Tensor] = None) -> Tensor:
    """kl.coef * per-token KL to the reference, [b, s]; records policy/kl over `mask`.

    With kl.is_weight the estimate is multiplied by w = pi / pi_rollout (`rollout`: the sampler's
    logprobs, detached), gradient included: E_rollout[grad(w k)] = grad E_pi[k], so k3 and k1 give
    an unbiased value and gradient of KL(pi || pi_ref) from the sampler's tokens. The log-ratio of w
    is clamped like every ratio (LOG_RATIO_CLAMP); past the clamp w has no gradient.
    """
    k = kl_estimate(kl.estimator, logprobs, ref)
    if kl.is_weight:
        if rollout is None:
            raise ValueError("kl.is_weight=True needs rollout_logprobs (the sampler's logprobs, for the weight "
                             "pi / pi_rollout)")
        k = log_ratio(logprobs, rollout.detach()).exp() * k
    m.mean("policy/kl", k, mask)
    return kl.coef * k
