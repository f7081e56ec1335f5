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

from ...config import KLConfig, LossConfig, TISConfig
from ...losses import check_loss_config, get_policy_loss, kl_estimate, log_ratio, per_token_policy_loss, required_inputs
from ...losses.registry import missing_input_message
from .settings import loss_config


@functools.lru_cache(maxsize=32)
def effective_config(cfg: LossConfig, clamp_eps_lower: float, clamp_eps_upper: float, kl_beta: float = 0.0,
                     entropy_weight: float = 0.0, tis_cap: Optional[float] = None) -> LossConfig:
    """cfg with what the call gets from Megatron's flags: the PPO clip (--grpo-clamp-eps-lower/upper),
    the k3 KL weight (--grpo-kl-beta), the entropy weight (--grpo-entropy-term-weight) and, when
    tis_cap is given, token-level TIS (--rl-importance-sampling-truncation-coef; inf = uncapped)."""
    if kl_beta < 0:
        raise ValueError(f"calculate_grpo_loss: kl_beta (--grpo-kl-beta) must be >= 0, got {kl_beta!r}")
    ppo = dataclasses.replace(cfg.ppo, eps_low=float(clamp_eps_lower), eps_high=float(clamp_eps_upper))
    tis = TISConfig() if tis_cap is None else TISConfig(level="token", cap=float(tis_cap))
    return dataclasses.replace(cfg, ppo=ppo, kl=KLConfig(coef=float(kl_beta), estimator="k3"),
                               entropy_coef=float(entropy_weight), tis=tis)


def clip_bounds(cfg: LossConfig) -> Optional[tuple[float, float]]:
    """(low, high) ratio bounds of the configured loss as its registration declares them (the loss applies
    the same ones: CISPO's clamp with clip_min/clip_max and the floor at 0, PPO's clip, rollout_is's
    band); None for a loss that declares none (nothing is reported as truncated)."""
    return get_policy_loss(cfg.policy_loss).bounds_for(cfg)


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
    Megatron-LM. The loss is losses.per_token_policy_loss with every position trained: tokens
    whose anchor/old/inference (or, with kl_beta > 0, ref) logprob is -inf or NaN get loss 0,
    ratio 1 and zero, finite grads; a non-finite current logprob is not masked (a model bug
    surfaces in the loss). No collectives.
    """
    base = loss_config()
    anchor = get_policy_loss(base.policy_loss).anchor_for(base)
    shape = tuple(current_logprobs.shape)
    for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
                    ("inference_logprobs", inference_logprobs)):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"calculate_grpo_loss: {name} shape {tuple(t.shape)} does not match "
                             f"current_logprobs shape {shape}")
    # As in Megatron-LM: the sampler's logprobs turn on IS (token TIS) under the old anchor; under the
    # rollout anchor only an explicit truncation coef asks for TIS, and the registry refuses that.
    tis_cap = None
    if inference_logprobs is not None and (anchor == "old" or is_truncation_coef is not None):
        tis_cap = float("inf") if is_truncation_coef is None else float(is_truncation_coef)
    cfg = effective_config(base, clamp_eps_lower, clamp_eps_upper, kl_beta, entropy_weight, tis_cap)
    try:
        check_loss_config(cfg)
    except ValueError as e:
        if tis_cap is None:
            raise
        raise ValueError(f"calculate_grpo_loss: --rl-importance-sampling-truncation-coef={is_truncation_coef!r} "
                         f"turns on token TIS, but {e}. Drop the flag") from None
    if inference_logprobs is None and "rollout_logprobs" in required_inputs(cfg):  # the registry's rule
        raise ValueError(f"calculate_grpo_loss: {missing_input_message(cfg, 'rollout_logprobs')}, but "
                         "inference_logprobs is None; pass --rl-inference-logprobs-is-correction so that "
                         "train_rl.py hands them to the loss")

    lp = current_logprobs.float()
    entropy = -lp.exp() * lp  # Megatron-LM's term: -p log p of the sampled token
    # Every position is "trained": loss_func applies Megatron's own loss mask afterwards.
    loss, valid, _ = per_token_policy_loss(
        cfg, lp, advantages=token_advantages(advantages, lp, seq_starts, seq_lengths),
        loss_mask=torch.ones_like(lp, dtype=torch.bool), old_logprobs=old_logprobs,
        rollout_logprobs=inference_logprobs, ref_logprobs=ref_logprobs, entropy=entropy)

    # The per-token outputs Megatron-LM logs, on the same zeroed inputs as the loss.
    def clean(t: Tensor, mask: Tensor = valid) -> Tensor:
        return torch.where(mask, t.float(), 0.0)

    lp_valid, anchor_lp = clean(lp), clean(inference_logprobs if anchor == "rollout" else old_logprobs).detach()
    has_ref = valid & torch.isfinite(ref_logprobs)
    kl_term = torch.where(has_ref, kl_estimate("k3", lp_valid, clean(ref_logprobs, has_ref).detach()), 0.0)
    entropy_term = clean(entropy)
    ratios = log_ratio(lp_valid, anchor_lp).detach().exp()
    bounds = clip_bounds(cfg)
    if bounds is None:
        above = below = torch.zeros_like(valid)
    else:
        above, below = valid & (ratios > bounds[1]), valid & (ratios < bounds[0])
    return loss, kl_term, ratios, entropy_term, above, below
