"""Vocab-parallel token log-probabilities (and entropy) that never gather the vocabulary.

    lp = token_logprobs(logits, targets)                                   # [s, b] fp32
    lp, ent = token_logprobs(logits, targets, temperature=0.7, return_entropy=True)
    lp = token_logprobs(logits, targets, keep=KeptSet(ids, offsets))  # over the sampler's kept set

This is the pure-PyTorch reference path; it runs on CPU and GPU alike. Forward streams the
logits once through a small reusable fp32 workspace and does 2 small TP all-reduces; backward
recomputes the softmax chunk by chunk, does no collective, and writes the gradient once.
The chunked softmax itself (vocab_softmax.py) is shared with fused_head.py.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from typing import Literal

import torch
from torch import Tensor

from .kept_set import KeptSet, Replay, plan_replay
from .vocab_softmax import (DTYPES, IGNORE_INDEX, Plan, check_devices, chunk_grad, chunk_stats, empty_stats,
                            grad_buffer, grad_rows, plan_targets, reduce_stats, row_chunks, workspace)

def _local_stats(x2: Tensor, plan: Plan):
    """Per row of this shard: max logit m, S = sum 2^u and E = sum 2^u * u, u = (x - m) log2(e) / T.

    x2: [N, v_local] any float dtype. Returns m (raw logit units), S, E (None without entropy),
    all [N] fp32. One read of the shard; the fp32 workspace holds at most 2 chunks.
    """
    n_rows, nv = x2.shape[0], plan.n_valid
    m, s, e = empty_stats(n_rows, plan.entropy, x2.device)
    if nv == 0:
        return m, s, e
    ws = workspace((2 if plan.entropy else 1) * plan.chunk_rows * nv, x2.device)
    for r0, r1 in row_chunks(n_rows, plan.chunk_rows):
        n = (r1 - r0) * nv
        w = ws[:n].view(r1 - r0, nv)
        p = ws[n:2 * n].view_as(w) if plan.entropy else None
        chunk_stats(w, p, x2[r0:r1, :nv], m[r0:r1], s[r0:r1], None if e is None else e[r0:r1],
                     plan.temperature)
    return m, s, e


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, lt: Tensor, owned: Tensor, valid: Tensor, plan: Plan,
                replay: Replay | None):
        x2 = logits.reshape(-1, logits.shape[-1])
        m, s, e = _local_stats(x2, plan)
        tx = x2.gather(1, lt[:, None]).squeeze(1).float()  # target logit; valid on its owner only
        if replay is not None:  # the kept ids' logits: [E], read once, kept for backward
            replay = replace(replay, kv=x2[replay.row, replay.col].float())
        lp, ent, s, e_mean, pk = reduce_stats(m, s, e, tx, owned, valid, plan, replay)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits)
        ctx.plan, ctx.stats, ctx.replay = plan, (m, s, e_mean, lt, owned, valid), (replay, pk)
        shape = logits.shape[:-1]
        return (lp.view(shape), ent.view(shape)) if plan.entropy else lp.view(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp: Tensor | None, g_ent: Tensor | None = None):
        logits, = ctx.saved_tensors
        plan, (rp, pk) = ctx.plan, ctx.replay
        inplace = plan.inplace is True or (plan.inplace == "auto" and _sole_owner(logits))
        x2 = logits.reshape(-1, logits.shape[-1])
        n_rows, nv, t = x2.shape[0], plan.n_valid, plan.temperature
        coef, active = grad_rows(g_lp if rp is None else rp.dense_part(g_lp), g_ent, ctx.stats, t)
        out = x2 if inplace else grad_buffer(x2)
        if nv == 0:  # this shard is all vocab padding
            return out.zero_().view_as(logits), None, None, None, None, None
        if nv < x2.shape[1]:
            out[:, nv:].zero_()  # vocab padding takes no part in the softmax
        rows = active.nonzero().squeeze(1)  # host sync: row skipping needs the count
        if rows.numel() < n_rows:
            out.index_fill_(0, (~active).nonzero().squeeze(1), 0.0)
        dense = rows.numel() == n_rows
        # fp32 rows of the gradient are their own workspace: no copy-out pass
        direct = dense and out.dtype == torch.float32 and nv == x2.shape[1]
        n_ws = (0 if direct else 1) + (0 if coef.a is None else 1)
        ws = workspace(n_ws * plan.chunk_rows * nv, x2.device)
        if rp is not None:  # kept entries of the dense rows join their chunk; the rest go after
            ck = rp.coef(g_lp, pk, t)
            pos, sel, bounds = rp.by_chunk(None if dense else rows, plan.chunk_rows)
        for c, (c0, c1) in enumerate(row_chunks(rows.numel(), plan.chunk_rows)):
            idx = slice(c0, c1) if dense else rows[c0:c1]
            n = (c1 - c0) * nv
            w = out[idx] if direct else ws[:n].view(c1 - c0, nv)
            p = None if coef.a is None else ws[n_ws * n - n:n_ws * n].view_as(w)  # the last slot
            chunk_grad(w, p, x2[idx, :nv], coef.take(idx), t)
            if rp is not None:
                k = sel[bounds[c]:bounds[c + 1]]
                w.index_put_((pos[k] - c0, rp.col[k]), ck[k], accumulate=True)
            if direct:
                continue
            if dense:
                out[idx, :nv].copy_(w)
            else:
                out[:, :nv].index_copy_(0, idx, w.to(out.dtype))
        if rp is not None and not dense:  # rows with only a kept-set gradient: zeros until here
            k = (pos < 0).nonzero().squeeze(1)
            out.index_put_((rp.row[k], rp.col[k]), ck[k].to(out.dtype), accumulate=True)
        return out.view_as(logits), None, None, None, None, None


_calibrated: list = []  # [expected counts or None], filled once per process


class _Probe(torch.autograd.Function):
    """Saves its input and, in backward, records the reference counts `_sole_owner` sees."""
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sum()

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        _sole_owner(x, record=_Probe.seen)  # same call depth as the real backward's check
        return None


def _calibrate() -> tuple | None:
    """Counts a saved input shows in backward when autograd holds the only reference to it.

    Measured on this torch build with a probe op, next to the counts when the caller still
    holds the tensor; None (auto in-place off) if the two cannot be told apart.
    """
    if not _calibrated:
        with torch.enable_grad():
            w = torch.zeros(2, 2, requires_grad=True)
            _Probe.seen.clear()
            for keep in (True, False):
                x = w * 1.0
                y = _Probe.apply(x)
                if not keep:
                    del x
                y.backward()
        held, alone = _Probe.seen
        _calibrated.append(alone if held != alone else None)
    return _calibrated[0]


def _sole_owner(x: Tensor, record: list | None = None) -> bool:
    """True only when autograd's saved reference is the sole owner of x and of its storage:
    Python references, C++ references (other graph nodes) and views all raise a count."""
    counts = (sys.getrefcount(x), x._use_count(),
              torch._C._storage_Use_Count(x.untyped_storage()._cdata))
    if record is not None:
        record.append(counts)
        return False
    return (counts == _calibrate() and x.grad_fn is not None and x._base is None
            and x.is_contiguous() and x.storage_offset() == 0
            and x.untyped_storage().nbytes() == x.numel() * x.element_size())


def token_logprobs(
    vocab_parallel_logits: Tensor, targets: Tensor, *, tp_group=None, temperature: float = 1.0,
    return_entropy: bool = False, vocab_size: int | None = None, mask: Tensor | None = None,
    ignore_index: int = IGNORE_INDEX, inplace_backward: bool | Literal["auto"] = "auto",
    chunk_rows: int | None = None, keep: KeptSet | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """log softmax(logits / T)[target] over a vocabulary sharded across the TP group, or over the
    sampler's kept set (keep=: sampling-mask replay).

    vocab_parallel_logits: [*lead, v_local] fp32|bf16|fp16; rank r holds global columns
        [r * v_local, (r + 1) * v_local). Never modified, except as `inplace_backward` says.
        Contiguous is expected (megatron's are); other layouts are copied once.
    targets: [*lead] int, global token ids in [0, vocab_size), or `ignore_index`.
    tp_group: None means megatron's TP group when its parallel state is initialised, else one
        process. vocab_size: the true vocabulary; columns at global index >= vocab_size are
        padding and excluded (default: v_local * tp, no padding). mask: [*lead] bool, False
        marks ignored positions. Ignored positions get logprob 0 and no logprob gradient.
    return_entropy: also return the entropy of softmax(logits / T), differentiable, [*lead]
        fp32, for every position (ignored ones included).
    inplace_backward: "auto" writes the gradient into the logits buffer only when autograd
        holds the sole reference to it and its storage (checked by reference counts in
        backward), so the caller cannot observe it; True always does (the caller promises not
        to read the logits after backward); False never does.
    chunk_rows: rows per workspace chunk (default: sized by CHUNK_BYTES).
    keep: the kept vocabulary ids of each [*lead] position (kept_set.KeptSet, global ids, the same
        on every TP rank): lp = z_target - logsumexp over the kept ids of z = logits / T, whose
        gradient is ([v = target] - p^K_v) / T on kept ids and 0 elsewhere. A position with an
        empty set keeps the full vocabulary; a trained target outside its set is an error. Entropy
        stays the full distribution's. Extra memory O(kept ids); no extra collective.
    Returns logprobs [*lead] fp32, or (logprobs, entropy).
    Collectives: forward does one MAX and one packed SUM all-reduce of [*lead]-sized fp32 stats
    over tp_group (none for one process); backward does none. One host sync validates targets
    and one in backward counts the rows to skip (keep adds two in forward, one to three in backward).
    """
    x = vocab_parallel_logits
    if x.dtype not in DTYPES or x.dim() < 1:
        raise ValueError(f"vocab_parallel_logits: expected [*lead, v_local] fp32/bf16/fp16, found "
                         f"{x.dtype} of shape {tuple(x.shape)}")
    if targets.shape != x.shape[:-1] or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets: expected integer ids of shape {tuple(x.shape[:-1])} (logits' "
                         f"leading shape), found {targets.dtype} of shape {tuple(targets.shape)}")
    check_devices({"vocab_parallel_logits": x, "targets": targets, "mask": mask})
    targets = targets.long()  # uint8/int16/int32 ids index like int64 ones (gather takes int64)
    if inplace_backward not in (True, False, "auto"):
        raise ValueError(f"inplace_backward: expected True, False or 'auto', found {inplace_backward!r}")
    plan, lt, owned, valid = plan_targets(
        targets, x.shape[-1], x.device, tp_group=tp_group, temperature=temperature,
        return_entropy=return_entropy, vocab_size=vocab_size, mask=mask, ignore_index=ignore_index,
        chunk_rows=chunk_rows, inplace=inplace_backward)
    replay = plan_replay(keep, targets, valid, plan)
    if inplace_backward == "auto" and x.requires_grad and torch.is_grad_enabled():
        _calibrate()  # once per process, here rather than re-entrantly inside backward
    return _TokenLogprobs.apply(x, lt, owned, valid, plan, replay)
