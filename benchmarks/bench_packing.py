"""policy_step throughput on long-tailed rollouts: packed THD bins vs rows padded to the longest.

    python benchmarks/bench_packing.py                  # GPT 4x256, vocab 8192, 32 rows, TP=1 (~2.5 min)
    python benchmarks/bench_packing.py --quick          # a small model, a smoke run (~10 s)
    python benchmarks/bench_packing.py --budget 1024    # another max_tokens_per_microbatch
    python benchmarks/bench_packing.py --tp 2           # 2 gloo ranks of 1 thread each

One batch of n rollouts whose lengths follow a log-normal (the shape RL sampling produces: most
responses short, a few near the length cap), prompt + response with the loss mask on the
response. The same model, optimizer (Adam), loss (cispo, anchor rollout) and batch are trained
by policy_step in three layouts, each one optimizer step timed as wall time of the whole call:
  padded   StepConfig(micro_batch_size=k): k rows per microbatch, each padded to the longest
           row of the batch (s), which is what a [b, s] batch costs;
  packed   StepConfig(micro_batch_size=n, max_tokens_per_microbatch=B): the whole batch as one
           window, first-fit decreasing into [1, T] THD bins of at most B real tokens;
  packed xF  the same with a budget F times larger, to show what the dense reference attention
           costs as bins grow (its work per bin is T^2).
Also timed: the core attention alone (runner/attention.py ReferenceCoreAttention, fwd+bwd) on
exactly the shapes each layout feeds it, x layers: its share of each step. Before timing, one
step in every layout from the same parameters must give the same policy/loss (to 1e-5) and
grad norm (1e-4), so the layouts do equal work. Throughput counts real target tokens only (sum of lengths - 1).
Cases run in turn within every repetition (after warm-up); ratios are the median of
per-repetition ratios and the ratio of the fastest runs. One torch thread per rank by default
(see bench_policy_step.py for why). Not a test: nothing but the equal-work check is asserted.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from functools import partial

import torch

# Run from a checkout without `pip install -e .`: the package is the script's parent's sibling.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGET = 2.0  # issue: packed >= 2x padded tokens/s
TOL = 1e-5  # equal-work check: |policy/loss padded - packed| / max(1, |loss|); grad norm: 10x
# rows: n per rank; prompt: uniform [lo, hi] tokens; response: log-normal with this median and
# sigma, capped so prompt + response <= cap; budget: B real tokens a bin; big: the larger budget's factor.
FULL = dict(vocab=8192, hidden=256, layers=4, heads=8, rows=32, micro=4, prompt=(8, 32), median=32,
            sigma=1.25, cap=512, budget=512, big=2, warmup=1, reps=5)
QUICK = dict(vocab=1024, hidden=64, layers=2, heads=4, rows=16, micro=4, prompt=(4, 8), median=8,
             sigma=1.5, cap=128, budget=128, big=2, warmup=1, reps=2)


def long_tailed_batch(cfg: dict):
    """tokens [n, s+1], lengths [n], loss_mask [n, s] (response targets), advantages [n].

    Response lengths are the log-normal's quantiles at (i + 0.5) / n, in a shuffled order: the
    distribution's shape without a lucky or unlucky draw, so the tail is there at any n."""
    g = torch.Generator().manual_seed(0)
    n = cfg["rows"]
    q = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    z = math.sqrt(2) * torch.erfinv(2 * q - 1)
    prompt = torch.randint(cfg["prompt"][0], cfg["prompt"][1] + 1, (n,), generator=g)
    response = (cfg["median"] * torch.exp(cfg["sigma"] * z)).round().long()[torch.randperm(n, generator=g)]
    lengths = torch.minimum(prompt + response.clamp(min=1), torch.tensor(cfg["cap"]))
    s = int(lengths.max()) - 1
    tokens = torch.randint(0, cfg["vocab"], (n, s + 1), generator=g)
    pos = torch.arange(s)[None]
    # target t scores token t+1: the response's targets are t in [prompt - 1, length - 1)
    loss_mask = (pos >= prompt[:, None] - 1) & (pos < lengths[:, None] - 1)
    return tokens, lengths, loss_mask, torch.randn(n, generator=g)


def _attention_alone(chunks, mbs: list, layers: int):
    """fwd+bwd of the model's core attention on the query/key/value shapes that `mbs` (the
    step's microbatches) feed it, x layers: a closure to time."""
    from megatron.core import parallel_state as mpu

    model = chunks[0]
    while hasattr(model, "module"):  # DDP -> GPTModel
        model = model.module
    core = model.decoder.layers[0].self_attention.core_attention
    heads = core.config.num_attention_heads // mpu.get_tensor_model_parallel_world_size()
    dim = core.config.kv_channels
    g = torch.Generator().manual_seed(2)
    inputs = []
    for mb in mbs:
        b, t = mb.input_ids.shape
        psp = mb.packed_seq_params
        shape = (t, heads, dim) if psp is not None else (t, b, heads, dim)  # THD squeezes b=1
        inputs.append(([torch.randn(shape, generator=g) for _ in range(3)], psp))

    def run():
        for _ in range(layers):
            for qkv, psp in inputs:
                q, k, v = (x.clone().requires_grad_() for x in qkv)
                core(q, k, v, None, packed_seq_params=psp).sum().backward()
    return run


def worker(cfg: dict, tp: int, threads: int) -> dict:
    from megatron.core import parallel_state as mpu

    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.step import Rollouts, StepConfig, compute_logprobs, policy_step
    from megatron_cispo.step.packing import microbatches, step_layout

    torch.set_num_threads(threads)
    distributed.init_distributed(tp=tp)
    tokens, lengths, loss_mask, adv = long_tailed_batch(cfg)
    n, s = tokens.shape[0], tokens.shape[1] - 1
    mcfg = ModelConfig(vocab_size=cfg["vocab"], seq_length=s, hidden_size=cfg["hidden"],
                       num_layers=cfg["layers"], num_attention_heads=cfg["heads"])
    chunks = build_model(mcfg, tp=tp, pp=1, seed=0)
    opt = build_optimizer(chunks, lr=1e-5, optimizer="adam", clip_grad=1.0)
    loss_cfg = from_dict(LossConfig, {"cispo": {"anchor": "rollout"}})
    steps = {"padded": StepConfig(micro_batch_size=cfg["micro"]),
             "packed": StepConfig(micro_batch_size=n, max_tokens_per_microbatch=cfg["budget"]),
             "packed_big": StepConfig(micro_batch_size=n, max_tokens_per_microbatch=cfg["big"] * cfg["budget"])}
    # A sampler slightly off the trainer: rollout logprobs = current + noise on the response.
    probe = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=adv, lengths=lengths)
    noise = 0.1 * torch.randn(n, s, generator=torch.Generator().manual_seed(1)) * loss_mask
    rollout = compute_logprobs(chunks, probe, steps["packed"]) + noise
    batch = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=adv, rollout_logprobs=rollout, lengths=lengths)

    # Equal work: one step of each layout from the same parameters (the metrics are of the
    # forward/backward before the update, so the optimizer state does not enter them).
    params = [p for c in chunks for p in c.parameters()]
    start = [p.detach().clone() for p in params]
    first = {}
    for name, step_cfg in steps.items():
        first[name] = policy_step(chunks, opt, batch, loss_cfg, step_cfg)
        with torch.no_grad():
            for p, p0 in zip(params, start):
                p.copy_(p0)
    layout = step_layout(chunks, steps["packed"])
    mbs = {k: microbatches(batch, loss_cfg, v, layout, mpu.get_data_parallel_group()) for k, v in steps.items()}
    cases = {k: partial(policy_step, chunks, opt, batch, loss_cfg, v) for k, v in steps.items()}
    cases.update({f"attn_{k}": _attention_alone(chunks, v, cfg["layers"]) for k, v in mbs.items()})
    times: dict[str, list[float]] = {k: [] for k in cases}
    for rep in range(cfg["warmup"] + cfg["reps"]):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()  # a step ends in host syncs (grad norm, metrics)
            if rep >= cfg["warmup"]:
                times[name].append(time.perf_counter() - t0)
    shapes = {k: [tuple(mb.input_ids.shape) for mb in v] for k, v in mbs.items()}
    return {"times": times, "first": first, "shapes": shapes, "lengths": lengths.tolist(),
            "response": loss_mask.sum(1).tolist()}


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:.0f} ms" if x < 10 else f"{x:.1f} s"


def check_equal_work(first: dict) -> dict[str, float]:
    """Per layout, the largest relative difference of any metric from the padded step's; raises
    when policy/loss (or the gradient norm) differs, so that unequal work is never timed."""
    ref = first["padded"]
    out = {}
    for name, m in first.items():
        diff = {k: abs(m[k] - ref[k]) / max(1.0, abs(ref[k]))
                for k in ref if not k.startswith("step/") or k == "step/grad_norm"}
        if not (diff["policy/loss"] <= TOL and diff["step/grad_norm"] <= 10 * TOL):
            raise RuntimeError(f"{name} and padded do not compute the same update: policy/loss "
                               f"{m['policy/loss']!r} vs {ref['policy/loss']!r}, step/grad_norm "
                               f"{m['step/grad_norm']!r} vs {ref['step/grad_norm']!r}; not timing unequal work")
        out[name] = max(diff.values())
    return out


def run(cfg: dict, tp: int, threads: int) -> str:
    from megatron_cispo.testing import spawn

    results = spawn(worker, tp, (cfg, tp, threads), timeout_s=3600)
    r0 = results[0]
    diffs = check_equal_work(r0["first"])
    # A step is as slow as its slowest rank: per repetition, the max over ranks.
    per_rep = {k: [max(r["times"][k][i] for r in results) for i in range(cfg["reps"])] for k in r0["times"]}
    med = {k: statistics.median(v) for k, v in per_rep.items()}
    lengths = sorted(r0["lengths"])
    n, s = len(lengths), lengths[-1] - 1
    real = sum(L - 1 for L in lengths)  # target tokens: what the step trains the model on
    med_len = statistics.median(lengths)
    budget = {"packed": cfg["budget"], "packed_big": cfg["big"] * cfg["budget"]}
    bins = {k: len(v) for k, v in r0["shapes"].items()}
    tok_s = {k: f"{real / med[k]:,.0f} ({real / min(per_rep[k]):,.0f})" for k in ("padded", *budget)}
    ratio = {k: (statistics.median(a / b for a, b in zip(per_rep["padded"], per_rep[k])),
                 min(per_rep["padded"]) / min(per_rep[k])) for k in budget}
    share = {k: statistics.median(a / b for a, b in zip(per_rep[f"attn_{k}"], per_rep[k])) for k in ("padded", *budget)}
    # Without the core attention, what is left scales with the tokens each layout computes.
    rest = (med["padded"] - med["attn_padded"]) / (med["packed"] - med["attn_packed"])
    met = ratio["packed"][0] >= TARGET
    model = (f"GPTModel {cfg['layers']} layers x hidden {cfg['hidden']}, {cfg['heads']} heads, vocab "
             f"{cfg['vocab']}, fp32, megatron-core local spec with the dense ReferenceCoreAttention; Adam; cispo, "
             f"anchor rollout; TP={tp} ({tp} rank(s) x torch.set_num_threads({threads}))")
    data = (f"{n} rows; prompt uniform {cfg['prompt'][0]}-{cfg['prompt'][1]} tokens, response log-normal "
            f"(median {cfg['median']}, sigma {cfg['sigma']}, at the quantiles (i + 0.5)/n), prompt + response "
            f"capped at {cfg['cap']}; loss mask on the response ({sum(r0['response'])} trained targets). Row "
            f"length: median {med_len:g}, mean {sum(lengths) / n:.0f}, max {lengths[-1]} "
            f"({lengths[-1] / med_len:.1f}x the median); {real} real target tokens. Padded to s = {s}: "
            f"**padding {1 - real / (n * s):.0%}** of the [n, s] layout ({n * s / real:.2f}x the real tokens)")
    machine = (f"{platform.machine()}, nproc={os.cpu_count()}, torch {torch.__version__}, Python "
               f"{platform.python_version()}, 1-min load average at the end {os.getloadavg()[0]:.1f}; "
               f"median (min - max) of {cfg['reps']} interleaved repetitions after {cfg['warmup']} warm-up")
    argv = " ".join(sys.argv[1:])

    def span(k):
        return f"{_fmt_s(med[k])} ({_fmt_s(min(per_rep[k]))} - {_fmt_s(max(per_rep[k]))})"

    def packed_row(k, label):
        widest = max(t for _, t in r0["shapes"][k])
        return (f"| {label} | {bins[k]} bins of [1, <= {widest}], {real / (bins[k] * budget[k]):.0%} full | "
                f"{span(k)} | {tok_s[k]} | {span('attn_' + k)}, {share[k]:.0%} | {diffs[k]:.1e} |")
    rows = [
        "| layout (one optimizer step) | microbatches | step: median (min - max) | tokens/s: median "
        "(fastest) | core attention alone: median (min - max), share of step | metrics vs padded: max rel. diff |",
        "|---|---|---|---|---|---|",
        f"| padded: `StepConfig(micro_batch_size={cfg['micro']})` | {bins['padded']} of [{cfg['micro']}, {s}] | "
        f"{span('padded')} | {tok_s['padded']} | {span('attn_padded')}, {share['padded']:.0%} | - |",
        packed_row("packed", f"packed: `StepConfig(micro_batch_size={n}, max_tokens_per_microbatch="
                             f"{budget['packed']})`"),
        packed_row("packed_big", f"packed, {cfg['big']}x the budget: `max_tokens_per_microbatch="
                                 f"{budget['packed_big']}`"),
        "",
        "| ratio | median of per-repetition ratios | ratio of fastest runs | target |",
        "|---|---|---|---|",
        f"| packed / padded tokens/s, budget {budget['packed']} | {ratio['packed'][0]:.2f}x | "
        f"{ratio['packed'][1]:.2f}x | >= {TARGET:g}x: {'met' if met else 'MISSED'} |",
        f"| packed / padded tokens/s, budget {budget['packed_big']} | {ratio['packed_big'][0]:.2f}x | "
        f"{ratio['packed_big'][1]:.2f}x | - |",
        f"| padded / packed (budget {budget['packed']}) time without the core attention (step - attention "
        f"alone) | {rest:.2f}x (of medians) | - | - |",
    ]
    return "\n".join([
        f"Command: `python benchmarks/bench_packing.py{' ' + argv if argv else ''}`", "",
        f"Setup: {model}.", "", f"Batch: {data}.", "", f"Machine: {machine}.", "", *rows])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, few repetitions (smoke run)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (gloo processes)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (override)")
    ap.add_argument("--budget", type=int, default=None, help="max_tokens_per_microbatch (override)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default 1)")
    args = ap.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    for key in ("reps", "budget"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    print(run(cfg, args.tp, args.threads or 1), flush=True)


if __name__ == "__main__":
    main()
