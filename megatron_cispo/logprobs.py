"""Vocab-parallel token log-probabilities (and entropy) that never gather the vocabulary.

    lp = token_logprobs(logits, targets)                                   # [s, b] fp32
    lp, ent = token_logprobs(logits, targets, temperature=0.7, return_entropy=True)

This is the pure-PyTorch reference path; it runs on CPU and GPU alike. Forward streams the
logits once through a small reusable fp32 workspace and does 2 small TP all-reduces; backward
recomputes the softmax chunk by chunk, does no collective, and writes the gradient once.
fused_head.py reuses the per-chunk pieces (_chunk_stats, _reduce_stats, _grad_rows, _chunk_grad).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

IGNORE_INDEX = -100
# Rows per chunk are sized so the fp32 workspace stays this big: on CPU it fits the shared L3
# (so the 5-8 elementwise passes per chunk hit cache, not DRAM); on GPU it amortises launches.
_CHUNK_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20}
# exp2 of a shifted logit below about -150 is exactly 0 in fp32, so flooring the shift here
# changes no probability, but keeps p * z finite (0 * -inf would be NaN) for -inf logits.
_SHIFT_FLOOR = -1.0e4
# A rank whose valid logits of a row are all -inf (or that holds only vocab padding) reports
# this finite max instead, so that its rescale factor exp(m_local - m) is 0, not NaN.
_EMPTY_MAX = -1.0e30
# Softmax runs in base 2: on CPU torch's exp2 is about 2x faster than exp, and the base change
# folds into the one multiply that applies the temperature. LOG2E = 1 / ln 2.
_LN2 = 0.6931471805599453
_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_workspaces: dict[torch.device, Tensor] = {}


def _workspace(numel: int, device: torch.device) -> Tensor:
    """A reusable 1-D fp32 buffer of at least `numel` elements (grown, never shrunk)."""
    buf = _workspaces.get(device)
    if buf is None or buf.numel() < numel:
        _workspaces.pop(device, None)  # free the old one before allocating the larger
        buf = _workspaces[device] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf[:numel]


def release_workspace() -> None:
    """Free the cached fp32 workspaces (they are re-allocated on the next call)."""
    _workspaces.clear()


@dataclass(frozen=True)
class _Plan:
    temperature: float
    n_valid: int  # leading columns of this shard that are real vocabulary (the rest is padding)
    chunk_rows: int
    entropy: bool
    group: object  # a process group with > 1 rank, or None for no collectives
    inplace: bool | str


def _row_chunks(n_rows: int, chunk_rows: int):
    for r0 in range(0, n_rows, chunk_rows):
        yield r0, min(n_rows, r0 + chunk_rows)


def _log2_units(w: Tensor, src: Tensor, m: Tensor, temperature: float) -> Tensor:
    """w <- (src - m) * log2(e) / T in fp32; the temperature divides here, inside the op.

    w: [r, nv] fp32 workspace view; src: [r, nv] logits chunk; m: [r] fp32 row max.
    """
    if src.dtype == torch.float32:
        torch.sub(src, m[:, None], out=w)  # upcast-free: one pass fewer
    else:
        w.copy_(src).sub_(m[:, None])  # the only upcast, one chunk at a time
    return w.mul_(_LOG2E / temperature)


def _chunk_stats(w: Tensor, p: Tensor | None, src: Tensor, mr: Tensor, sr: Tensor,
                 er: Tensor | None, temperature: float) -> None:
    """One chunk of rows: mr <- max logit, sr <- sum 2^u, er <- sum 2^u * u (if er is given),
    with u = (x - mr) log2(e) / T.

    src: [r, nv] logits chunk, any float dtype; w: [r, nv] fp32 workspace (may be src itself when
    src is an fp32 scratch tensor); p: a second [r, nv] fp32 workspace, needed with er only.
    mr, sr, er: [r] fp32 outputs. src is not modified unless it is w.
    """
    if src.dtype == torch.float32:
        torch.amax(src, dim=1, out=mr)
    else:  # amax is 3x faster on fp32 than on bf16, so upcast first
        mr.copy_(torch.amax(w.copy_(src), dim=1))
        src = w
    mr.clamp_(min=_EMPTY_MAX)
    _log2_units(w, src, mr, temperature)
    if er is not None:
        torch.exp2(w.clamp_(min=_SHIFT_FLOOR), out=p)
        torch.sum(p, dim=1, out=sr)
        torch.sum(w.mul_(p), dim=1, out=er)
    else:
        torch.sum(w.exp2_(), dim=1, out=sr)


def _empty_stats(n_rows: int, entropy: bool, device: torch.device):
    """m, S, E of rows no column has contributed to yet: [n_rows] fp32 each (E None without entropy)."""
    m = torch.full((n_rows,), _EMPTY_MAX, dtype=torch.float32, device=device)
    s = torch.zeros(n_rows, dtype=torch.float32, device=device)
    e = torch.zeros(n_rows, dtype=torch.float32, device=device) if entropy else None
    return m, s, e


def _local_stats(x2: Tensor, plan: _Plan):
    """Per row of this shard: max logit m, S = sum 2^u and E = sum 2^u * u, u = (x - m) log2(e) / T.

    x2: [N, v_local] any float dtype. Returns m (raw logit units), S, E (None without entropy),
    all [N] fp32. One read of the shard; the fp32 workspace holds at most 2 chunks.
    """
    n_rows, nv = x2.shape[0], plan.n_valid
    m, s, e = _empty_stats(n_rows, plan.entropy, x2.device)
    if nv == 0:
        return m, s, e
    ws = _workspace((2 if plan.entropy else 1) * plan.chunk_rows * nv, x2.device)
    for r0, r1 in _row_chunks(n_rows, plan.chunk_rows):
        n = (r1 - r0) * nv
        w = ws[:n].view(r1 - r0, nv)
        p = ws[n:2 * n].view_as(w) if plan.entropy else None
        _chunk_stats(w, p, x2[r0:r1, :nv], m[r0:r1], s[r0:r1], None if e is None else e[r0:r1],
                     plan.temperature)
    return m, s, e


def _reduce_stats(m: Tensor, s: Tensor, e: Tensor | None, tx: Tensor, owned: Tensor, valid: Tensor,
                  plan: _Plan):
    """This shard's row stats -> logprobs and entropy over the whole vocabulary.

    m, s, e: [N] fp32 from _chunk_stats (m is made the global max, in place); tx: [N] fp32 target
    logit, read on its owner only. Returns lp, ent (None without entropy), and the global S and
    e_mean = sum_j p_j u_j that backward needs. Collectives: exactly one MAX and one packed SUM
    all-reduce over plan.group, whatever the chunking; none for one process.
    """
    if plan.group is not None:
        m_loc = m.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=plan.group)
        shift = (m_loc - m) * (_LOG2E / plan.temperature)
        scale = shift.exp2()
        if e is not None:  # re-centre sum 2^u u on the global max
            e = scale * (e + shift * s)
        s = scale * s
    td = torch.where(owned, (tx - m) / plan.temperature, 0.0)  # z_target - max z
    parts = [s, td] + ([e] if e is not None else [])
    if plan.group is not None:
        packed = torch.stack(parts)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=plan.group)
        parts = list(packed.unbind(0))
    s, td = parts[0], parts[1]
    log_s = s.log()  # lse(z) = max z + log_s
    lp = torch.where(valid, td - log_s, 0.0)
    e_mean = parts[2] / s if plan.entropy else None  # sum_j p_j u_j
    ent = log_s - _LN2 * e_mean if plan.entropy else None
    return lp, ent, s, e_mean


class _GradRows(NamedTuple):
    """Per-row coefficients of d loss / d logits, [N] fp32 each (a, e_mean: None without an
    entropy gradient). The gradient of row i is p_ij (a_i (u_ij - e_mean_i) + b_i), plus tg_i at
    its target column lt_i; m is the global row max the log2 units u are measured from."""
    m: Tensor
    b: Tensor
    a: Tensor | None
    e_mean: Tensor | None
    tg: Tensor
    lt: Tensor

    def take(self, idx) -> "_GradRows":
        return _GradRows(*(None if v is None else v[idx] for v in self))


def _grad_rows(g_lp: Tensor | None, g_ent: Tensor | None, stats, temperature: float):
    """(_GradRows, active): the coefficients, and which rows have any upstream gradient.

    stats: (m, s, e_mean, lt, owned, valid) as forward saved them.
    """
    m, s, e_mean, lt, owned, valid = stats
    g = torch.zeros_like(s) if g_lp is None else torch.where(valid, g_lp.reshape(-1).float(), 0.0)
    gh = None if g_ent is None else g_ent.reshape(-1).float()
    active = g != 0 if gh is None else (g != 0) | (gh != 0)
    # p_j = 2^u_j / S. d lp / d z_j = [j == target] - p_j, and d H / d z_j = -p_j (z_j - sum p z)
    # with z_j - sum p z = ln2 (u_j - e_mean); d/dx = (1/T) d/dz.
    b = -g / (temperature * s)
    a = None if gh is None else -gh * _LN2 / (temperature * s)
    tg = torch.where(owned, g / temperature, 0.0)
    return _GradRows(m, b, a, None if a is None else e_mean, tg, lt), active


def _chunk_grad(w: Tensor, p: Tensor | None, src: Tensor, rows: _GradRows, temperature: float) -> Tensor:
    """w <- d loss / d logits of one chunk of rows, fp32; returns w.

    src: [r, nv] logits chunk, any float dtype (may be w itself when fp32); w, p: [r, nv] fp32
    workspaces (p needed with an entropy gradient only); rows: _GradRows of these r rows.
    """
    _log2_units(w, src, rows.m, temperature)
    if rows.a is None:
        w.exp2_().mul_(rows.b[:, None])
    else:
        torch.exp2(w.clamp_(min=_SHIFT_FLOOR), out=p)
        w.sub_(rows.e_mean[:, None]).mul_(rows.a[:, None]).add_(rows.b[:, None]).mul_(p)
    return w.scatter_add_(1, rows.lt[:, None], rows.tg[:, None])


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, lt: Tensor, owned: Tensor, valid: Tensor, plan: _Plan):
        x2 = logits.reshape(-1, logits.shape[-1])
        m, s, e = _local_stats(x2, plan)
        tx = x2.gather(1, lt[:, None]).squeeze(1).float()  # target logit; valid on its owner only
        lp, ent, s, e_mean = _reduce_stats(m, s, e, tx, owned, valid, plan)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits)
        ctx.plan, ctx.stats = plan, (m, s, e_mean, lt, owned, valid)
        shape = logits.shape[:-1]
        return (lp.view(shape), ent.view(shape)) if plan.entropy else lp.view(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp: Tensor | None, g_ent: Tensor | None = None):
        logits, = ctx.saved_tensors
        plan = ctx.plan
        inplace = plan.inplace is True or (plan.inplace == "auto" and _sole_owner(logits))
        x2 = logits.reshape(-1, logits.shape[-1])
        n_rows, nv, t = x2.shape[0], plan.n_valid, plan.temperature
        coef, active = _grad_rows(g_lp, g_ent, ctx.stats, t)
        out = x2 if inplace else torch.empty_like(x2, memory_format=torch.contiguous_format)
        if nv == 0:  # this shard is all vocab padding
            return out.zero_().view_as(logits), None, None, None, None
        if nv < x2.shape[1]:
            out[:, nv:].zero_()  # vocab padding takes no part in the softmax
        rows = active.nonzero().squeeze(1)  # host sync: row skipping needs the count
        if rows.numel() < n_rows:
            out.index_fill_(0, (~active).nonzero().squeeze(1), 0.0)
        dense = rows.numel() == n_rows
        # fp32 rows of the gradient are their own workspace: no copy-out pass
        direct = dense and out.dtype == torch.float32 and nv == x2.shape[1]
        n_ws = (0 if direct else 1) + (0 if coef.a is None else 1)
        ws = _workspace(n_ws * plan.chunk_rows * nv, x2.device)
        for c0, c1 in _row_chunks(rows.numel(), plan.chunk_rows):
            idx = slice(c0, c1) if dense else rows[c0:c1]
            n = (c1 - c0) * nv
            w = out[idx] if direct else ws[:n].view(c1 - c0, nv)
            p = None if coef.a is None else ws[n_ws * n - n:n_ws * n].view_as(w)  # the last slot
            _chunk_grad(w, p, x2[idx, :nv], coef.take(idx), t)
            if direct:
                continue
            if dense:
                out[idx, :nv].copy_(w)
            else:
                out[:, :nv].index_copy_(0, idx, w.to(out.dtype))
        return out.view_as(logits), None, None, None, None


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


def _resolve_group(tp_group):
    """The explicit group, else megatron's TP group if its parallel state is up, else None."""
    if tp_group is None:
        # No import here: if megatron.core.parallel_state was never imported it is not initialised.
        mpu = sys.modules.get("megatron.core.parallel_state")
        if mpu is None or not mpu.model_parallel_is_initialized():
            return None, 1, 0
        tp_group = mpu.get_tensor_model_parallel_group()
    size = dist.get_world_size(tp_group)
    return (tp_group if size > 1 else None), size, dist.get_rank(tp_group)


def _plan_targets(targets: Tensor, v_local: int, device: torch.device, *, tp_group, temperature,
                  return_entropy, vocab_size, mask, ignore_index, chunk_rows, inplace=False):
    """Validate the arguments every vocab-parallel head shares and resolve the TP group.

    targets: [*lead] int, shape already checked by the caller; v_local: this rank's columns.
    Returns (plan, lt, owned, valid): lt [N] the target's column in this shard (0 where not
    owned), owned [N] bool (valid and in this shard), valid [N] bool (not ignored). One host sync
    checks the valid targets' range.
    """
    if mask is not None and (mask.shape != targets.shape or mask.dtype != torch.bool):
        raise ValueError(f"mask: expected bool of shape {tuple(targets.shape)}, found {mask.dtype} "
                         f"of shape {tuple(mask.shape)}")
    if not (isinstance(temperature, (int, float)) and 0.0 < temperature < float("inf")):
        raise ValueError(f"temperature: expected a finite float > 0, found {temperature!r}")
    group, tp, rank = _resolve_group(tp_group)
    vocab = v_local * tp if vocab_size is None else vocab_size
    if not (isinstance(vocab, int) and 0 < vocab <= v_local * tp):
        raise ValueError(f"vocab_size: expected an int in (0, {v_local * tp}] for "
                         f"{tp} shards of {v_local} columns, found {vocab_size!r}; pass the true "
                         "(unpadded) vocabulary size")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows: expected a positive int or None, found {chunk_rows!r}")
    start = rank * v_local
    n_valid = max(0, min(v_local, vocab - start))
    if chunk_rows is None:
        chunk_bytes = _CHUNK_BYTES.get(device.type, _CHUNK_BYTES["cuda"])
        chunk_rows = max(1, chunk_bytes // (4 * max(1, n_valid)))
    t = targets.reshape(-1)
    valid = t != ignore_index
    if mask is not None:
        valid &= mask.reshape(-1)
    bad = valid & ((t < 0) | (t >= vocab))
    if bool(bad.any()):  # the one host sync of the forward
        i = int(bad.nonzero()[0, 0])
        pos = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), targets.shape))
        raise ValueError(f"targets: expected ids in [0, {vocab}) (vocab_size) or ignore_index "
                         f"{ignore_index}, found {int(t[i])} at position {pos}; check the tokenizer's "
                         "vocabulary against the model's, or mask the position")
    lt = t - start
    owned = valid & (lt >= 0) & (lt < n_valid)
    lt = torch.where(owned, lt, 0)
    plan = _Plan(float(temperature), n_valid, chunk_rows, bool(return_entropy), group, inplace)
    return plan, lt, owned, valid


def token_logprobs(
    vocab_parallel_logits: Tensor, targets: Tensor, *, tp_group=None, temperature: float = 1.0,
    return_entropy: bool = False, vocab_size: int | None = None, mask: Tensor | None = None,
    ignore_index: int = IGNORE_INDEX, inplace_backward: bool | Literal["auto"] = "auto",
    chunk_rows: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """log softmax(logits / T)[target] over a vocabulary sharded across the TP group.

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
    chunk_rows: rows per workspace chunk (default: sized by _CHUNK_BYTES).
    Returns logprobs [*lead] fp32, or (logprobs, entropy).
    Collectives: forward does one MAX and one packed SUM all-reduce of [*lead]-sized fp32 stats
    over tp_group (none for one process); backward does none. One host sync validates targets
    and one in backward counts the rows to skip.
    """
    x = vocab_parallel_logits
    if x.dtype not in _DTYPES or x.dim() < 1:
        raise ValueError(f"vocab_parallel_logits: expected [*lead, v_local] fp32/bf16/fp16, found "
                         f"{x.dtype} of shape {tuple(x.shape)}")
    if targets.shape != x.shape[:-1] or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets: expected integer ids of shape {tuple(x.shape[:-1])} (logits' "
                         f"leading shape), found {targets.dtype} of shape {tuple(targets.shape)}")
    if inplace_backward not in (True, False, "auto"):
        raise ValueError(f"inplace_backward: expected True, False or 'auto', found {inplace_backward!r}")
    plan, lt, owned, valid = _plan_targets(
        targets, x.shape[-1], x.device, tp_group=tp_group, temperature=temperature,
        return_entropy=return_entropy, vocab_size=vocab_size, mask=mask, ignore_index=ignore_index,
        chunk_rows=chunk_rows, inplace=inplace_backward)
    if inplace_backward == "auto" and x.requires_grad and torch.is_grad_enabled():
        _calibrate()  # once per process, here rather than re-entrantly inside backward
    return _TokenLogprobs.apply(x, lt, owned, valid, plan)
