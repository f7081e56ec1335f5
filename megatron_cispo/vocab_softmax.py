"""The chunked, vocab-parallel softmax both heads share: per-chunk statistics, their two TP
collectives, and the per-chunk gradient, in a reusable fp32 workspace.

token_logprobs (logprobs.py) runs it over logits; fused_token_logprobs (fused_head.py) over
logits it recomputes chunk by chunk from the hidden states. Rows are [N] flattened positions,
columns this rank's vocabulary shard; softmax runs in base 2 (see LOG2E).
"""
from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

IGNORE_INDEX = -100
# Rows per chunk are sized so the fp32 workspace stays this big: on CPU it fits the shared L3
# (so the 5-8 elementwise passes per chunk hit cache, not DRAM); on GPU it amortises launches.
CHUNK_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20}
# exp2 of a shifted logit below about -150 is exactly 0 in fp32, so flooring the shift here
# changes no probability, but keeps p * z finite (0 * -inf would be NaN) for -inf logits.
SHIFT_FLOOR = -1.0e4
# A rank whose valid logits of a row are all -inf (or that holds only vocab padding) reports
# this finite max instead, so that its rescale factor exp(m_local - m) is 0, not NaN.
EMPTY_MAX = -1.0e30
# Softmax runs in base 2: on CPU torch's exp2 is about 2x faster than exp, and the base change
# folds into the one multiply that applies the temperature. LOG2E = 1 / ln 2.
LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_workspaces: dict[torch.device, Tensor] = {}


def check_devices(tensors: dict, hint: str = "put every tensor on one device", *, values: bool = True) -> None:
    """Every non-None tensor of `tensors` ({name: tensor}) is on the first one's device, and with
    `values` (the caller reads them) that device holds values: a meta tensor (shapes only) would
    fail inside the first value check with torch's `Tensor.item() cannot be called on meta
    tensors`. ValueError naming the field."""
    ref, device = None, None
    for name, t in tensors.items():
        if t is None:
            continue
        if ref is None:
            ref, device = name, t.device
            if values and device.type == "meta":
                raise ValueError(f"{name} is on the meta device (shapes, no values); build it with its values "
                                 "on the model's device (e.g. module.to_empty(device=...) then load the weights)")
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but {ref} on {device}; {hint}")


def workspace(numel: int, device: torch.device) -> Tensor:
    """A reusable 1-D fp32 buffer of at least `numel` elements (grown, never shrunk)."""
    buf = _workspaces.get(device)
    if buf is None or buf.numel() < numel:
        _workspaces.pop(device, None)  # free the old one before allocating the larger
        buf = _workspaces[device] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf[:numel]


def release_workspace() -> None:
    """Free the cached fp32 workspaces (they are re-allocated on the next call)."""
    _workspaces.clear()


# A fresh CPU buffer this big is mmap'ed by glibc and first touched one 4 KiB page fault at a time:
# for a 297 MiB bf16 logits gradient that was 110-160 ms per rank on an idle 2-core box, about
# half of backward. Asking for transparent huge pages (MADV_HUGEPAGE, honoured when the kernel's
# THP mode is "madvise" or "always") faults it in 2 MiB at a time, in about 20 ms.
HUGE_PAGE = 2 << 20
HUGE_MIN_BYTES = 64 << 20
MADV_HUGEPAGE = 14
_madvise: list = []  # [libc madvise or None], resolved once


def grad_buffer(like: Tensor) -> Tensor:
    """An uninitialised contiguous tensor of `like`'s shape, dtype and device, for a gradient the
    caller writes whole. On Linux CPU, one of at least HUGE_MIN_BYTES asks the kernel for huge
    pages over its 2 MiB-aligned interior (a hint: any failure leaves ordinary pages)."""
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    if out.device.type != "cpu" or out.nbytes < HUGE_MIN_BYTES or not sys.platform.startswith("linux"):
        return out
    if not _madvise:
        try:
            _madvise.append(ctypes.CDLL(None).madvise)
        except (OSError, AttributeError):
            _madvise.append(None)
    if _madvise[0] is not None:
        p = out.data_ptr()
        lo, hi = -(-p // HUGE_PAGE) * HUGE_PAGE, (p + out.nbytes) // HUGE_PAGE * HUGE_PAGE
        _madvise[0](ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE)
    return out


@dataclass(frozen=True)
class Plan:
    temperature: float
    n_valid: int  # leading columns of this shard that are real vocabulary (the rest is padding)
    chunk_rows: int
    entropy: bool
    group: object  # a process group with > 1 rank, or None for no collectives
    inplace: bool | str
    start: int = 0  # the global id of this shard's first column
    vocab: int = 0  # the true vocabulary: ids >= vocab are padding


def row_chunks(n_rows: int, chunk_rows: int):
    for r0 in range(0, n_rows, chunk_rows):
        yield r0, min(n_rows, r0 + chunk_rows)


def log2_units(w: Tensor, src: Tensor, m: Tensor, temperature: float) -> Tensor:
    """w <- (src - m) * log2(e) / T in fp32; the temperature divides here, inside the op.

    w: [r, nv] fp32 workspace view; src: [r, nv] logits chunk; m: [r] fp32 row max.
    """
    if src.dtype == torch.float32:
        torch.sub(src, m[:, None], out=w)  # upcast-free: one pass fewer
    else:
        w.copy_(src).sub_(m[:, None])  # the only upcast, one chunk at a time
    return w.mul_(LOG2E / temperature)


def chunk_stats(w: Tensor, p: Tensor | None, src: Tensor, mr: Tensor, sr: Tensor,
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
    mr.clamp_(min=EMPTY_MAX)
    log2_units(w, src, mr, temperature)
    if er is not None:
        torch.exp2(w.clamp_(min=SHIFT_FLOOR), out=p)
        torch.sum(p, dim=1, out=sr)
        torch.sum(w.mul_(p), dim=1, out=er)
    else:
        torch.sum(w.exp2_(), dim=1, out=sr)


def empty_stats(n_rows: int, entropy: bool, device: torch.device):
    """m, S, E of rows no column has contributed to yet: [n_rows] fp32 each (E None without entropy)."""
    m = torch.full((n_rows,), EMPTY_MAX, dtype=torch.float32, device=device)
    s = torch.zeros(n_rows, dtype=torch.float32, device=device)
    e = torch.zeros(n_rows, dtype=torch.float32, device=device) if entropy else None
    return m, s, e


def reduce_stats(m: Tensor, s: Tensor, e: Tensor | None, tx: Tensor, owned: Tensor, valid: Tensor,
                  plan: Plan, replay=None):
    """This shard's row stats -> logprobs and entropy over the whole vocabulary.

    m, s, e: [N] fp32 from chunk_stats (m is made the global max, in place); tx: [N] fp32 target
    logit, read on its owner only. replay: a kept_set.Replay with its logits, or None: its rows'
    lp is over their kept set (entropy stays the full one's). Returns lp, ent (None without
    entropy), the global S and e_mean = sum_j p_j u_j that backward needs, and the kept entries'
    probabilities pk (None without replay). Collectives: exactly one MAX and one packed SUM
    all-reduce over plan.group (replay rides on both), whatever the chunking; none for one process.
    """
    mk = None if replay is None else replay.local_max()
    if plan.group is not None:
        m_loc = m.clone()
        both = m if mk is None else torch.stack([m, mk])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=plan.group)
        m, mk = (m, None) if mk is None else (m.copy_(both[0]), both[1])
        shift = (m_loc - m) * (LOG2E / plan.temperature)
        scale = shift.exp2()
        if e is not None:  # re-centre sum 2^u u on the global max
            e = scale * (e + shift * s)
        s = scale * s
    td = torch.where(owned, (tx - m) / plan.temperature, 0.0)  # z_target - max z
    parts = [s, td] + ([e] if e is not None else [])
    parts += [] if mk is None else replay.sums(mk, tx, owned, plan.temperature)  # [sk, tdk]
    if plan.group is not None:
        packed = torch.stack(parts)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=plan.group)
        parts = list(packed.unbind(0))
    s, td = parts[0], parts[1]
    log_s = s.log()  # lse(z) = max z + log_s
    lp = torch.where(valid, td - log_s, 0.0)
    e_mean = parts[2] / s if plan.entropy else None  # sum_j p_j u_j
    ent = log_s - LN2 * e_mean if plan.entropy else None
    lp, pk = (lp, None) if mk is None else replay.finish(lp, mk, *parts[-2:], plan.temperature)
    return lp, ent, s, e_mean, pk


class GradRows(NamedTuple):
    """Per-row coefficients of d loss / d logits, [N] fp32 each (a, e_mean: None without an
    entropy gradient). The gradient of row i is p_ij (a_i (u_ij - e_mean_i) + b_i), plus tg_i at
    its target column lt_i; m is the global row max the log2 units u are measured from."""
    m: Tensor
    b: Tensor
    a: Tensor | None
    e_mean: Tensor | None
    tg: Tensor
    lt: Tensor

    def take(self, idx) -> "GradRows":
        return GradRows(*(None if v is None else v[idx] for v in self))


def grad_rows(g_lp: Tensor | None, g_ent: Tensor | None, stats, temperature: float):
    """(GradRows, active): the coefficients, and which rows have any upstream gradient.

    stats: (m, s, e_mean, lt, owned, valid) as forward saved them.
    """
    m, s, e_mean, lt, owned, valid = stats
    g = torch.zeros_like(s) if g_lp is None else torch.where(valid, g_lp.reshape(-1).float(), 0.0)
    gh = None if g_ent is None else g_ent.reshape(-1).float()
    active = g != 0 if gh is None else (g != 0) | (gh != 0)
    # p_j = 2^u_j / S. d lp / d z_j = [j == target] - p_j, and d H / d z_j = -p_j (z_j - sum p z)
    # with z_j - sum p z = ln2 (u_j - e_mean); d/dx = (1/T) d/dz.
    b = -g / (temperature * s)
    a = None if gh is None else -gh * LN2 / (temperature * s)
    tg = torch.where(owned, g / temperature, 0.0)
    return GradRows(m, b, a, None if a is None else e_mean, tg, lt), active


def chunk_grad(w: Tensor, p: Tensor | None, src: Tensor, rows: GradRows, temperature: float) -> Tensor:
    """w <- d loss / d logits of one chunk of rows, fp32; returns w.

    src: [r, nv] logits chunk, any float dtype (may be w itself when fp32); w, p: [r, nv] fp32
    workspaces (p needed with an entropy gradient only); rows: GradRows of these r rows.
    """
    log2_units(w, src, rows.m, temperature)
    if rows.a is None:
        w.exp2_().mul_(rows.b[:, None])
    else:
        torch.exp2(w.clamp_(min=SHIFT_FLOOR), out=p)
        w.sub_(rows.e_mean[:, None]).mul_(rows.a[:, None]).add_(rows.b[:, None]).mul_(p)
    return w.scatter_add_(1, rows.lt[:, None], rows.tg[:, None])


def resolve_group(group, default: str = "get_tensor_model_parallel_group"):
    """(group, size, rank): the explicit group, else megatron's group `default` names (the TP group)
    if its parallel state is up, else none. The group comes back as None when it has one rank."""
    if group is None:
        # No import here: if megatron.core.parallel_state was never imported it is not initialised.
        mpu = sys.modules.get("megatron.core.parallel_state")
        if mpu is None or not mpu.model_parallel_is_initialized():
            return None, 1, 0
        group = getattr(mpu, default)()
    size = dist.get_world_size(group)
    return (group if size > 1 else None), size, dist.get_rank(group)


def plan_targets(targets: Tensor, v_local: int, device: torch.device, *, tp_group, temperature,
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
    group, tp, rank = resolve_group(tp_group)
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
        chunk_bytes = CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"])
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
    plan = Plan(float(temperature), n_valid, chunk_rows, bool(return_entropy), group, inplace, start, vocab)
    return plan, lt, owned, valid
