"""Drop-in for Megatron-LM's `calculate_grpo_loss` (core_v0.16.x) that runs a registered loss.

    loss, kl, ratios, entropy, trunc_hi, trunc_lo = calculate_grpo_loss(current_logprobs=..., ...)
Same parameters and 6-tuple as Megatron-LM's. Every output is per token with the logprobs' shape
([b, s], or [1, bin] when packed), unmasked and unreduced: train_rl.py's loss_func multiplies by
its loss mask and sums, exactly as it does with Megatron-LM's own function.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
from torch import Tensor

from ...config import LossConfig, TISConfig
from ...losses import LossInputs, Metrics, get_policy_loss, kl_estimate, log_ratio
from ...losses.common import tis_weights
from .settings import loss_config


@functools.lru_cache(maxsize=32)
def effective_config(cfg: LossConfig, clamp_eps_lower: float, clamp_eps_upper: float) -> LossConfig:
    """cfg with the PPO clip taken from Megatron's --grpo-clamp-eps-lower/upper (what the call gets)."""
    ppo = dataclasses.replace(cfg.ppo, eps_low=float(clamp_eps_lower), eps_high=float(clamp_eps_upper))
    return dataclasses.replace(cfg, ppo=ppo)


def clip_bounds(cfg: LossConfig) -> Optional[tuple[float, float]]:
    """(low, high) ratio bounds of the configured loss, from its config section (cfg.<name>), if any."""
    section = getattr(cfg, cfg.policy_loss, None)
    if section is None or not hasattr(section, "eps_low") or not hasattr(section, "eps_high"):
        return None  # a plugin loss without a clip section: nothing is reported as truncated
    return 1.0 - section.eps_low, 1.0 + section.eps_high


def token_advantages(advantages: Tensor, like: Tensor, seq_starts, seq_lengths) -> Tensor:
    """Per-token fp32 advantages with `like`'s shape.

    Unpacked: advantages [b] is broadcast along the sequence. Packed (like is [1, bin]): sequence
    i covers [start_i, start_i + len_i - 1) (logprobs are one token shorter), the rest is 0.
    """
    adv = advantages.detach().float()
    if seq_starts is None or seq_lengths is None:
        return adv.reshape(-1, 1).expand_as(like)
    bin_size = like.shape[1]
    starts = torch.as_tensor(seq_starts, device=like.device).reshape(-1, 1)
    ends = (starts + torch.as_tensor(seq_lengths, device=like.device).reshape(-1, 1) - 1).clamp(max=bin_size)
    pos = torch.arange(bin_size, device=like.device)
    inside = (pos >= starts) & (pos < ends)  # [n_seq, bin]
    return (inside.float() * adv[: starts.shape[0], None].to(like.device)).sum(0, keepdim=True)


def calculate_grpo_loss(
    current_logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    advantages: Tensor,
    clamp_eps_lower: float,
    clamp_eps_upper: float,
    kl_beta: float,
    entropy_weight: float,
    inference_logprobs: Tensor | None = None,
    is_truncation_coef: float | None = None,
    seq_starts: list | None = None,
    seq_lengths: list | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Policy loss of the configured LossConfig, per token, in Megatron-LM's 6-tuple.

    current/old/ref/inference_logprobs: [b, s] (or [1, bin]) any float dtype; advantages: [b]
    (or [n_seq] with seq_starts/seq_lengths). inference_logprobs are the sampler's (rollout)
    logprobs. Returns fp32 loss, kl_term, ratios (pi / pi_anchor, detached), entropy_term and
    bool truncated_from_above/below, all [b, s]:
      loss = w_is * policy_loss + kl_beta * k3(pi_ref/pi) - entropy_weight * (-p log p)
    policy_loss is the registered loss (clamp_eps_* become ppo.eps_*). w_is = min(pi_old /
    pi_rollout, is_truncation_coef) only with the old anchor and inference_logprobs given, as in
    Megatron-LM. Tokens with a non-finite required logprob get loss 0 and ratio 1.
    No collectives.
    """
    cfg = effective_config(loss_config(), clamp_eps_lower, clamp_eps_upper)
    spec = get_policy_loss(cfg.policy_loss)
    anchor = spec.anchor_for(cfg)
    shape = tuple(current_logprobs.shape)
    for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
                    ("inference_logprobs", inference_logprobs)):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"calculate_grpo_loss: {name} shape {tuple(t.shape)} does not match "
                             f"current_logprobs shape {shape}")
    if anchor == "rollout":
        if inference_logprobs is None:
            raise ValueError(f"policy_loss={cfg.policy_loss!r} with anchor='rollout' needs the sampler's "
                             "logprobs, but inference_logprobs is None; pass --rl-inference-logprobs-is-correction "
                             "so that train_rl.py hands them to the loss")
        if is_truncation_coef is not None:
            raise ValueError(f"policy_loss={cfg.policy_loss!r} with anchor='rollout' cannot be combined with "
                             f"--rl-importance-sampling-truncation-coef={is_truncation_coef!r}: the rollout "
                             "anchor already corrects for the sampler; TIS would double-count it. Drop the flag")
    use_is = anchor == "old" and inference_logprobs is not None
    anchor_lp = inference_logprobs if anchor == "rollout" else old_logprobs

    lp = current_logprobs.float()
    valid = torch.isfinite(lp) & torch.isfinite(anchor_lp)
    if use_is:
        valid &= torch.isfinite(old_logprobs) & torch.isfinite(inference_logprobs)

    def clean(t: Tensor, mask: Tensor = valid) -> Tensor:
        # where() before any math: a NaN in an unselected branch would still poison the grad.
        return torch.where(mask, t.float(), 0.0)

    x = LossInputs(logprobs=clean(lp), anchor_logprobs=clean(anchor_lp).detach(),
                   advantages=clean(token_advantages(advantages, lp, seq_starts, seq_lengths)).detach(),
                   mask=valid)
    per_token, _ = spec(cfg, x)
    if use_is:
        cap = float("inf") if is_truncation_coef is None else float(is_truncation_coef)
        tis = TISConfig(level="token", cap=cap)
        per_token = per_token * tis_weights(tis, clean(old_logprobs), clean(inference_logprobs), valid, Metrics())
    has_ref = valid & torch.isfinite(ref_logprobs)
    kl_term = torch.where(has_ref, kl_estimate("k3", x.logprobs, clean(ref_logprobs, has_ref).detach()), 0.0)
    entropy_term = -x.logprobs.exp() * x.logprobs  # Megatron-LM's term: -p log p of the sampled token
    loss = per_token + kl_beta * kl_term - entropy_weight * entropy_term

    ratios = log_ratio(x.logprobs, x.anchor_logprobs).detach().exp()
    bounds = clip_bounds(cfg)
    if bounds is None:
        above = below = torch.zeros_like(valid)
    else:
        above, below = valid & (ratios > bounds[1]), valid & (ratios < bounds[0])
    return loss, kl_term, ratios, entropy_term, above, below
