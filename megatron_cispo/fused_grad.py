"""The output layer fused with token log-probabilities AND the policy loss's gradient, all in the
forward pass: no logits, and no recompute in backward.

    lp, ent, z = fused_grad_logprobs(hidden, output_weight, targets, coef_fn, sequence_parallel=sp)
    (loss_value.detach() + z).backward()   # z is 0.0; its backward hands over the stored gradients

Same lp/ent as fused_token_logprobs. For a loss that is a sum of per-token terms f(lp_i, ent_i),
d loss / d logits of a chunk of rows needs only that chunk's lp and ent, so each chunk runs: one
GEMM into the fp32 workspace, vocab_softmax's chunk statistics and their TP reduction, lp/ent,
coef_fn (the caller's d loss / d lp and d loss / d ent of those rows), d loss / d logits
(vocab_softmax.chunk_grad), then gh[rows] = g @ W and gw += g^T @ h. Three GEMMs of N x h x v_local
against fused_token_logprobs's four; the chunk is then dropped.
Collectives over the TP group (none for one process), the same number and order on every rank:
one all-gather of hidden under sequence parallelism; per chunk one MAX and one packed SUM
all-reduce of [rows] fp32 stats; at the end, when hidden needs a gradient, one all-reduce of the
[N, h] hidden gradient (a reduce-scatter to this rank's [N/tp, h] under sequence parallelism).
Backward: none. Measured in docs/benchmarks.md (bench_head, fused_grad).
Host syncs: one (plan_targets validates the targets), none per chunk (coef_fn's own aside).
Memory: one workspace: the chunk's [chunk_rows, v_local] logits in the compute dtype (overwritten
by their gradient) plus fp32 scratch for (1 + entropy) blocks of CHUNK_BYTES (the elementwise
passes run block by block); gh [N, h] in the compute dtype (summed over TP, then kept in hidden's
dtype) and the weight gradient's fp32 sum over the chunks [v_local, h] held from forward to
backward (for a bf16 weight each chunk's part is added CHUNK_BYTES of vocabulary rows at a time).
Backward adds g * that sum into megatron DDP's fp32 weight.main_grad where it exists (and returns
a zero gradient so DDP's hook still runs), else returns it in the weight's dtype (a transient copy
for bf16). fp16 hidden states or weight are refused: the gradients would be rounded to fp16
before the loss scale (which arrives in backward) could protect them from underflow.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .fused_head import _gather_sequence, check_head_args, default_chunk_rows, _Head, _sum_hidden_grad
from .vocab_softmax import (CHUNK_BYTES, IGNORE_INDEX, Plan, chunk_grad, chunk_stats,
                            empty_stats, grad_rows, plan_targets, reduce_stats, resolve_group, row_chunks,
                            workspace)

# coef_fn(r0, r1, lp_rows, ent_rows) -> (d loss / d lp, d loss / d ent or None) of rows r0:r1
CoefFn = Callable[[int, int, Tensor, "Tensor | None"], "tuple[Tensor, Tensor | None]"]


def _chunk_bytes(device: torch.device) -> int:
    """vocab_softmax.CHUNK_BYTES for this device type (CUDA's for any other accelerator)."""
    return CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"])


class _StoredGrad(torch.autograd.Function):
    """z = 0.0 whose backward returns the gradients stored in forward, times z's incoming scalar
    gradient (megatron's loss scale, or 1). The weight's gradient is kept as its fp32 sum over the
    chunks. A weight with megatron DDP's fp32 `main_grad` gets g * sum added there directly (no
    rounding to the weight's dtype) and a zero gradient back, so AccumulateGrad still fires DDP's
    per-parameter hook, which adds param.grad (zero, plus a tied embedding's part) to main_grad and
    starts the overlapped reduce. Unlike megatron's gradient_accumulation_fusion it does not set
    grad_added_to_main_grad: with tied embeddings the hook would then drop the embedding's part of
    the summed grad. Any other weight gets the gradient in its own dtype."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, gh: Tensor | None, gw: Tensor | None):
        ctx.set_materialize_grads(False)
        ctx.grads, ctx.weight = (gh, gw), weight  # gw: the fp32 [n_valid, h] sum
        return hidden.new_zeros((), dtype=torch.float32)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor | None):
        grads, ctx.grads = ctx.grads, None  # handed over once: autograd may keep them as .grad
        if grads is None:
            raise RuntimeError("fused_grad_logprobs: backward ran twice through one call's z; its stored "
                               "gradients are handed over once (call fused_grad_logprobs again)")
        if g is None:
            return None, None, None, None
        gh, acc = grads
        weight = ctx.weight
        ctx.weight = None
        # scaled in place: a second [v_local, h] buffer would cost as much as the weight gradient
        gh = None if gh is None else gh.mul_(g.to(gh.dtype))
        gw = None
        if acc is not None:
            acc.mul_(g)
            main = getattr(weight, "main_grad", None)
            if main is not None and main.dtype == torch.float32 and main.shape == weight.shape:
                main[:acc.shape[0]].add_(acc)
                gw = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
            elif acc.shape[0] == weight.shape[0] and acc.dtype == weight.dtype:
                gw = acc
            else:  # vocabulary padding rows keep a zero gradient
                gw = torch.zeros_like(weight)
                gw[:acc.shape[0]].copy_(acc)
        return gh, gw, None, None


def _coefs(coef_fn: CoefFn, r0: int, r1: int, lp: Tensor, ent: Tensor | None, valid: Tensor):
    """coef_fn's (g_lp, g_ent) for rows r0:r1, checked, fp32, 0 on ignored rows (even NaN there)."""
    out = coef_fn(r0, r1, lp, ent)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(f"coef_fn: expected a (g_lp, g_ent or None) pair, found {type(out).__name__}")
    res = []
    for name, g in zip(("g_lp", "g_ent"), out):
        if g is None:
            res.append(None)
            continue
        if not isinstance(g, Tensor) or g.shape != (r1 - r0,) or not g.dtype.is_floating_point:
            raise ValueError(f"coef_fn: expected {name} a float tensor of shape ({r1 - r0},) for rows "
                             f"{r0}:{r1}, found {getattr(g, 'dtype', type(g).__name__)} of shape "
                             f"{tuple(getattr(g, 'shape', ()))}")
        res.append(torch.where(valid, g.float(), 0.0))
    if res[1] is not None and ent is None:
        raise ValueError("coef_fn: returned an entropy gradient, but return_entropy=False computes no entropy")
    return res


def _scratch(buf: Tensor, rows: int, nv: int, two: bool):
    """w [rows, nv] and p [rows, nv] (or None) fp32 views of the scratch part of the workspace."""
    n = rows * nv
    return buf[:n].view(rows, nv), buf[n:2 * n].view(rows, nv) if two else None


def _run(x: Tensor, weight: Tensor, coef_fn: CoefFn, lt: Tensor, owned: Tensor, valid: Tensor, plan: Plan,
         head: _Head, need_h: bool, need_w: bool):
    """lp [N], ent [N] or None, gh [N, h] (compute dtype, this rank's part) or None, and the fp32
    weight gradient of the valid vocabulary rows [n_valid, h] or None."""
    n_rows, nv, cd, t = x.shape[0], plan.n_valid, head.compute, plan.temperature
    wc = weight[:nv].to(cd)  # a copy only when head_dtype differs from the weight's
    lp = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    ent = torch.empty_like(lp) if plan.entropy else None
    gh = torch.empty(x.shape, dtype=cd, device=x.device) if need_h else None
    # the weight gradient sums over every chunk in fp32, whatever the weight's dtype; the only
    # [v_local, h]-sized buffer held from forward to backward (_StoredGrad forms the weight's grad)
    acc = torch.zeros((nv, weight.shape[1]), dtype=torch.float32, device=x.device) if need_w else None
    # One workspace: the chunk's logits in the compute dtype (the GEMMs want many rows; they are
    # overwritten by the chunk's d loss / d logits), then fp32 scratch w (and p, with entropy) for
    # `sub` rows at a time, CHUNK_BYTES each: the elementwise passes stay cache-sized on CPU.
    sub = max(1, min(plan.chunk_rows, _chunk_bytes(x.device) // (4 * max(1, nv))))
    n_log = -(-plan.chunk_rows * nv * cd.itemsize // 4)  # fp32 elements holding the logits
    ws = workspace(n_log + (1 + plan.entropy) * sub * nv, x.device)
    v_rows = max(1, _chunk_bytes(x.device) // (4 * x.shape[1]))
    scratch = ws[n_log:]
    for r0, r1 in row_chunks(n_rows, plan.chunk_rows):  # every rank: the same rows, the same chunks
        rows = slice(r0, r1)
        m, s, e = empty_stats(r1 - r0, plan.entropy, x.device)
        tx = torch.zeros_like(s)
        if nv:  # a rank holding only vocabulary padding still joins each chunk's reductions
            hc = x[rows].to(cd)
            logits = torch.mm(hc, wc.t(), out=ws[:n_log].view(cd)[:(r1 - r0) * nv].view(r1 - r0, nv))
            tx.copy_(logits.gather(1, lt[rows, None]).squeeze(1))
            for a0, a1 in row_chunks(r1 - r0, sub):
                w, p = _scratch(scratch, a1 - a0, nv, plan.entropy)
                chunk_stats(w, p, logits[a0:a1], m[a0:a1], s[a0:a1], None if e is None else e[a0:a1], t)
        lp_c, ent_c, s, e_mean, _ = reduce_stats(m, s, e, tx, owned[rows], valid[rows], plan)
        lp[rows] = lp_c
        if ent is not None:
            ent[rows] = ent_c
        g_lp, g_ent = _coefs(coef_fn, r0, r1, lp[rows], None if ent is None else ent[rows], valid[rows])
        if not nv or not (need_h or need_w):
            continue
        coef, _ = grad_rows(g_lp, g_ent, (m, s, e_mean, lt[rows], owned[rows], valid[rows]), t)
        for a0, a1 in row_chunks(r1 - r0, sub):  # logits[a0:a1] <- d loss / d logits, in cd
            w, p = _scratch(scratch, a1 - a0, nv, coef.a is not None)
            la = logits[a0:a1]
            if cd == torch.float32:  # in place: chunk_grad reads and writes fp32 logits
                chunk_grad(la, w if p is not None else None, la, coef.take(slice(a0, a1)), t)
            else:
                la.copy_(chunk_grad(w, p, la, coef.take(slice(a0, a1)), t))
        if need_h:
            torch.mm(logits, wc, out=gh[rows])
        if acc is not None and cd == torch.float32:
            acc.addmm_(logits.t(), hc)
        elif acc is not None:  # a cd matmul rounds each chunk's part once; the sum is fp32. By
            for v0, v1 in row_chunks(nv, v_rows):  # vocabulary slices: no [v_local, h] temporaries
                acc[v0:v1].add_(logits[:, v0:v1].t() @ hc)
    if need_h and not nv:
        gh.zero_()
    return lp, ent, gh, acc


def fused_grad_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, coef_fn: CoefFn, *, tp_group=None,
    sequence_parallel: bool = False, temperature: float = 1.0, return_entropy: bool = False,
    vocab_size: int | None = None, mask: Tensor | None = None, ignore_index: int = IGNORE_INDEX,
    chunk_rows: int | None = None, head_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """(lp [s, b] fp32, ent [s, b] fp32 or None, z): fused_token_logprobs's values, and z, a 0-d
    fp32 zero whose backward gives hidden and weight the gradient of the caller's loss.

    hidden, weight, targets, tp_group, sequence_parallel, temperature, return_entropy, vocab_size,
    mask, ignore_index, chunk_rows, head_dtype: as fused_token_logprobs (keep= is not supported;
    the default chunk, fused_head.default_chunk_rows, holds 1/16 of the fp32 logits shard in the compute
    dtype: 1/16 of the s*b rows in fp32, 1/8 in bf16; it depends on the rows alone, so every rank of
    an uneven vocabulary runs the same chunks).
    coef_fn(r0, r1, lp_rows, ent_rows) -> (g_lp, g_ent): called once per chunk, in increasing,
        disjoint row order covering rows 0..s*b of the flattened (s-major) [s, b] positions (under
        SP, of the gathered sequence), on every TP rank with identical lp_rows [r1-r0] fp32 and
        ent_rows [r1-r0] fp32 (None without entropy). Returns d loss / d lp and d loss / d ent of
        those rows ([r1-r0] float; g_ent None: no entropy gradient). The loss must be a sum of
        per-token terms. Ignored/masked rows' coefficients are treated as 0. It runs under
        no_grad and must not call a head itself (they share vocab_softmax's workspace).
    lp and ent carry no autograd graph. z's backward with incoming gradient g returns g * dL/dhidden
    (summed over TP as ColumnParallelLinear's backward does, hidden's dtype) and g * dL/dweight
    (summed over the chunks in fp32; into weight.main_grad where it exists), computed in forward; only for inputs that
    require grad (with grad mode on). See the module docstring for collectives and memory.
    """
    _, tp, rank = resolve_group(tp_group)
    sp = bool(sequence_parallel)
    check_head_args(hidden, weight, targets, mask, tp, sp, head_dtype)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(targets.numel(), (head_dtype or hidden.dtype).itemsize)  # the logits'
    plan, lt, owned, valid = plan_targets(
        targets.long(), weight.shape[0], hidden.device, tp_group=tp_group, temperature=temperature,
        return_entropy=return_entropy, vocab_size=vocab_size, mask=mask, ignore_index=ignore_index,
        chunk_rows=chunk_rows)
    head = _Head(head_dtype or hidden.dtype, sp, tp, rank)
    grad_on = torch.is_grad_enabled()
    need_h, need_w = grad_on and hidden.requires_grad, grad_on and weight.requires_grad
    if (need_h or need_w) and torch.float16 in (hidden.dtype, weight.dtype):
        # the gradients are formed here, before any loss scale can reach them (it arrives in z's
        # backward): rounded to fp16 unscaled, small ones would underflow
        raise ValueError(f"fused_grad_logprobs: expected bf16 or fp32 hidden states and weight where they need a "
                         f"gradient, found {hidden.dtype} and {weight.dtype} (fp16 gradients formed before the "
                         "loss scale would underflow); score fp16 ones with fused_token_logprobs")
    with torch.no_grad():
        full = hidden
        if sp and plan.group is not None:  # [s/tp, b, h] -> [s, b, h]; freed after the loop
            full = _gather_sequence(hidden.contiguous(), plan.group, tp)
        x = full.reshape(-1, full.shape[-1])  # [N, h]; a copy only for a non-contiguous view
        lp, ent, gh, gw = _run(x, weight, coef_fn, lt, owned, valid, plan, head, need_h, need_w)
        del full, x
        if gh is not None:
            gh = _sum_hidden_grad(gh, plan.group, head).view(hidden.shape).to(hidden.dtype)
    shape = targets.shape
    z = (_StoredGrad.apply(hidden, weight, gh, gw) if need_h or need_w
         else hidden.new_zeros((), dtype=torch.float32))
    return lp.view(shape), None if ent is None else ent.view(shape), z
