"""Sampling-mask replay (keep=): token_logprobs and fused_token_logprobs with and without kept
sets, against the dense ways of scoring over them, forward + backward, side by side.

    python benchmarks/bench_replay.py            # s=2048 and 8192, V=151936, fp32, bf16 (about 12 minutes)
    python benchmarks/bench_replay.py --quick    # s=256, V=32000, a smoke run (about 10 s)
    python benchmarks/bench_replay.py --tokens 2048 --no-fused   # the token_logprobs table only

Paths, each to lp [b, s] fp32, then lp.sum().backward(), at temperature 1:
  none   token_logprobs(logits, targets, inplace_backward=True), no replay (what the head passes);
  ours   the same with keep=KeptSet(ids, offsets), the constructor's checks included;
  dense  what a user would write: keep_dense[row, ids] = True, then
         logits.float().masked_fill(~keep_dense, -inf).log_softmax(-1).gather(-1, targets);
  slime  slime's replay at TP=1: its dense [T, V_local] bool mask built row by row from Python
         lists, then its masked-fill vocab-parallel log-prob function (transcribed below).
Logits: bf16 values [s, b, v] as the output layer returns them; fp32 is their fp32 copy, as
Float16Module returns it. Every path gets GPTModel's [b, s, v] view (a transpose, b=1) as a fresh
non-leaf the caller drops before backward. Kept sets: each position's top_k=64 ids, or a
top-p-like size drawn log-uniformly from 1..512 (largest logits first); the target is one of them.
Each (tokens, dtype) runs in one fresh process (megatron_cispo.testing.spawn, one thread), the
paths rotated rep by rep after a warm-up rep. Time and peak extra memory are measured as in
bench_logprobs.py: median wall time; peak resident set above the resident set before the call,
minus the logits gradient when it is a new buffer. The fused head (hidden [s, 1, h] fp32 and the
[V, h] weight, both requiring grad, to (-lp * adv).sum()) runs the same way, minus the weight
gradient. Before timing, every path's logprobs and logits gradient are checked against dense on
the first rows. Single process (TP=1) on CPU. Not a test: no timing is asserted anywhere.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

# Run from a checkout without `pip install -e .`: the package is the script's parent's sibling.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_logprobs import _release_freed_memory, _reset_peak, _status_kib  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KEPT = {"top_k=64": 64, "top-p-like 1..512": 0}  # 0: log-uniform sizes in [1, MAX_KEPT]
MAX_KEPT = 512
CHECK_ROWS = 64  # rows each path is checked on against dense before timing
CHECK_TOL = {"fp32": 1e-5, "bf16": 1e-2}  # max |difference| / max |dense|, logprobs and gradient


class _Logits(torch.autograd.Function):
    """A fresh, non-leaf logits buffer of `dtype` from the bf16 values src ([s, b, v]), as the
    output layer (and Float16Module's fp32 cast) produces it; backward records where the
    gradient landed and drops it."""
    grad_info: tuple = ()

    @staticmethod
    def forward(ctx, anchor, src, dtype):
        out = src.to(dtype, copy=True)
        ctx.ptr = out.untyped_storage().data_ptr()
        return out

    @staticmethod
    def backward(ctx, g):
        _Logits.grad_info = (g.nbytes, g.untyped_storage().data_ptr() == ctx.ptr)
        return None, None, None


def _kept_sets(score_rows, n: int, vocab: int, shape) -> dict:
    """{kind: (ids [K] int32 ascending per position, offsets [n+1] int64, targets int64 `shape`)}
    for each kind of KEPT: the `size` largest scores of each row (size 0: log-uniform in
    1..MAX_KEPT per row), and one of them as the target. score_rows(r0, r1): fp32 [r1 - r0, vocab]."""
    out = {}
    for seed, (kind, size) in enumerate(KEPT.items()):
        gen = torch.Generator().manual_seed(seed)
        sizes = (torch.full((n,), size) if size else
                 torch.exp(torch.rand(n, generator=gen) * torch.log(torch.tensor(MAX_KEPT + 1.0))))
        sizes = sizes.long().clamp(1, MAX_KEPT)
        width = int(sizes.max())
        top = torch.cat([score_rows(r0, min(n, r0 + 256)).topk(width, dim=1).indices
                         for r0 in range(0, n, 256)])
        top[torch.arange(width) >= sizes[:, None]] = vocab  # beyond the row's size: sorted last, dropped
        top = top.sort(dim=1).values
        targets = top[torch.arange(n), (torch.rand(n, generator=gen) * sizes).long()]
        offsets = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(sizes, 0, out=offsets[1:])
        out[kind] = (top[top < vocab].to(torch.int32), offsets, targets.view(shape))
    return out


class _SlimeMaskedLogProb(torch.autograd.Function):
    """Transcribed from THUDM/slime 624b824, slime/utils/ppo_utils.py,
    _VocabParallelLogProbEntropy, keep-mask branch without entropy, at TP=1 (its all-reduces are
    identities): mask, restore the target's logit, softmax in that one buffer, which backward
    turns into the gradient in place."""

    @staticmethod
    def forward(ctx, logits, target, keep):
        x = logits.float()
        rows = torch.arange(x.shape[0])
        z = x.masked_fill(~keep, float("-inf"))
        z[rows, target] = x[rows, target]
        z.sub_(z.max(dim=-1, keepdim=True).values)
        pred = z[rows, target]
        sum_exp = z.exp_().sum(dim=-1, keepdim=True)
        ctx.save_for_backward(z.div_(sum_exp), target)
        return pred - sum_exp.log().squeeze(-1)

    @staticmethod
    def backward(ctx, g):
        softmax, target = ctx.saved_tensors
        grad = softmax.neg_()
        grad[torch.arange(grad.shape[0]), target] += 1.0
        return grad.mul_(g.reshape(-1, 1)), None, None


def _slime_keep_mask(ids: list, offsets: list, tokens: int, vocab: int):
    """slime/backends/megatron_utils/loss.py _build_topp_keep_mask + _fill_topp_mask_rows (same
    commit) at TP=1 for one response covering every row: a Python loop over rows."""
    keep = torch.ones((tokens, vocab), dtype=torch.bool)
    for r in range(tokens):
        local = [t for t in ids[offsets[r]:offsets[r + 1]] if 0 <= t < vocab]
        keep[r].fill_(False)
        if local:
            keep[r, torch.tensor(local, dtype=torch.long)] = True
    return keep


def _path(name, x, targets, keep):
    """lp [b, s] fp32 of one path. x: logits [b, s, v]; targets [b, s]; keep (ids, offsets)."""
    from megatron_cispo.kept_set import KeptSet
    from megatron_cispo.logprobs import token_logprobs

    if name == "none":
        return token_logprobs(x, targets, inplace_backward=True)
    ids, offsets = keep
    if name == "ours":
        return token_logprobs(x, targets, inplace_backward=True, keep=KeptSet(ids, offsets))
    n, v = targets.numel(), x.shape[-1]
    if name == "dense":
        row = torch.repeat_interleave(torch.arange(n), offsets.diff())
        mask = torch.zeros(n, v, dtype=torch.bool)
        mask[row, ids.long()] = True
        z = x.float().masked_fill(~mask.view(x.shape), float("-inf"))
        return z.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    mask = _slime_keep_mask(ids.tolist(), offsets.tolist(), n, v)  # slime takes Python lists
    return _SlimeMaskedLogProb.apply(x.reshape(n, v), targets.reshape(-1), mask).view(targets.shape)


def _check(names, src, dtype, kept, rows):
    """{(path, kept sets): max rel diff vs dense over (logprobs, logits gradient)} on the first
    `rows` rows of src ([s, 1, v] bf16), as `dtype`."""
    from megatron_cispo.kept_set import KeptSet

    out = {}
    for kind, (ids, offsets, targets) in kept.items():
        sub = KeptSet(ids, offsets).take(torch.arange(rows))
        res = {}
        for name in names:
            leaf = src[:rows].to(dtype).requires_grad_()
            x = leaf.clone().transpose(0, 1)
            lp = _path(name, x, targets[:, :rows], (sub.ids, sub.offsets))
            (lp * torch.linspace(-1, 1, rows)).sum().backward()
            res[name] = (lp.detach(), leaf.grad.float())
        for name, r in res.items():
            if name != "dense":
                out[(name, kind)] = max(float((a - b).abs().max() / b.abs().max())
                                        for a, b in zip(r, res["dense"]))
    return out


def _checked(diffs: dict, dtype: str) -> dict:
    """diffs, after raising if a path differs from dense by more than CHECK_TOL: nothing is timed."""
    for (name, kind), d in diffs.items():
        if d > CHECK_TOL[dtype]:
            raise ValueError(f"{name} ({kind}, {dtype}) differs from dense by {d:.1e} > {CHECK_TOL[dtype]}")
    return diffs


def _measure(cases, run, reps):
    """{case: (times [reps], extra bytes [reps])}: run(case) -> (seconds, bytes), cases rotated rep
    by rep; rep 0 warms up and is not kept."""
    got = {c: ([], []) for c in cases}
    for rep in range(reps + 1):
        k = rep % len(cases)
        for c in cases[k:] + cases[:k]:
            dt, extra = run(c)
            if rep:
                got[c][0].append(dt)
                got[c][1].append(extra)
    return got


def _logprobs_worker(dtype_name, tokens, vocab, reps, dense):
    from megatron_cispo.vocab_softmax import release_workspace

    _release_freed_memory()
    dtype = DTYPES[dtype_name]
    src = (torch.randn(tokens, 1, vocab, generator=torch.Generator().manual_seed(1234)) * 2).bfloat16()
    kept = _kept_sets(lambda a, b: src[a:b, 0].float(), tokens, vocab, (1, tokens))
    names = ["ours", "dense"] + (["slime"] if dense else [])
    diffs = _checked(_check(names, src, dtype, kept, min(CHECK_ROWS, tokens)), dtype_name)
    anchor = torch.zeros((), requires_grad=True)
    first = next(iter(KEPT))
    cases = [("none", first)] + [(n, k) for k in kept for n in (names if dense else ["ours"])]

    def run(case):
        name, kind = case
        ids, offsets, targets = kept[kind]
        x = _Logits.apply(anchor, src, dtype).transpose(0, 1)  # GPTModel's [b, s, v] view
        release_workspace()  # so that our workspace counts as extra memory
        rss0 = _status_kib("VmRSS") * 1024
        _reset_peak()
        t0 = time.perf_counter()
        lp = _path(name, x, targets, (ids, offsets))
        del x  # as in a loss function: autograd holds the only reference
        lp.sum().backward()
        dt = time.perf_counter() - t0
        peak = _status_kib("VmHWM") * 1024
        grad_bytes, in_logits = _Logits.grad_info
        # RSS counters are approximate to ~100s of KiB; clamp that noise at zero
        return dt, max(0, peak - rss0 - (0 if in_logits else grad_bytes))

    return {"runs": _measure(cases, run, reps), "diffs": diffs,
            "kept": {k: int(v[1][-1]) for k, v in kept.items()}}


def _fused_worker(tokens, vocab, h, reps):
    import torch.nn.functional as F

    from megatron_cispo.fused_head import fused_token_logprobs
    from megatron_cispo.kept_set import KeptSet
    from megatron_cispo.vocab_softmax import release_workspace

    _release_freed_memory()
    gen = torch.Generator().manual_seed(1234)
    hidden = torch.randn(tokens, 1, h, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, h, generator=gen) * (2 / h ** 0.5)).requires_grad_()  # logits std ~2
    adv = torch.randn(tokens, 1, generator=gen)
    with torch.no_grad():
        kept = _kept_sets(lambda a, b: hidden[a:b, 0] @ weight.t(), tokens, vocab, (tokens, 1))

    diffs, rows = {}, min(CHECK_ROWS, tokens)  # fused keep vs dense on the same rows
    for kind, (ids, offsets, targets) in kept.items():
        sub = KeptSet(ids, offsets).take(torch.arange(rows))
        res = []
        for fused in (True, False):
            hs, w = hidden[:rows].detach().requires_grad_(), weight.detach().requires_grad_()
            if fused:
                lp = fused_token_logprobs(hs, w, targets[:rows], keep=sub)
            else:
                lp = _path("dense", F.linear(hs, w).transpose(0, 1), targets[:rows].t(),
                           (sub.ids, sub.offsets)).t()
            (-lp * adv[:rows]).sum().backward()
            res.append((lp.detach(), hs.grad, w.grad))
        diffs[("fused", kind)] = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*res))
    _checked(diffs, "fp32")

    def run(case):
        name, kind = case
        ids, offsets, targets = kept[kind]
        hidden.grad = weight.grad = None
        release_workspace()  # so that the fused head's workspace counts as extra memory
        rss0 = _status_kib("VmRSS") * 1024
        _reset_peak()
        t0 = time.perf_counter()
        keep = KeptSet(ids, offsets) if name == "ours" else None
        lp = fused_token_logprobs(hidden, weight, targets, keep=keep)
        (-lp * adv).sum().backward()
        dt = time.perf_counter() - t0
        peak = _status_kib("VmHWM") * 1024
        return dt, max(0, peak - rss0 - weight.grad.nbytes)

    cases = [("none", next(iter(KEPT)))] + [("ours", k) for k in kept]
    return {"runs": _measure(cases, run, reps), "diffs": diffs,
            "kept": {k: int(v[1][-1]) for k, v in kept.items()}}


def _ratio(runs, case, ref) -> str:
    """Median of the per-rep time ratios case / ref ("-" if ref did not run)."""
    if ref not in runs or ref == case:
        return "-"
    return f"{statistics.median(a / b for a, b in zip(runs[case][0], runs[ref][0])):.2f}x"


def table(results, fused: bool) -> str:
    """One row per (tokens, dtype, path, kept sets): median time, time ratios, peak extra."""
    lines = ["| TP | tokens | dtype | kept sets (K ids) | path | median s (min - max) | time / none "
             + ("" if fused else "| time / dense ") + "| peak extra MiB (max over reps) |",
             "|---" * (8 if fused else 9) + "|"]
    for (tokens, dtype), r in results.items():
        runs, none = r["runs"], ("none", next(iter(KEPT)))
        for (name, kind), (t, extra) in runs.items():
            label = "-" if name == "none" else f"{kind} ({r['kept'][kind]})"
            lines.append(f"| 1 | {tokens} | {dtype} | {label} | {'fused ' if fused else ''}{name} "
                         f"| {statistics.median(t):.3f} ({min(t):.3f} - {max(t):.3f}) "
                         f"| {_ratio(runs, (name, kind), none)} "
                         + ("" if fused else f"| {_ratio(runs, (name, kind), ('dense', kind))} ")
                         + f"| {max(extra) / 2**20:.1f} |")
    return "\n".join(lines)


def summary(results) -> str:
    """Ours with keep against no keep, dense and slime: time ratios and peak extra side by side."""
    lines = ["| TP | tokens | dtype | kept sets | time: ours / none | time: ours / dense "
             "| time: ours / slime | peak extra MiB: none, ours, dense, slime |", "|---" * 8 + "|"]
    for (tokens, dtype), r in results.items():
        runs, none = r["runs"], ("none", next(iter(KEPT)))
        for kind in KEPT:
            ours = ("ours", kind)
            mib = ", ".join(f"{max(runs[c][1]) / 2**20:.0f}" if c in runs else "-"
                            for c in (none, ours, ("dense", kind), ("slime", kind)))
            lines.append(f"| 1 | {tokens} | {dtype} | {kind} | {_ratio(runs, ours, none)} "
                         f"| {_ratio(runs, ours, ('dense', kind))} | {_ratio(runs, ours, ('slime', kind))} "
                         f"| {mib} |")
    return "\n".join(lines)


def _report(r, tokens, dtype):
    for (name, kind), d in r["diffs"].items():
        print(f"check s={tokens} {dtype} {name} {kind}: max rel diff vs dense (logprobs, grads) {d:.1e}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="s=256, V=32000, 1 rep, fused h=64")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--dense-max", type=int, default=2048, help="largest tokens for dense and slime")
    ap.add_argument("--hidden", type=int, default=256, help="fused head hidden size")
    ap.add_argument("--fused-tokens", type=int, default=2048)
    ap.add_argument("--fused-reps", type=int, default=3)
    ap.add_argument("--no-fused", action="store_true", help="skip the fused head")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.vocab, args.reps, args.dense_max = [256], 32000, 1, 256
        args.hidden, args.fused_tokens, args.fused_reps = 64, 256, 1

    from megatron_cispo.testing import spawn

    results, fused = {}, {}
    for tokens in args.tokens:
        for dtype in args.dtype:
            t0 = time.perf_counter()
            r = results[(tokens, dtype)] = spawn(_logprobs_worker, 1, timeout_s=3600, args=(
                dtype, tokens, args.vocab, args.reps, tokens <= args.dense_max))[0]
            _report(r, tokens, dtype)
            print(f"token_logprobs s={tokens} {dtype}: {time.perf_counter() - t0:.0f} s", flush=True)
    if not args.no_fused:
        r = fused[(args.fused_tokens, "fp32")] = spawn(_fused_worker, 1, timeout_s=3600, args=(
            args.fused_tokens, args.vocab, args.hidden, args.fused_reps))[0]
        _report(r, args.fused_tokens, "fp32")
    print(f"\nb=1, V={args.vocab}, TP=1: one process of one thread per (tokens, dtype); median of "
          f"{args.reps} reps; torch {torch.__version__}, {platform.machine()}, nproc={os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.1f}\n\n{table(results, False)}\n\n{summary(results)}")
    if fused:
        print(f"\nfused head: s={args.fused_tokens}, b=1, h={args.hidden}, fp32, median of "
              f"{args.fused_reps} reps; peak extra excludes the [V, h] weight gradient\n\n"
              f"{table(fused, True)}")


if __name__ == "__main__":
    main()
