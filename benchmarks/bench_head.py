"""The whole output head, forward + backward, at TP=2: megatron-core vs linear + token_logprobs vs
fused_token_logprobs (which never materialises the [tokens, v_local] logits) vs fused_grad_logprobs
(which also computes the loss's gradients in forward: no logits, no recompute).

    python benchmarks/bench_head.py             # s=2048, b=1, h=256, V=151936, fp32 (about 8 minutes)
    python benchmarks/bench_head.py --tokens 8192 --dtype bf16 --scaling   # bf16, no memory table
    python benchmarks/bench_head.py --quick     # s=256, V=32000, a smoke run (about 20 s)
    python benchmarks/bench_head.py --chunk-rows 64 128 256 --no-auto --scaling   # the fused chunk

Every path takes hidden [s, b, h] (as the decoder hands it to the output layer) and the output
weight shard [v_local, h], both requiring grad, to the loss (-lp * adv).sum() with a random
per-token advantage, then runs backward (fused_grad: the same loss as a coef_fn returning -adv
of its rows; backward runs from its z). Each measurement is one fresh pair of gloo processes
(megatron_cispo.testing.spawn, one thread per rank) that warms its path up on a few rows and then
times one full call; the paths are interleaved (rotated) rep by rep. Time: wall time of forward +
backward, max over ranks. Peak extra memory: peak resident set during the call (VmHWM, reset via
/proc/self/clear_refs) minus the resident set just before it, minus the one [v_local, h] weight
gradient every path must allocate (fused_grad allocates it in forward and hands it over as
weight.grad). Every path also allocates the [N, h] hidden gradient, inside the extra (fused_grad
from forward on). Before timing, one process pair checks that all paths give the
same logprobs and gradients. Not a test: no timing is asserted anywhere.
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time

import torch

# Run from a checkout without `pip install -e .`: the package is the script's parent's sibling.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_logprobs import _release_freed_memory, _reset_peak, _status_kib  # noqa: E402

TP = 2
# time / megatron-core, peak extra / fp32 logits shard, of the fused paths
TARGETS = {"fused": (1.5, 0.1), "fused_grad": (1.0, 0.1)}
# max |difference| / max |reference|, per output, for every path against megatron-core; bf16: the
# logits of a chunked matmul may round differently (an ulp), and the grads are bf16
CHECK_TOL = {"fp32": 1e-5, "bf16": 2 ** -6}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WARM_TOKENS = 128  # rows each fresh process runs once, untimed, before its measured call


def _inputs(tokens: int, vocab: int, h: int, rank: int, dtype: str):
    """hidden [s, 1, h] and targets/adv [s, 1], the same on every TP rank; weight [v/tp, h] this
    rank's shard. Logits come out with a std of about 2, as in bench_logprobs.py."""
    gen = torch.Generator().manual_seed(1234)
    hidden = torch.randn(tokens, 1, h, generator=gen).to(DTYPES[dtype]).requires_grad_()
    targets = torch.randint(0, vocab, (tokens, 1), generator=gen)
    adv = torch.randn(tokens, 1, generator=gen)
    wgen = torch.Generator().manual_seed(99 + rank)
    weight = (torch.randn(vocab // TP, h, generator=wgen) * (2 / h ** 0.5)).to(DTYPES[dtype]).requires_grad_()
    return hidden, weight, targets, adv


def _head(path: str, hidden, weight, targets, chunk_rows):
    """Logprobs [s, b] fp32 of one path, differentiable in hidden and weight. Paths: "mcore",
    F.linear + megatron-core vocab_parallel_cross_entropy; "ours", F.linear + token_logprobs with
    inplace_backward=True (what our loss function passes); "ours_auto", the same with "auto";
    "fused", fused_token_logprobs. (fused_grad: see _forward.)"""
    import torch.nn.functional as F
    from megatron.core import tensor_parallel

    from megatron_cispo.fused_head import fused_token_logprobs
    from megatron_cispo.logprobs import token_logprobs

    if path == "fused":
        return fused_token_logprobs(hidden, weight, targets, chunk_rows=chunk_rows)
    # ColumnParallelLinear without SP: identity forward, all-reduce of the hidden gradient in
    # backward (the fused op does the same all-reduce itself)
    logits = F.linear(tensor_parallel.copy_to_tensor_model_parallel_region(hidden), weight)
    logits = logits.transpose(0, 1)  # GPTModel: [s, b, v] -> [b, s, v], a view at b=1
    if path == "mcore":
        return -tensor_parallel.vocab_parallel_cross_entropy(logits, targets.t()).t()
    inplace = {"ours": True, "ours_auto": "auto"}[path]
    return token_logprobs(logits, targets.t(), inplace_backward=inplace).t()


def _forward(path: str, hidden, weight, targets, adv, chunk_rows):
    """(lp, the scalar to run backward from) of one path with the loss (-lp * adv).sum()."""
    if path != "fused_grad":
        lp = _head(path, hidden, weight, targets, chunk_rows)
        return lp, (-lp * adv).sum()
    from megatron_cispo.fused_grad import fused_grad_logprobs

    neg_adv = -adv.reshape(-1)
    lp, _, z = fused_grad_logprobs(hidden, weight, targets, lambda r0, r1, lp, ent: (neg_adv[r0:r1], None),
                                   chunk_rows=chunk_rows)
    return lp, z


def _check_worker(tokens, vocab, h, paths, dtype):
    """Every path's logprobs, hidden grad and weight grad against megatron-core's, as
    max |difference| / max |megatron-core value|."""
    from megatron_cispo.runner import distributed

    env = distributed.init_distributed(tp=TP)
    hidden, weight, targets, adv = _inputs(tokens, vocab, h, env.rank, dtype)
    outs = {}
    for name, chunk_rows in paths:
        hidden.grad = weight.grad = None
        lp, loss = _forward(name, hidden, weight, targets, adv, chunk_rows)
        loss.backward()
        outs[(name, chunk_rows)] = (lp.detach(), hidden.grad, weight.grad)
    ref = outs[("mcore", None)]
    return {k: [float((a.float() - r.float()).abs().max() / r.float().abs().max()) for a, r in zip(v, ref)]
            for k, v in outs.items()}


def _measure_worker(name, chunk_rows, tokens, vocab, h, dtype):
    """One timed fwd+bwd of one path in this fresh process, after a warm-up on WARM_TOKENS rows."""
    from megatron_cispo.vocab_softmax import release_workspace
    from megatron_cispo.runner import distributed

    _release_freed_memory()
    env = distributed.init_distributed(tp=TP)
    hidden, weight, targets, adv = _inputs(tokens, vocab, h, env.rank, dtype)
    warm = hidden.detach()[:WARM_TOKENS].requires_grad_()
    _forward(name, warm, weight, targets[:WARM_TOKENS], adv[:WARM_TOKENS], chunk_rows)[1].backward()
    del warm
    weight.grad = None
    release_workspace()  # so that the fused head's workspace counts as extra memory
    gc.collect()
    torch.distributed.barrier()
    rss0 = _status_kib("VmRSS") * 1024
    _reset_peak()
    t0 = time.perf_counter()
    _forward(name, hidden, weight, targets, adv, chunk_rows)[1].backward()
    dt = time.perf_counter() - t0
    peak = _status_kib("VmHWM") * 1024
    # RSS counters are approximate to ~100s of KiB; clamp that noise at zero
    return {"time": dt, "extra": max(0, peak - rss0 - weight.grad.nbytes)}


def measure(name, chunk_rows, tokens, vocab, h, dtype) -> dict:
    from megatron_cispo.testing import spawn

    per_rank = spawn(_measure_worker, TP, args=(name, chunk_rows, tokens, vocab, h, dtype), timeout_s=900)
    return {k: max(r[k] for r in per_rank) for k in ("time", "extra")}


def _label(case) -> str:
    name, chunk_rows = case
    return name if name not in TARGETS else f"{name} (chunk_rows={chunk_rows or 'default'})"


def timing(cases, tokens, vocab, h, reps, dtype) -> dict:
    """{case: [{"time", "extra"}] * reps}, the cases rotated rep by rep."""
    runs = {c: [] for c in cases}
    for rep in range(reps):
        for c in cases[rep % len(cases):] + cases[:rep % len(cases)]:
            runs[c].append(measure(*c, tokens, vocab, h, dtype))
            print(f"rep {rep} {_label(c)}: {runs[c][-1]['time']:.3f} s, "
                  f"{runs[c][-1]['extra'] / 2**20:.1f} MiB extra", flush=True)
    return runs


def timing_table(runs, shard: int) -> str:
    ref = runs[("mcore", None)]
    lines = ["| path | median s (min - max) | time / mcore: median of per-rep ratios | ratio of fastest "
             "runs | peak extra / fp32 logits shard (max over reps) | peak extra MiB |",
             "|---|---|---|---|---|---|"]
    for c, rs in runs.items():
        t = [r["time"] for r in rs]
        ratios = [a / b["time"] for a, b in zip(t, ref)]
        extra = max(r["extra"] for r in rs)
        lines.append(f"| {_label(c)} | {statistics.median(t):.2f} ({min(t):.2f} - {max(t):.2f}) "
                     f"| {statistics.median(ratios):.2f}x | {min(t) / min(r['time'] for r in ref):.2f}x "
                     f"| {extra / shard:.3f}x | {extra / 2**20:.0f} |")
    return "\n".join(lines)


def target_table(runs, shard: int, fused_cases) -> str:
    """The fused head against its targets: time over megatron-core's, peak extra over a shard."""
    ref = [r["time"] for r in runs[("mcore", None)]]
    lines = ["| ratio | median of per-rep ratios | ratio of fastest runs | target | |",
             "|---|---|---|---|---|"]
    for c in fused_cases:
        t = [r["time"] for r in runs[c]]
        med, fast = statistics.median(a / b for a, b in zip(t, ref)), min(t) / min(ref)
        target = TARGETS[c[0]][0]
        ok = "met" if max(med, fast) <= target else "NOT met"
        lines.append(f"| time: {_label(c)} / mcore | {med:.2f}x | {fast:.2f}x | <= {target}x | {ok} |")
    for c in fused_cases:
        mem, target = max(r["extra"] for r in runs[c]) / shard, TARGETS[c[0]][1]
        ok = "met" if mem <= target else "NOT met"
        lines.append(f"| peak extra: {_label(c)} / fp32 logits shard | {mem:.3f}x (max over reps) | - "
                     f"| <= {target}x | {ok} |")
    return "\n".join(lines)


def scaling(cases, token_counts, unfused_max, vocab, h, first: dict, dtype) -> str:
    """Peak extra MiB per path against tokens; the unfused paths stop at unfused_max tokens."""
    shard = lambda n: n * (vocab // TP) * 4  # noqa: E731
    lines = ["| tokens | fp32 logits shard MiB | " + " | ".join(f"{_label(c)} MiB (x shard)" for c in cases)
             + " |", "|---" * (2 + len(cases)) + "|"]
    for n in token_counts:
        cells = []
        for c in cases:
            if c[0] not in TARGETS and n > unfused_max:
                cells.append("-")
                continue
            r = first[c] if n == token_counts[0] else measure(*c, n, vocab, h, dtype)
            cells.append(f"{r['extra'] / 2**20:.0f} ({r['extra'] / shard(n):.3f}x)")
            print(f"scaling {n} {_label(c)}: {cells[-1]}", flush=True)
        lines.append(f"| {n} | {shard(n) / 2**20:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="s=256, V=32000, 1 rep, scaling to 1024 tokens")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="hidden and weight (the head's matmuls)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunk-rows", type=int, nargs="+", default=[0],
                    help="fused chunk_rows to run (0: the op's default)")
    ap.add_argument("--no-auto", action="store_true", help="skip the inplace_backward='auto' path")
    ap.add_argument("--no-fused", action="store_true", help="skip the fused_token_logprobs path")
    ap.add_argument("--scaling", type=int, nargs="*", default=[2048, 4096, 8192, 16384, 32768],
                    help="token counts of the memory table (the first must be --tokens; none: skip)")
    ap.add_argument("--unfused-max", type=int, default=8192, help="largest token count for unfused paths")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.vocab, args.reps, args.scaling, args.unfused_max = 256, 32000, 1, [256, 1024], 512
    if args.scaling and args.scaling[0] != args.tokens:
        ap.error(f"--scaling: the first token count must be --tokens ({args.tokens}), "
                 f"found {args.scaling[0]}")
    fused = [(name, c or None) for name in ("fused", "fused_grad")[args.no_fused:] for c in args.chunk_rows]
    cases = [("mcore", None), ("ours", None)] + ([] if args.no_auto else [("ours_auto", None)]) + fused
    shard = args.tokens * (args.vocab // TP) * 4

    from megatron_cispo.testing import spawn

    diffs = spawn(_check_worker, TP, args=(args.tokens, args.vocab, args.hidden, cases, args.dtype), timeout_s=900)
    worst = {c: [max(r[c][i] for r in diffs) for i in range(3)] for c in cases}
    for c, (lp, gh, gw) in worst.items():
        print(f"check {_label(c)}: max rel diff vs mcore: logprobs {lp:.1e}, hidden grad {gh:.1e}, "
              f"weight grad {gw:.1e}", flush=True)
        if max(lp, gh, gw) > CHECK_TOL[args.dtype]:
            raise SystemExit(f"{_label(c)} differs from megatron-core by more than {CHECK_TOL[args.dtype]}; "
                             "not timing")

    runs = timing(cases, args.tokens, args.vocab, args.hidden, args.reps, args.dtype)
    table = timing_table(runs, shard)
    first = {c: max(runs[c], key=lambda r: r["extra"]) for c in cases}
    mem_cases = [("mcore", None), ("ours", None)] + [c for c in fused if c[1] == fused[0][1]]
    mem = (scaling(mem_cases, args.scaling, args.unfused_max, args.vocab, args.hidden, first, args.dtype)
           if args.scaling else "")
    gh_mib = args.tokens * args.hidden * DTYPES[args.dtype].itemsize / 2**20
    print(f"\nTP={TP}, {args.dtype}, s={args.tokens}, b=1, h={args.hidden}, V={args.vocab} (v_local "
          f"{args.vocab // TP}); fp32 logits shard {shard / 2**20:.0f} MiB; {args.reps} reps; torch "
          f"{torch.__version__}, {platform.machine()}, nproc={os.cpu_count()}, load average "
          f"{os.getloadavg()[0]:.1f}; the hidden gradient [N, h] every path makes (fused_grad from forward on) "
          f"{gh_mib:.1f} MiB\n\n{table}\n")
    print(f"\n{target_table(runs, shard, fused)}")
    if mem:
        print(f"\n{mem}")
    print("\nchecks (max rel diff vs mcore: logprobs, hidden grad, weight grad): " + "; ".join(
        f"{_label(c)} {max(v):.1e}" for c, v in worst.items()))


if __name__ == "__main__":
    main()
