"""The output head's three GEMMs on one rank (TP=2 of V=151936, h=256, fp32, one thread, CPU), as
megatron-core runs them (one GEMM each over all N rows) and as loss.head=fused_grad runs them (per
chunk of rows: logits = h_c W^T, dL/dh_c = g_c W, dL/dW += g_c^T h_c), interleaved in shuffled
order, median of reps. It isolates what bench_head's fused_grad row pays for chunking on CPU.

    python benchmarks/bench_head_gemms.py --tokens 2048 --chunks 128 512 --reps 7
Results: docs/benchmarks.md (bench_head, fused_grad).
"""
import argparse
import os
import random
import statistics
import time

import torch


def _gemms(x: torch.Tensor, w: torch.Tensor, rows: int) -> dict:
    """name -> callable running that GEMM over all of x's rows, `rows` at a time."""
    n, v = x.shape[0], w.shape[0]
    logits, gh, gw = torch.empty(rows, v), torch.empty(n, x.shape[1]), torch.zeros_like(w)
    spans = [(r0, min(n, r0 + rows)) for r0 in range(0, n, rows)]

    def fwd():
        for r0, r1 in spans:
            torch.mm(x[r0:r1], w.t(), out=logits[:r1 - r0])

    def grad_hidden():  # logits stands in for d loss / d logits (same shape, same cost)
        for r0, r1 in spans:
            torch.mm(logits[:r1 - r0], w, out=gh[r0:r1])

    def grad_weight():
        gw.zero_()
        for r0, r1 in spans:
            gw.addmm_(logits[:r1 - r0].t(), x[r0:r1])
    logits.normal_()
    return {"logits h W^T": fwd, "dL/dh = g W": grad_hidden, "dL/dW += g^T h": grad_weight}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab-local", type=int, default=151936 // 2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--chunks", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=g)
    w = torch.randn(args.vocab_local, args.hidden, generator=g) * args.hidden ** -0.5
    layouts = {"all rows (megatron-core)": args.tokens, **{f"{c}-row chunks": c for c in args.chunks}}
    runs = {(lay, name): fn for lay, rows in layouts.items() for name, fn in _gemms(x, w, rows).items()}
    times = {k: [] for k in runs}
    for fn in runs.values():  # warm-up
        fn()
    for _ in range(args.reps):
        keys = list(runs)
        random.shuffle(keys)
        for k in keys:
            t0 = time.perf_counter()
            runs[k]()
            times[k].append(time.perf_counter() - t0)
    names = list(_gemms(x[:1], w[:1], 1))
    print(f"N={args.tokens}, h={args.hidden}, v_local={args.vocab_local}, fp32, 1 thread, {args.reps} reps, "
          f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}\n")
    print("| GEMMs run as | " + " | ".join(names) + " | sum | sum / all rows |")
    print("|---" * (len(names) + 3) + "|")
    base = sum(statistics.median(times[(next(iter(layouts)), n)]) for n in names)
    for lay in layouts:
        med = [statistics.median(times[(lay, n)]) for n in names]
        print(f"| {lay} | " + " | ".join(f"{m:.2f} s" for m in med) + f" | {sum(med):.2f} s | {sum(med) / base:.2f}x |")


if __name__ == "__main__":
    main()
