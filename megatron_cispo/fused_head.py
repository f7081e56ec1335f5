"""The output layer fused with token log-probabilities: the [tokens, v_local] logits never exist.

    lp = fused_token_logprobs(hidden, output_weight, targets, sequence_parallel=sp)   # [s, b] fp32

Same numbers as token_logprobs(F.linear(hidden, weight), targets): each chunk of rows' logits is
made by one matmul and fed to vocab_softmax.py's chunk statistics (which token_logprobs uses too);
backward recomputes it from the saved hidden, weight and row statistics, and accumulates the weight
gradient chunk by chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from .kept_set import KeptSet, Replay, plan_replay
from .vocab_softmax import (DTYPES, IGNORE_INDEX, Plan, check_devices, chunk_grad, chunk_stats, empty_stats,
                            grad_rows, plan_targets, reduce_stats, resolve_group, row_chunks, workspace)

# Newer torch renames the tensor collectives (the old names warn); older torch has only the old.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# The fused heads' default chunk comes from a memory budget: their workspace holds at most
# 1/SHARD_CHUNKS of the fp32 [N, v_local] logits shard they never build, so their working set is a
# fixed fraction of the unfused head's at any length, and a long sequence runs fewer, larger GEMMs
# (the weight gradient's [v_local, h] sum is read and written once per chunk). Below about
# SHARD_CHUNKS x MIN_CHUNK_ROWS rows the floor wins: fewer rows run a CPU matmul well below peak
# (32 rows: 1.5x slower than 128, s=512, h=256), and the whole shard is small there.
SHARD_CHUNKS = 16
MIN_CHUNK_ROWS = 128


def default_chunk_rows(n_rows: int, workspace_bytes: int) -> int:
    """Rows per chunk of a fused head over n_rows rows ([s, b] positions) whose workspace holds
    `workspace_bytes` per logit of a chunk: the rows whose workspace is 1/SHARD_CHUNKS of the fp32
    logits shard, at least MIN_CHUNK_ROWS. It depends on neither the rank nor its valid columns, so
    every TP rank runs the same chunks and per-chunk reductions."""
    return max(MIN_CHUNK_ROWS, 4 * n_rows // (SHARD_CHUNKS * workspace_bytes))


@dataclass(frozen=True)
class _Head:
    compute: torch.dtype  # the dtype of every matmul (head_dtype, else the inputs' dtype)
    sequence_parallel: bool
    tp: int
    rank: int


def _reduce_scatter_via_all_reduce(group) -> bool:
    """gloo lacks reduce_scatter (or some of its dtypes) on older torch builds; it is a CPU
    backend, so the extra bytes of an all-reduce cost nothing that matters. The distributed test
    also runs the reduce-scatter path, which this torch's gloo has."""
    return dist.get_backend(group) == "gloo"


def _chunk_logits(hc: Tensor, wc: Tensor, w: Tensor) -> Tensor:
    """hc [r, h] @ wc[nv, h].T in their (common) dtype; fp32 logits are written straight into the
    fp32 workspace w [r, nv], which chunk_stats / chunk_grad then work on in place."""
    if hc.dtype == torch.float32:
        return torch.mm(hc, wc.t(), out=w)
    return torch.mm(hc, wc.t())


class _FusedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, lt: Tensor, owned: Tensor, valid: Tensor,
                plan: Plan, head: _Head, replay: Replay | None):
        ctx.hidden_meta = (hidden.shape, hidden.dtype)  # this rank's: the gradient's shape and dtype
        gather = head.sequence_parallel and plan.group is not None
        local = hidden.contiguous() if gather else None
        if gather:  # [s/tp, b, h] -> [s, b, h]
            hidden = _gather_sequence(local, plan.group, head.tp)
        x = hidden.reshape(-1, hidden.shape[-1])  # [N, h]; a copy only for a non-contiguous view
        nv, entropy = plan.n_valid, plan.entropy
        wc = weight[:nv].to(head.compute)  # a copy only when head_dtype differs from the weight's
        m, s, e = empty_stats(x.shape[0], entropy, x.device)
        tx = torch.zeros_like(s)  # target logit; valid on its owner only
        ws = workspace((2 if entropy else 1) * plan.chunk_rows * nv, x.device)
        if replay is not None:  # each chunk reads its rows' kept logits, a slice of the entries
            kv = torch.empty(replay.row.shape, dtype=torch.float32, device=x.device)
            _, _, bounds = replay.by_chunk(None, plan.chunk_rows)
        for c, (r0, r1) in enumerate(row_chunks(x.shape[0] if nv else 0, plan.chunk_rows)):
            n = (r1 - r0) * nv
            w = ws[:n].view(r1 - r0, nv)
            logits = _chunk_logits(x[r0:r1].to(head.compute), wc, w)
            tx[r0:r1] = logits.gather(1, lt[r0:r1, None]).squeeze(1)
            if replay is not None:
                k = slice(bounds[c], bounds[c + 1])
                kv[k] = logits[replay.row[k] - r0, replay.col[k]]
            chunk_stats(w, ws[n:2 * n].view_as(w) if entropy else None, logits, m[r0:r1], s[r0:r1],
                         None if e is None else e[r0:r1], plan.temperature)
        replay = None if replay is None else replace(replay, kv=kv)
        lp, ent, s, e_mean, pk = reduce_stats(m, s, e, tx, owned, valid, plan, replay)
        ctx.set_materialize_grads(False)
        # Under SP keep only this rank's slice, as ColumnParallelLinear does, and gather it again
        # in backward: the gathered [N, h] would be tp times the activation memory.
        ctx.save_for_backward(local if gather else x, weight)
        ctx.plan, ctx.head, ctx.stats = plan, head, (m, s, e_mean, lt, owned, valid)
        ctx.replay = (replay, pk)
        shape = hidden.shape[:-1]
        return (lp.view(shape), ent.view(shape)) if entropy else lp.view(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp: Tensor | None, g_ent: Tensor | None = None):
        x, weight = ctx.saved_tensors
        plan, head, (rp, pk) = ctx.plan, ctx.head, ctx.replay
        if head.sequence_parallel and plan.group is not None:
            x = _gather_sequence(x, plan.group, head.tp)
            x = x.view(-1, x.shape[-1])
        need_h, need_w = ctx.needs_input_grad[:2]
        nv, cd, t = plan.n_valid, head.compute, plan.temperature
        coef, active = grad_rows(g_lp if rp is None else rp.dense_part(g_lp), g_ent, ctx.stats, t)
        if rp is not None and g_lp is not None:  # rows whose kept-set gradient needs their logits
            active = active | (rp.rows & (g_lp.reshape(-1) != 0))
        wc = weight[:nv].to(cd)
        rows = (active.nonzero().squeeze(1) if nv and (need_h or need_w)  # host sync: rows to skip
                else torch.zeros(0, dtype=torch.long, device=x.device))
        dense = rows.numel() == x.shape[0]
        gh = (torch.empty if dense else torch.zeros)(x.shape, dtype=cd, device=x.device) if need_h else None
        gw = torch.zeros_like(weight) if need_w else None
        # the weight gradient sums over every chunk: in fp32, whatever the weight's dtype
        own_acc = gw is not None and gw.dtype != torch.float32
        acc = torch.zeros(gw[:nv].shape, dtype=torch.float32, device=x.device) if own_acc else (
            None if gw is None else gw[:nv])
        n_ws = 1 if coef.a is None else 2
        ws = workspace(n_ws * plan.chunk_rows * nv, x.device)
        if rp is not None:  # every entry with a gradient is in an active row
            ck = rp.coef(g_lp, pk, t)
            pos, sel, bounds = rp.by_chunk(None if dense else rows, plan.chunk_rows)
        for c, (c0, c1) in enumerate(row_chunks(rows.numel(), plan.chunk_rows)):
            idx = slice(c0, c1) if dense else rows[c0:c1]
            n = (c1 - c0) * nv
            w = ws[:n].view(c1 - c0, nv)
            hc = x[idx].to(cd)
            g = chunk_grad(w, None if coef.a is None else ws[n:2 * n].view_as(w),
                            _chunk_logits(hc, wc, w), coef.take(idx), t)  # d loss / d logits
            if rp is not None:
                k = sel[bounds[c]:bounds[c + 1]]
                g.index_put_((pos[k] - c0, rp.col[k]), ck[k], accumulate=True)
            g = g.to(cd)
            if need_h:
                gh[idx] = g @ wc
            if acc is not None and cd == torch.float32:
                acc.addmm_(g.t(), hc)
            elif acc is not None:  # a cd matmul rounds each chunk's part once; the sum is fp32
                acc.add_(g.t() @ hc)
        if own_acc:
            gw[:nv].copy_(acc)
        if gh is not None:
            gh = _sum_hidden_grad(gh, plan.group, head)
            shape, dtype = ctx.hidden_meta
            gh = gh.view(shape).to(dtype)
        return gh, gw, None, None, None, None, None, None


def _gather_sequence(local: Tensor, group, tp: int) -> Tensor:
    """[s/tp, b, h] (contiguous) on every TP rank -> [s, b, h] in rank order: one all-gather."""
    full = local.new_empty((local.shape[0] * tp, *local.shape[1:]))
    _all_gather(full, local, group=group)
    return full


def _sum_hidden_grad(gh: Tensor, group, head: _Head) -> Tensor:
    """Sum the per-shard hidden gradients [N, h] over TP, as ColumnParallelLinear's backward does:
    one all-reduce, or under sequence parallelism one reduce-scatter to this rank's [N/tp, h]."""
    if group is None:
        return gh
    if not head.sequence_parallel:
        dist.all_reduce(gh, group=group)
        return gh
    if _reduce_scatter_via_all_reduce(group):
        dist.all_reduce(gh, group=group)
        return gh.chunk(head.tp)[head.rank].clone()  # the clone frees the other ranks' rows
    out = gh.new_empty((gh.shape[0] // head.tp, gh.shape[1]))
    _reduce_scatter(out, gh, group=group)
    return out


def check_head_args(hidden, weight, targets, mask, tp, sp, head_dtype) -> None:
    """The argument checks both fused heads share; ValueError naming the field."""
    for name, tensor, dim in (("hidden", hidden, 3), ("weight", weight, 2)):
        if tensor.dtype not in DTYPES or tensor.dim() != dim:
            raise ValueError(f"{name}: expected a {dim}-d fp32/bf16/fp16 tensor, found {tensor.dtype} "
                             f"of shape {tuple(tensor.shape)}")
    check_devices({"hidden": hidden, "targets": targets, "mask": mask})
    if weight.shape[1] != hidden.shape[-1] or weight.device != hidden.device:
        raise ValueError(f"weight: expected [v_local, {hidden.shape[-1]}] on {hidden.device} (hidden's "
                         f"h and device), found {tuple(weight.shape)} on {weight.device}")
    if head_dtype is not None and head_dtype not in DTYPES:
        raise ValueError(f"head_dtype: expected None, torch.float32, torch.bfloat16 or torch.float16, "
                         f"found {head_dtype!r}")
    if head_dtype is None and hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight: expected one dtype, found {hidden.dtype} and "
                         f"{weight.dtype}; pass head_dtype= to run the head in one of them")
    seq = hidden.shape[0] * (tp if sp else 1)
    if (targets.shape != (seq, hidden.shape[1]) or targets.dtype.is_floating_point
            or targets.dtype == torch.bool):
        where = f" ({tp} sequence-parallel slices of {hidden.shape[0]})" if sp else ""
        raise ValueError(f"targets: expected integer ids of shape {(seq, hidden.shape[1])}, hidden's "
                         f"[s, b]{where}, found {targets.dtype} of shape {tuple(targets.shape)}")


def fused_token_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, *, tp_group=None, sequence_parallel: bool = False,
    temperature: float = 1.0, return_entropy: bool = False, vocab_size: int | None = None,
    mask: Tensor | None = None, ignore_index: int = IGNORE_INDEX, chunk_rows: int | None = None,
    head_dtype: torch.dtype | None = None, keep: KeptSet | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """log softmax(hidden @ weight.T / T)[target] over a vocabulary sharded across the TP group,
    without the [tokens, v_local] logits ever existing (forward or backward).

    hidden: [s, b, h] fp32|bf16|fp16, the output layer's input (any strides; a non-contiguous
        view is copied once, [s*b, h]). With sequence_parallel, this rank's [s/tp, b, h] slice.
    weight: [v_local, h], this rank's vocabulary shard (rank r holds global rows
        [r * v_local, (r + 1) * v_local)): the output layer's weight or the tied embedding's.
    targets: [s, b] int, global ids (already shifted) in [0, vocab_size), or ignore_index.
    tp_group: None means megatron's TP group when its parallel state is initialised, else one
        process. vocab_size, mask, ignore_index, temperature, return_entropy: as in token_logprobs.
    chunk_rows: rows of logits per chunk; the working set is O(chunk_rows * v_local). Default
        default_chunk_rows: a workspace of 1/16 of the fp32 logits shard (1/16 of the s*b rows,
        1/32 with entropy, whose probabilities take a second block), at least 128.
    head_dtype: the dtype of the matmuls (torch.float32 gives an fp32 head from bf16 parameters;
        it costs one [v_local, h] copy of the weight in forward and one in backward); None means
        the inputs' dtype, and then hidden and weight must agree.
    keep: sampling-mask replay over the flattened [s, b] targets, as in token_logprobs; each chunk
        of rows reads and differentiates its slice of the kept ids.
    Returns logprobs [s, b] fp32, or (logprobs, entropy); gradients flow to hidden (summed over
    TP as ColumnParallelLinear's backward does) and to weight (in weight's dtype, summed over the
    chunks in fp32).
    Collectives over tp_group (none for one process): forward does one all-gather of hidden under
    sequence parallelism, then one MAX and one packed SUM all-reduce of [s*b] fp32 stats; backward
    does one all-reduce of the [s*b, h] hidden gradient (a reduce-scatter under sequence
    parallelism). Host syncs: one validates targets, one in backward counts the rows to skip.
    """
    _, tp, rank = resolve_group(tp_group)
    sp = bool(sequence_parallel)
    check_head_args(hidden, weight, targets, mask, tp, sp, head_dtype)
    plan, lt, owned, valid = plan_targets(
        targets.long(), weight.shape[0], hidden.device, tp_group=tp_group, temperature=temperature,
        return_entropy=return_entropy, vocab_size=vocab_size, mask=mask, ignore_index=ignore_index,
        chunk_rows=default_chunk_rows(targets.numel(), 8 if return_entropy else 4) if chunk_rows is None
        else chunk_rows)
    head = _Head(head_dtype or hidden.dtype, sp, tp, rank)
    replay = plan_replay(keep, targets, valid, plan)
    return _FusedTokenLogprobs.apply(hidden, weight, lt, owned, valid, plan, head, replay)
