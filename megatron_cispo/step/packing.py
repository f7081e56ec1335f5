"""Rollouts -> Microbatches for megatron's schedules: packed [1, T] bins (THD) or padded rows.

    layout = Layout(cp=2, cp_rank=r, pad_multiple=4)
    mbs = packed_microbatches(batch, weights, plan_bins(batch, 4096, layout), layout=layout)
    mbs = padded_microbatches(batch, weights, micro_batch_size=8, layout=layout)

Every per-token field is built on the whole sequence first (targets shifted before any split,
so a CP chunk boundary takes its target from the neighbouring chunk), then cut to this CP
rank's tokens with megatron's load-balanced 2*cp chunks per sequence. The aggregation weights
come from the whole global batch (losses.token_weights), so any split sums to the same loss.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..config import LossConfig
from ..losses import token_weights, valid_tokens
from .groups import default_groups, rank, size
from .head import unwrap
from .microbatch import Microbatch
from .reduce import all_reduce_in
from .rollouts import Rollouts, StepConfig

@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where a microbatch runs. pad_multiple: every sequence is padded to a multiple of it (2*cp
    under CP, times tp under sequence parallelism). uniform: every packed bin of a schedule call is
    padded to the longest one (pipeline parallelism sends fixed shapes between stages)."""

    cp: int = 1
    cp_rank: int = 0
    pad_multiple: int = 1
    uniform: bool = False
    padding_mask: bool = False  # hand the model the pad positions (MoE routers ignore them)
    vocab: Optional[int] = None  # the embedding's rows: input ids outside [0, vocab) become 0


def _embeddable(tokens: Tensor, vocab: Optional[int]) -> Tensor:
    """Input ids the embedding can look up: ids outside [0, vocab) (pad ids such as -100 or
    vocab_size under an untrained target) become 0. megatron's VocabParallelEmbedding range-masks
    only at tp > 1; at tp = 1 such an id is an index error, or a device-side assert on CUDA."""
    if vocab is None:
        return tokens
    return torch.where((tokens >= 0) & (tokens < vocab), tokens, torch.zeros_like(tokens))


def first_fit_decreasing(sizes: list[int], budget: int) -> list[list[int]]:
    """Bins of indices whose sizes sum to <= budget; largest first, ties by index (deterministic).
    Every size must fit the budget (`microbatches` refuses a longer row on every DP rank first)."""
    assert max(sizes, default=0) <= budget, "a row over the budget reached the packer"
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        for b, room in enumerate(free):
            if sizes[i] <= room:
                bins[b].append(i)
                free[b] -= sizes[i]
                break
        else:
            bins.append([i])
            free.append(budget - sizes[i])
    return [sorted(b) for b in bins]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def cp_indices(segments: list[int], cp: int, cp_rank: int, device) -> Tensor:
    """Positions of a packed row that CP rank `cp_rank` holds: chunks r and 2cp-1-r of every
    segment (each a multiple of 2*cp long), segment by segment (TE's THD partitioning)."""
    out, start = [], 0
    for length in segments:
        c = length // (2 * cp)
        for k in (cp_rank, 2 * cp - 1 - cp_rank):
            out.append(torch.arange(start + k * c, start + (k + 1) * c, device=device))
        start += length
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=device)


def _fields(batch: Rollouts, weights: tuple[Tensor, Tensor],
            token_fields: Optional[dict[str, Tensor]] = None) -> dict[str, Tensor]:
    n, s = batch.tokens.shape[0], batch.tokens.shape[1] - 1
    f = {"agg_weight": weights[0], "agg_share": weights[1], "loss_mask": batch.loss_mask.bool(),
         **(token_fields or {})}  # extra [n, s] fields, e.g. M2PO's "token_keep" (step.m2po)
    adv = batch.advantages
    f["advantages"] = (adv if adv.dim() == 2 else adv[:, None].expand(n, s)).float()
    for name in ("rollout_logprobs", "old_logprobs", "ref_logprobs"):
        if getattr(batch, name) is not None:
            f[name] = getattr(batch, name).float()
    if batch.routed_experts is not None:  # [n, s, L, k]: cut along [n, s] like the rest; no route on padding
        past = torch.arange(s, device=batch.tokens.device)[None, :] >= batch.target_lengths()[:, None]
        f["routed_experts"] = batch.routed_experts.long().masked_fill(past[..., None, None], -1)
    return f


_FILL = {"routed_experts": -1}  # what a field holds at padding positions (0 for the rest); -1 = no route


def _filler(t: Tensor, name: str, *lead: int) -> Tensor:
    """Padding of field `name` shaped [*lead, trailing dims of t]."""
    return t.new_full((*lead, *t.shape[2:]), _FILL.get(name, 0))


def plan_bins(batch: Rollouts, budget: int, window: Optional[int] = None) -> list[list[int]]:
    """Row indices of each packed microbatch: first-fit decreasing of the real lengths (at most
    `budget` real tokens a bin) within each window of `window` consecutive rows (None: all rows).

    The plan depends on nothing but the rows: a bin never spans two windows, and the CP / SP
    padding added afterwards does not change it, so the same rows share a microbatch in every
    layout, as padded microbatches do. (An MoE router's load-balancing loss is per microbatch.)
    Every row must fit the budget, as first_fit_decreasing says.
    """
    sizes = batch.target_lengths().tolist()
    window = window or len(sizes) or 1
    bins = []
    for start in range(0, len(sizes), window):
        part = first_fit_decreasing(sizes[start:start + window], budget)
        bins += [[start + i for i in b] for b in part]
    return bins


def packed_microbatches(batch: Rollouts, weights: tuple[Tensor, Tensor], bins: list[list[int]], *,
                        layout: Layout, token_fields: Optional[dict[str, Tensor]] = None) -> list[Microbatch]:
    """One [1, T_local] microbatch per bin of row indices (an empty bin is all padding). Each
    sequence is padded to layout.pad_multiple, so a bin may exceed the budget by that padding.

    weights: (agg_weight, agg_share), [n, s] from losses.token_weights on the global batch.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    m = layout.pad_multiple
    lengths = batch.target_lengths().tolist()
    padded = [_round_up(L, m) for L in lengths]
    longest = max([sum(padded[i] for i in rows) for rows in bins] + [m])
    fields = _fields(batch, weights, token_fields)
    dev, s = batch.tokens.device, batch.tokens.shape[1] - 1
    inputs = _embeddable(batch.tokens, layout.vocab)
    out = []
    for rows in bins:
        segs = [padded[i] for i in rows]
        real = [lengths[i] for i in rows]
        total = longest if layout.uniform else max(sum(segs), m)
        if total > sum(segs):  # filler: one all-padding segment at the end
            real.append(total - sum(segs))
            segs.append(total - sum(segs))
        ids, tgt, pos, gidx, seg, pad = [], [], [], [], [], []
        per = {k: [] for k in fields}
        for j, width in enumerate(segs):
            i = rows[j] if j < len(rows) else None  # None: the filler segment
            length = lengths[i] if i is not None else 0
            z = torch.zeros(width - length, dtype=torch.int64, device=dev)
            span = torch.arange(length, device=dev)
            ids.append(torch.cat([inputs[i, :length], z]) if i is not None else z)
            tgt.append(torch.cat([batch.tokens[i, 1:length + 1], z]) if i is not None else z)
            pos.append(torch.cat([span, z]))
            gidx.append(torch.cat([(i if i is not None else 0) * s + span, z - 1]))
            seg.append(torch.full((width,), j if i is not None else -1, dtype=torch.int64, device=dev))
            pad.append(torch.arange(width, device=dev) >= length)
            for k, t in fields.items():
                head = t[i, :length] if i is not None else _filler(t, k, 0)
                per[k].append(torch.cat([head, _filler(t, k, width - length)]))
        keep = cp_indices(segs, layout.cp, layout.cp_rank, dev) if layout.cp > 1 else None

        def local(parts: list[Tensor]) -> Tensor:
            t = torch.cat(parts)
            return (t if keep is None else t[keep])[None]
        cu_pad = torch.tensor([0, *segs], dtype=torch.int32, device=dev).cumsum(0, dtype=torch.int32)
        cu = torch.tensor([0, *real], dtype=torch.int32, device=dev).cumsum(0, dtype=torch.int32)
        pad_mask = local(pad)
        out.append(Microbatch(
            input_ids=local(ids), targets=local(tgt), position_ids=local(pos), gather_index=local(gidx),
            seq_index=local(seg), n_seqs=len(rows), **{k: local(v) for k, v in per.items()},
            packed_seq_params=PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                cu_seqlens_kv_padded=cu_pad, max_seqlen_q=max(segs), max_seqlen_kv=max(segs)),
            seq_length=total, num_tokens=(~pad_mask).sum().to(torch.int),
            padding_mask=pad_mask if layout.padding_mask else None))
    return out


def padded_microbatches(batch: Rollouts, weights: tuple[Tensor, Tensor], *, micro_batch_size: int,
                        layout: Layout, token_fields: Optional[dict[str, Tensor]] = None) -> list[Microbatch]:
    """Rows of `batch` in groups of micro_batch_size, [b, S] with S = s padded to pad_multiple."""
    if layout.cp > 1:
        raise ValueError(f"context parallelism (cp={layout.cp}) needs packed microbatches: set "
                         "StepConfig.max_tokens_per_microbatch (YAML parallelism.max_tokens_per_microbatch)")
    n, s = batch.tokens.shape[0], batch.tokens.shape[1] - 1
    width = _round_up(s, layout.pad_multiple)
    dev = batch.tokens.device
    lengths = batch.target_lengths()
    pos = torch.arange(width, device=dev)
    pad = pos[None, :] >= lengths[:, None]  # [n, S]
    extra = width - s

    def widen(t: Tensor, name: str = "") -> Tensor:
        return torch.cat([t, _filler(t, name, n, extra)], 1) if extra else t
    fields = {k: widen(v, k) for k, v in _fields(batch, weights, token_fields).items()}
    ids = widen(torch.where(pad[:, :s], 0, _embeddable(batch.tokens[:, :-1], layout.vocab)))
    tgt = widen(torch.where(pad[:, :s], 0, batch.tokens[:, 1:]))
    gidx = torch.where(pad, -1, torch.arange(n, device=dev)[:, None] * s + pos[None, :])
    out = []
    for r0 in range(0, n, micro_batch_size):
        r = slice(r0, r0 + micro_batch_size)
        b = ids[r].shape[0]
        out.append(Microbatch(
            input_ids=ids[r], targets=tgt[r], position_ids=pos.expand(b, width), gather_index=gidx[r],
            seq_index=torch.arange(b, device=dev)[:, None].expand(b, width), n_seqs=b,
            **{k: v[r] for k, v in fields.items()}, seq_length=width, num_tokens=(~pad[r]).sum().to(torch.int),
            padding_mask=pad[r] if layout.padding_mask else None))
    return out


def step_layout(chunks, step_cfg: StepConfig, pg_collection=None) -> Layout:
    """This rank's CP chunking, the padding that CP and sequence parallelism need, fixed bin
    shapes under pipeline parallelism, and whether the model routes tokens (MoE). pg_collection:
    the model's process groups (step/groups.py; default megatron's)."""
    from megatron.core.utils import get_model_config

    pg = default_groups(pg_collection)
    cfg = get_model_config(chunks[0])
    cp, tp = size(pg.cp), size(pg.tp)
    multiple = (2 * cp if cp > 1 else 1) * (tp if cfg.sequence_parallel else 1)
    return Layout(cp=cp, cp_rank=rank(pg.cp), pad_multiple=multiple, uniform=size(pg.pp) > 1,
                  padding_mask=getattr(cfg, "num_moe_experts", None) is not None,
                  vocab=getattr(unwrap(chunks[0])[0], "vocab_size", None))


def microbatches(batch: Rollouts, loss_cfg: Optional[LossConfig], step_cfg: StepConfig, layout: Layout,
                 dp_group, token_fields: Optional[dict[str, Tensor]] = None) -> list[Microbatch]:
    """`batch` (DP-local; one optimizer step's share) as Microbatches for the schedule.

    With a loss_cfg, attach the exact global normalisation (without: a forward-only pass). The
    per-token aggregation weights come from the whole batch, and one SUM all-reduce over DP gives
    the global denominator D and the global
    count N of model tokens; each microbatch returns loss_scale * sum(weight * loss) with
    loss_scale = N / D and num_tokens = its own model tokens, so megatron's division by the
    summed num_tokens (N) leaves the exact global loss, and an MoE router's aux loss is scaled by
    the tokens it saw. Packed: every DP rank runs the same number of bins (MAX all-reduce).
    token_fields: extra [n, s] Microbatch fields (token_keep), cut into every microbatch as
    loss_mask is (packed, padded, CP).
    """
    dev = batch.tokens.device
    if loss_cfg is not None:
        given = {k: getattr(batch, k) for k in ("old_logprobs", "rollout_logprobs", "ref_logprobs")}
        w, share, denom = token_weights(valid_tokens(loss_cfg, batch.loss_mask, **given), loss_cfg.loss_agg,
                                        loss_cfg.max_len)
    else:
        w = share = torch.zeros(batch.loss_mask.shape, device=dev)
    if step_cfg.max_tokens_per_microbatch is None:
        mbs = padded_microbatches(batch, (w, share), micro_batch_size=step_cfg.micro_batch_size, layout=layout,
                                  token_fields=token_fields)
    else:
        budget = step_cfg.max_tokens_per_microbatch
        longest = int(batch.target_lengths().max()) if batch.tokens.shape[0] else 0
        bins = plan_bins(batch, budget, step_cfg.micro_batch_size) if longest <= budget else []
        # One MAX over DP: every rank runs as many bins as the busiest (the EP all-to-all spans DP),
        # and a row over the budget on any rank stops every rank here, not one in a collective.
        stats = torch.tensor([len(bins), longest], dtype=torch.int64, device=dev)
        all_reduce_in(stats, dist.ReduceOp.MAX, dp_group)
        count, longest = stats.tolist()
        if longest > budget:
            raise ValueError(f"a row of {longest} tokens (on some data-parallel rank) exceeds "
                             f"max_tokens_per_microbatch={budget}; raise the budget")
        bins += [[] for _ in range(count - len(bins))]
        mbs = packed_microbatches(batch, (w, share), bins, layout=layout, token_fields=token_fields)
    extra: dict = {}
    if loss_cfg is not None:
        totals = torch.stack([denom.double(), batch.target_lengths().sum().double()]).to(dev)
        all_reduce_in(totals, dist.ReduceOp.SUM, dp_group)
        d_global, n_global = totals.tolist()
        extra["loss_scale"] = n_global / d_global if d_global > 0 else 0.0
    else:
        extra.update(agg_weight=None, agg_share=None)
    kept = batch.kept()  # sampling-mask replay: each microbatch's positions' sets, via its gather index
    # padding (gather index -1) gets an empty set: the full vocabulary
    return [replace(mb, **extra, **({} if kept is None else {"kept_set": kept.take(mb.gather_index)}))
            for mb in mbs]
