"""compute_policy_loss: the one entry from the policy step into the loss math.

per_token_policy_loss validates inputs, drops tokens whose required logprobs are non-finite
(counted), runs the registered loss and applies TIS, KL, the entropy bonus and last the
off-policy corrections (losses.corrections: a dropped token's whole loss is 0, and it stays in
the denominator); the Megatron-LM drop-in uses it as is. compute_policy_loss then aggregates
into (loss_sum, denominator) plus one Metrics. Pure tensor code; all reductions are the
caller's (step.reduce_metrics), except seq_sum's CP all-reduce under context parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..config import LossConfig
from ..vocab_softmax import check_devices
from .aggregate import aggregate, finalize
from .common import LossInputs, SeqSum, kl_estimate, kl_penalty, row_sum, tis_weights
from .corrections import correction_keep, corrections_on, mismatch_sequence_metrics
from .metrics import Metrics
from .registry import check_loss_config, input_reasons, missing_input_message


@dataclass(frozen=True, kw_only=True)
class PolicyLossOutput:
    """loss = loss_sum / max(denominator, 1). Sum loss_sum and denominator over microbatches
    and DP ranks, then divide once, for the exact global loss.

    metrics: this microbatch's reducible parts ("policy/loss" included); `metrics.values()` are
    the local numbers, `step.reduce_metrics([metrics, ...], group)` the exact global ones.
    """

    loss: Tensor
    loss_sum: Tensor
    denominator: Tensor
    metrics: Metrics


def _check_inputs(logprobs: Tensor, advantages: Tensor, others: dict[str, Optional[Tensor]]) -> None:
    """Shapes, dtypes and devices of the loss inputs; one host sync, only for a non-bool loss_mask
    (the policy step's are bool). Meta tensors pass: nothing else here reads a value."""
    if logprobs.dim() != 2 or not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be a floating [b, s] tensor, got {logprobs.dtype} of shape "
                         f"{tuple(logprobs.shape)}")
    shape = tuple(logprobs.shape)
    if tuple(advantages.shape) not in (shape, shape[:1]):
        raise ValueError(f"advantages shape {tuple(advantages.shape)} does not match logprobs shape {shape}; "
                         f"expected [b]={shape[:1]} or [b, s]={shape}")
    for name, t in others.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match logprobs shape {shape}")
    for name, t in {"advantages": advantages, **others}.items():
        if t is not None and name not in ("loss_mask", "keep") and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor (fp32), got {t.dtype}")
    check_devices({"logprobs": logprobs, "advantages": advantages, **others}, values=False)
    check_loss_mask(others["loss_mask"])


def check_loss_mask(m: Tensor, name: str = "loss_mask") -> None:
    """ValueError unless `m` is bool or holds only 0 and 1 (the loss's and Rollouts' rule, said once).
    A NaN entry is != 0, and a 0.5 one would count its token as fully trained. One host sync for a
    non-bool mask; a meta tensor passes."""
    if m.dtype != torch.bool and m.device.type != "meta" and bool(((m != 0) & (m != 1)).any()):  # host sync
        raise ValueError(f"{name} must be bool or hold only 0 and 1, got a {m.dtype} mask with other values; "
                         "a fractional weight would count its token as fully trained")


def _zero_invalid(t: Tensor, mask: Tensor) -> Tensor:
    # Sanitise before any math: where() still back-propagates NaN from an unselected NaN branch.
    return torch.where(mask, t.float(), 0.0)


def _detached(t: Optional[Tensor], mask: Tensor) -> Optional[Tensor]:
    return None if t is None else _zero_invalid(t, mask).detach()


def valid_tokens(cfg: LossConfig, loss_mask: Tensor, **logprobs: Optional[Tensor]) -> Tensor:
    """[b, s] bool: trained tokens whose logprobs that `cfg` needs (old/rollout/ref, as given) are
    finite. The policy step calls it on the whole batch before the step, so the global
    denominator is known up front; logprobs not given yet (pi_old from the training forward) are
    skipped."""
    needed = input_reasons(cfg)
    valid = loss_mask != 0
    for name, t in logprobs.items():
        if name in needed and name.endswith("_logprobs") and t is not None:
            valid = valid & torch.isfinite(t)
    return valid


def per_token_policy_loss(
    cfg: LossConfig,
    logprobs: Tensor,
    *,
    advantages: Tensor,
    loss_mask: Tensor,
    old_logprobs: Optional[Tensor] = None,
    rollout_logprobs: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None,
    seq_sum: SeqSum = row_sum,
    keep: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Metrics]:
    """Per-token policy loss before aggregation: the registered loss, TIS, KL, entropy bonus and
    the off-policy corrections (cfg.correction, and `keep`).

    Arguments as compute_policy_loss; seq_sum maps a [b, s] tensor to each token's sequence total
    (default: one sequence per row; the policy step passes a segment sum for packed rows). Returns
    (per_token [b, s] fp32, 0 where valid is False or a correction dropped the token; valid [b, s]
    bool, the denominator's tokens, corrections or not; Metrics). valid = trained tokens whose
    required anchor/old/rollout/ref logprobs are finite: a non-finite one (e.g. a sampler's -inf)
    drops the token, counted in policy/nonfinite_dropped, with loss 0 and zero grad. A non-finite
    *current* logprob on a trained token is not masked: it is a model bug and should surface.
    """
    spec = check_loss_config(cfg)  # cached: the registry rules run once per config
    given = {"old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs,
             "ref_logprobs": ref_logprobs, "entropy": entropy}
    _check_inputs(logprobs, advantages, {"loss_mask": loss_mask, "keep": keep, **given})
    needed = input_reasons(cfg)
    for name in needed:
        if given[name] is None:
            raise ValueError(missing_input_message(cfg, name))
    if cfg.correction.m2po is not None and keep is None:
        raise ValueError(f"correction.m2po={cfg.correction.m2po!r} needs keep, M2PO's token selection over the "
                         "global batch (step.m2po makes it before the step; the policy step passes it)")
    anchor = spec.anchor_for(cfg)

    trained = loss_mask != 0
    valid = valid_tokens(cfg, loss_mask, **given)
    m = Metrics()
    m.total("policy/tokens", valid.sum())
    m.total("policy/nonfinite_dropped", (trained & ~valid).sum())

    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logprobs)
    lp = _zero_invalid(logprobs, valid)
    x = LossInputs(logprobs=lp, anchor_logprobs=_zero_invalid(given[f"{anchor}_logprobs"], valid).detach(),
                   advantages=_zero_invalid(adv, valid).detach(), mask=valid)
    per_token, loss_metrics = spec(cfg, x)
    m.update(loss_metrics, prefix=f"{cfg.policy_loss}/")

    old = rollout = None
    if old_logprobs is not None and rollout_logprobs is not None:
        both = valid & torch.isfinite(old_logprobs) & torch.isfinite(rollout_logprobs)
        old, rollout = _zero_invalid(old_logprobs, both).detach(), _zero_invalid(rollout_logprobs, both).detach()
        m.mean("mismatch/abs_logprob_diff_mean", (old - rollout).abs(), both)
        # Tokens were sampled from pi_rollout, so this estimates KL(pi_rollout || pi_old).
        m.mean("mismatch/k3_kl", kl_estimate("k3", rollout, old), both)
        if corrections_on(cfg.correction, keep):
            mismatch_sequence_metrics(m, old, rollout, both, seq_sum)
    if cfg.tis.level is not None:
        per_token = per_token * tis_weights(cfg.tis, old, rollout, valid, m, seq_sum)
    if ref_logprobs is not None and (rollout_logprobs is not None or not cfg.kl.is_weight):
        has_ref = valid & torch.isfinite(ref_logprobs)
        kl_rollout = None
        if cfg.kl.is_weight:  # the weight pi / pi_rollout needs the sampler's logprob
            has_ref = has_ref & torch.isfinite(rollout_logprobs)
            kl_rollout = _zero_invalid(rollout_logprobs, has_ref).detach()
        penalty = kl_penalty(cfg.kl, lp, _zero_invalid(ref_logprobs, has_ref).detach(), has_ref, m,
                             rollout=kl_rollout)
        if cfg.kl.coef > 0:
            per_token = per_token + penalty
    if entropy is not None:
        ent = _zero_invalid(entropy, valid)
        m.mean("policy/entropy", ent, valid)
        if cfg.entropy_coef != 0:
            per_token = per_token - cfg.entropy_coef * ent
    # Last, so that a dropped token contributes nothing at all (no PG, KL or entropy term).
    kept = correction_keep(cfg.correction, anchor, logprobs=lp, old=_detached(old_logprobs, valid),
                           rollout=_detached(rollout_logprobs, valid), advantages=x.advantages, valid=valid,
                           m=m, seq_sum=seq_sum, selected=keep)
    live = valid if kept is None else valid & kept
    return torch.where(live, per_token.float(), 0.0), valid, m


def compute_policy_loss(
    cfg: LossConfig,
    logprobs: Tensor,
    *,
    advantages: Tensor,
    loss_mask: Tensor,
    old_logprobs: Optional[Tensor] = None,
    rollout_logprobs: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None,
    keep: Optional[Tensor] = None,
) -> PolicyLossOutput:
    """Policy loss for one microbatch: per_token_policy_loss, then aggregated by cfg.loss_agg.

    logprobs: [b, s] fp32|bf16, current policy, with grad. advantages: [b] or [b, s].
    loss_mask: [b, s] bool|float, nonzero = trained token. old/rollout/ref_logprobs: [b, s];
    entropy: [b, s]. Which optional tensors are needed is `required_inputs(cfg)`.
    keep: [b, s] bool, a selection made before the step (M2PO's; required with correction.m2po):
    False tokens get loss 0 and zero grad but stay in the denominator
    (correction/m2po_masked_frac counts them).
    """
    per_token, valid, m = per_token_policy_loss(
        cfg, logprobs, advantages=advantages, loss_mask=loss_mask, old_logprobs=old_logprobs,
        rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs, entropy=entropy, keep=keep)
    loss_sum, denominator = aggregate(per_token, valid, cfg.loss_agg, cfg.max_len)
    denominator = denominator.detach()
    m.sums["policy/loss"] = (loss_sum.detach(), denominator)
    return PolicyLossOutput(loss=finalize(loss_sum, denominator), loss_sum=loss_sum, denominator=denominator,
                            metrics=m)
