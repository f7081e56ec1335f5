"""The policy loss's per-token gradient, chunk by chunk, for loss.head=fused_grad (fused_grad.py).

    reason = fused_grad_fallback(cfg, old_from_current, cp_size=cp)   # None: per-chunk is exact
    coef_fn = loss_coef_fn(cfg, (b, s), dev, given=..., whole=..., agg_weight=w)   # step/head.py
    lp, ent, z = fused_grad_logprobs(hidden, weight, targets, coef_fn, ...)

Two modes. Chunk-local (chunk_local(cfg, agg_weight) True: the policy step's agg_weight path and
no sequence total in the gradient): each chunk runs the loss on its own rows only, every per-token
input gathered to [1, rows] (rows_loss), so a microbatch costs O(s) in all. Otherwise coef_fn keeps
a [b, s] buffer of the logprobs (and entropies) filled so far and, for each chunk, differentiates
the whole microbatch's loss on a leaf copy of it: O(s) per chunk, O(s^2) per microbatch. Both are
exact for every loss whose gradient at a token reads only that token's values and given inputs
(fused_grad_fallback says which are not). Pure tensor code; no seq_sum here runs collectives.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..config import LossConfig
from .common import SeqSum, row_sum
from .compute import compute_policy_loss, per_token_policy_loss
from .corrections import correction_chunk_problem
from .metrics import Metrics
from .registry import check_loss_config


def fused_grad_fallback(cfg: LossConfig, old_from_current: bool, *, cp_size: int = 1,
                        kept_set: bool = False) -> Optional[str]:
    """Why this loss's gradient cannot be formed chunk by chunk (so loss.head=fused_grad falls back
    to 'fused' for it), or None when it can. Sequence quantities of *given* inputs (pi_old,
    pi_rollout) are exact per chunk when each rank holds whole sequences (cp_size 1); those of the
    current policy never are. kept_set: the microbatch replays sampling masks (the op takes none).
    """
    spec = check_loss_config(cfg)
    if kept_set:
        return "the microbatch has kept sets (sampling-mask replay), which fused_grad_logprobs does not take"
    if not spec.per_token:
        return (f"policy_loss={cfg.policy_loss!r} is not registered per_token=True: its loss may read whole "
                "sequences")
    if cfg.tis.level == "sequence" and old_from_current:
        return "tis.level='sequence' with pi_old from the training forward reads the current policy's sequence total"
    if cfg.tis.level == "sequence" and cp_size > 1:
        return "tis.level='sequence' under context parallelism needs a CP all-reduce of sequence totals per chunk"
    return correction_chunk_problem(cfg.correction, spec.anchor_for(cfg), old_from_current, cp_size)


def microbatch_loss(cfg: LossConfig, lp: Tensor, *, given: dict, seq_sum: SeqSum = row_sum,
                    agg_weight: Optional[Tensor] = None, agg_share: Optional[Tensor] = None,
                    loss_scale=1.0) -> tuple[Tensor, Optional[Tensor], Metrics]:
    """The policy step's loss of one microbatch. lp: [b, s] fp32; given: per_token_policy_loss's
    keyword inputs (advantages, loss_mask, old/rollout/ref_logprobs, entropy, keep).
    With agg_weight [b, s]: (loss_scale * sum(agg_weight * per_token), None, Metrics with
    policy/loss over agg_share). Without: compute_policy_loss's (loss_sum, denominator, Metrics)."""
    if agg_weight is None:
        res = compute_policy_loss(cfg, lp, **given)
        return res.loss_sum, res.denominator, res.metrics
    per_token, valid, m = per_token_policy_loss(cfg, lp, seq_sum=seq_sum, **given)
    loss_sum = (per_token * agg_weight).sum()
    m.sums["policy/loss"] = (loss_sum.detach(), (agg_share * valid).sum())
    return loss_sum * loss_scale, None, m


def chunk_local(cfg: LossConfig, agg_weight: Optional[Tensor]) -> bool:
    """Whether each chunk's coefficients can come from the loss of its rows alone (rows_loss): with
    agg_weight (the policy step's fixed per-token weights) and no sequence total reaching the
    gradient (tis.level='sequence' and correction.geo_rs weight tokens by one). Without
    agg_weight, compute_policy_loss divides by per-sequence counts of the microbatch."""
    return agg_weight is not None and cfg.tis.level != "sequence" and cfg.correction.geo_rs is None


def rows_loss(cfg: LossConfig, lp: Tensor, ent: Optional[Tensor], pick: Callable[[Tensor], Tensor], *,
              given: dict, agg_weight: Tensor, loss_scale=1.0, old_from_current: bool = False) -> Tensor:
    """microbatch_loss's value restricted to some tokens, when chunk_local holds: lp, ent [1, n];
    pick(t) takes a [b] or [b, s] input at those tokens -> [1, n]. given: as microbatch_loss's
    (entropy left out). Its seq_sum is a row sum over the n tokens: with chunk_local only the
    discarded metrics read it. old_from_current: pi_old is lp.detach()."""
    g = {k: None if v is None or k == "entropy" else pick(v) for k, v in given.items()}
    g["loss_mask"] = g["loss_mask"] != 0  # the whole microbatch's loss checks its values (a host sync)
    if old_from_current:
        g["old_logprobs"] = lp.detach()
    per_token, _, _ = per_token_policy_loss(cfg, lp, seq_sum=row_sum, **dict(g, entropy=ent))
    return (per_token * pick(agg_weight)).sum() * loss_scale


def loss_coef_fn(cfg: LossConfig, shape: tuple[int, int], device, *, given: dict, whole: Callable,
                 agg_weight: Optional[Tensor] = None, loss_scale=1.0, old_from_current: bool = False,
                 entropy: bool = False) -> Callable:
    """The coef_fn of a microbatch's policy loss (shape (b, s)): chunk-local (rows_loss) where
    chunk_local holds, else whole(lp [b, s], ent or None) -> the microbatch's loss, differentiated per
    chunk. given: as rows_loss's; entropy: the head computes entropies (their gradient is taken when
    cfg.entropy_coef != 0). Exact when fused_grad_fallback is None."""
    entropy_grad = cfg.entropy_coef != 0
    if chunk_local(cfg, agg_weight):  # O(rows) per chunk: the chunk's tokens alone
        return chunk_coef_fn(
            lambda lp, ent, pick: rows_loss(cfg, lp, ent, pick, given=given, agg_weight=agg_weight,
                                            loss_scale=loss_scale, old_from_current=old_from_current),
            shape, device=device, entropy=entropy, entropy_grad=entropy_grad, local=True)
    # a sequence total reaches the gradient: the whole microbatch's loss per chunk
    return chunk_coef_fn(whole, shape, device=device, entropy=entropy, entropy_grad=entropy_grad)


def chunk_coef_fn(loss_of: Callable[..., Tensor], shape: tuple[int, int], *, device, entropy: bool = False,
                  entropy_grad: bool = False, local: bool = False) -> Callable:
    """coef_fn (fused_grad.CoefFn; losses may not import the op) for fused_grad_logprobs over a
    microbatch of `shape` (b, s).

    Rows are the op's s-major positions (row = s_idx * b + b_idx). local=False: loss_of(lp [b, s],
    ent [b, s] or None) -> the scalar whose gradient the head computes; each call writes its rows
    into [b, s] buffers and differentiates loss_of on leaf copies. local=True (chunk_local):
    loss_of(lp [1, n], ent [1, n] or None, pick) -> the loss of the chunk's n rows alone (rows_loss;
    pick gathers a [b] or [b, s] input at them). loss_of must run no collectives. Returns the rows'
    dL/dlp (and dL/dent when entropy_grad, else None). Exact when fused_grad_fallback is None.
    """
    b, s = shape
    lp_buf = None if local else torch.zeros(b, s, dtype=torch.float32, device=device)
    ent_buf = torch.zeros_like(lp_buf) if entropy and not local else None

    def coef_fn(r0: int, r1: int, lp_rows: Tensor, ent_rows: Optional[Tensor]):
        rows = torch.arange(r0, r1, device=device)
        si, bi = rows // b, rows % b  # [s, b] rows -> [b, s] positions
        with torch.enable_grad():  # the op may call us inside its autograd.Function.forward
            if local:
                lp = lp_rows.detach().float()[None].requires_grad_(True)
                ent = None if ent_rows is None or not entropy else ent_rows.detach().float()[None]
                ent = None if ent is None else ent.requires_grad_(entropy_grad)
                loss = loss_of(lp, ent, lambda t: (t[bi] if t.dim() == 1 else t[bi, si])[None])
            else:
                lp_buf[bi, si] = lp_rows.detach().float()
                if ent_buf is not None:
                    ent_buf[bi, si] = ent_rows.detach().float()
                lp = lp_buf.clone().requires_grad_(True)
                ent = None if ent_buf is None else ent_buf.clone().requires_grad_(entropy_grad)
                loss = loss_of(lp, ent)
            wrt = [lp, ent] if entropy_grad else [lp]
            grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        picked = [torch.zeros(r1 - r0, device=device) if g is None else g[0] if local else g[bi, si]
                  for g in grads]
        return picked[0], (picked[1] if entropy_grad else None)
    return coef_fn
