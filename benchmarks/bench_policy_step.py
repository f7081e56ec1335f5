"""One RL iteration with and without the pi_old pass, and the plugin's cost over a plain CE step.

    python benchmarks/bench_policy_step.py                  # GPT 4x256, vocab 8192, 16 x 128 tokens, TP=1
    python benchmarks/bench_policy_step.py --quick          # a small model, a smoke run (~20 s)
    python benchmarks/bench_policy_step.py --tp 2           # 2 gloo ranks of 1 thread each
    python benchmarks/bench_policy_step.py --vocab 65536    # the same model with a head that weighs more
    torchrun is not needed: the script spawns its own gloo ranks (megatron_cispo.testing.spawn).

Three steps on the same megatron GPTModel, batch and microbatching, each one optimizer step
(Adam) through megatron-core's forward-backward schedule, timed as wall time of the whole call:
  A  policy_step, cispo anchor 'old', StepConfig(old_logprob_pass="always"): an extra
     forward-only pass computes pi_old first, as any trainer without the skip logic does;
  B  policy_step, cispo anchor 'rollout': pi_old is unused and the pass is skipped; B runs with
     each loss.head (logits, fused, fused_grad) on the same model and batch, for tokens/s;
  C  a plain cross-entropy step: forward_step returns megatron-core's
     vocab_parallel_cross_entropy summed over the loss mask with its token count (the
     calculate_per_token_loss contract, as pretrain_gpt does), same schedule and optimizer.
Also timed: the pi_old pass alone (compute_logprobs), and the two loss heads alone (fwd+bwd on
random logits of one microbatch, x microbatches), to show where B - C goes. All run in turn
within every repetition (after warm-up), so machine drift hits them alike. Ratios: the median
of per-repetition ratios, and the ratio of the fastest runs. Threads: torch.set_num_threads(1)
per rank by default (--threads to change): on a shared 2-core machine, 2 OpenMP threads stall
at every barrier whenever one is descheduled, which made repetitions vary 10x. Not a test:
nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from functools import partial

import torch

# Run from a checkout without `pip install -e .`: the package is the script's parent's sibling.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HEADS = ("logits", "fused", "fused_grad")  # loss.head; B is the logits head
TARGETS = {"saving": 0.25, "overhead": 0.05}  # issue 5: skip saves >= 25%; plugin costs <= 5%
FULL = dict(vocab=8192, hidden=256, layers=4, heads=8, seq=128, batch=16, micro=4, warmup=2, reps=12)
QUICK = dict(vocab=1024, hidden=64, layers=2, heads=4, seq=64, batch=8, micro=2, warmup=1, reps=3)


def _batch(vocab: int, n: int, s: int):
    """Prompt of s/4 tokens, then a response of random length; advantages per sequence."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, s + 1), generator=g)
    length = torch.randint(s // 2, s - s // 4 + 1, (n, 1), generator=g)
    pos = torch.arange(s)[None]
    loss_mask = (pos >= s // 4) & (pos < s // 4 + length)
    return tokens, loss_mask, torch.randn(n, generator=g), 0.1 * torch.randn(n, s, generator=g)


def _ce_forward_step(calls: list):
    """The plain LM step's forward_step: megatron-core CE, (loss_sum, num_tokens, report)."""
    from megatron.core import tensor_parallel

    from megatron_cispo.step.forward import forward_step_for

    def loss_func(mb, logits):
        losses = tensor_parallel.vocab_parallel_cross_entropy(logits, mb.targets)
        mask = mb.loss_mask.float()
        loss = torch.sum(losses * mask)
        num_tokens = mask.sum().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}

    return forward_step_for(loss_func, calls)


def _ce_step(chunks, optimizer, batch, micro: int) -> dict[str, float]:
    """One plain CE update, with the host work a training loop does: grad norm, loss all-reduce."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_cispo.step import StepConfig
    from megatron_cispo.step.forward import run_schedule
    from megatron_cispo.step.packing import microbatches, step_layout

    calls: list = []
    for c in chunks:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    step_cfg = StepConfig(micro_batch_size=micro)
    mbs = microbatches(batch, None, step_cfg, step_layout(chunks, step_cfg), mpu.get_data_parallel_group())
    reports = run_schedule(chunks, _ce_forward_step(calls), mbs, forward_only=False)
    _, grad_norm, _ = optimizer.step()
    total = torch.stack([r["lm loss"] for r in reports]).sum(0)
    dist.all_reduce(total, group=mpu.get_data_parallel_group())
    return {"lm/loss": float(total[0] / total[1]), "step/grad_norm": float(grad_norm),
            "step/forward_calls": float(len(calls))}


def worker(cfg: dict, tp: int, threads: int) -> dict:
    from megatron_cispo.runner import distributed
    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.step import Rollouts, StepConfig, compute_logprobs, policy_step

    torch.set_num_threads(threads)
    distributed.init_distributed(tp=tp)
    mcfg = ModelConfig(vocab_size=cfg["vocab"], seq_length=cfg["seq"], hidden_size=cfg["hidden"],
                       num_layers=cfg["layers"], num_attention_heads=cfg["heads"])
    chunks = build_model(mcfg, tp=tp, pp=1, seed=0)
    opt = build_optimizer(chunks, lr=1e-5, optimizer="adam", clip_grad=1.0)
    tokens, loss_mask, adv, noise = _batch(cfg["vocab"], cfg["batch"], cfg["seq"])
    probe = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=adv)
    # A sampler slightly off the trainer: rollout logprobs = current + noise, ratios near 1.
    rollout = compute_logprobs(chunks, probe, StepConfig(micro_batch_size=cfg["micro"])) + noise
    batch = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=adv, rollout_logprobs=rollout)
    step = StepConfig(micro_batch_size=cfg["micro"], old_logprob_pass="always")
    rollout_anchor = {"cispo": {"anchor": "rollout"}}
    cases = {
        "A": partial(policy_step, chunks, opt, batch, from_dict(LossConfig, {"cispo": {"anchor": "old"}}), step),
        "B": partial(policy_step, chunks, opt, batch, from_dict(LossConfig, rollout_anchor), step),
        **{f"B_{head}": partial(policy_step, chunks, opt, batch, from_dict(LossConfig, {**rollout_anchor, "head": head}),
                                step) for head in HEADS[1:]},
        "C": partial(_ce_step, chunks, opt, batch, cfg["micro"]),
        "pass": partial(compute_logprobs, chunks, batch, StepConfig(micro_batch_size=cfg["micro"])),  # A's extra work
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    metrics = {}
    for rep in range(cfg["warmup"] + cfg["reps"]):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            out = fn()  # the steps end in host syncs (grad norm, metrics); the pass in a broadcast
            if rep >= cfg["warmup"]:
                times[name].append(time.perf_counter() - t0)
            if isinstance(out, dict):
                metrics[name] = out
    times.update(_loss_heads(cfg, batch, from_dict(LossConfig, {"cispo": {"anchor": "rollout"}})))
    return {"times": times, "metrics": metrics}


def _loss_heads(cfg: dict, batch, loss_cfg) -> dict[str, list[float]]:
    """The two loss functions alone, fwd+bwd on one microbatch of random logits [b, s, v/tp],
    summed over the microbatches of a step: where the plugin's extra time goes."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    from megatron_cispo.logprobs import token_logprobs
    from megatron_cispo.losses import compute_policy_loss

    mb = batch.select(slice(0, cfg["micro"]))
    targets, mask = mb["tokens"][:, 1:], mb["loss_mask"]
    v_local = cfg["vocab"] // mpu.get_tensor_model_parallel_world_size()
    base = torch.randn(cfg["micro"], cfg["seq"], v_local, generator=torch.Generator().manual_seed(1))

    def ce():
        logits = base.clone().requires_grad_()  # mcore CE writes into its input
        (tensor_parallel.vocab_parallel_cross_entropy(logits, targets) * mask).sum().backward()

    def plugin():
        logits = base.clone().requires_grad_()
        lp, ent = token_logprobs(logits, targets, return_entropy=True)
        res = compute_policy_loss(loss_cfg, lp, advantages=mb["advantages"], loss_mask=mask,
                                  rollout_logprobs=mb["rollout_logprobs"], entropy=ent)
        res.loss_sum.backward()

    n_micro = cfg["batch"] // cfg["micro"]
    out: dict[str, list[float]] = {"head_ce": [], "head_plugin": []}
    for rep in range(cfg["warmup"] + cfg["reps"]):
        for name, fn in (("head_ce", ce), ("head_plugin", plugin)):
            t0 = time.perf_counter()
            fn()
            if rep >= cfg["warmup"]:
                out[name].append(n_micro * (time.perf_counter() - t0))
    return out


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:.0f} ms"


def run(cfg: dict, tp: int, threads: int) -> str:
    from megatron_cispo.testing import spawn

    nproc = os.cpu_count() or 1
    results = spawn(worker, tp, (cfg, tp, threads), timeout_s=3600)
    # A step is as slow as its slowest rank: per repetition, the max over ranks.
    per_rep = {k: [max(r["times"][k][i] for r in results) for i in range(cfg["reps"])] for k in results[0]["times"]}
    med = {k: statistics.median(v) for k, v in per_rep.items()}
    span = {k: f"{_fmt_s(med[k])} ({_fmt_s(min(v))} - {_fmt_s(max(v))})" for k, v in per_rep.items()}
    calls = {k: results[0]["metrics"][k]["step/forward_calls"] for k in ("A", "B", "C")}
    # Ratios: the median of per-repetition ratios (A, B and C of one repetition ran back to back,
    # so a load spike on a shared machine mostly cancels), and the ratio of the fastest runs.
    ratio = {(x, y): (statistics.median(b / a for a, b in zip(per_rep[x], per_rep[y])),
                      min(per_rep[y]) / min(per_rep[x])) for x, y in (("A", "B"), ("C", "B"))}
    saving, overhead = 1 - ratio["A", "B"][0], ratio["C", "B"][0] - 1
    head_extra = (med["head_plugin"] - med["head_ce"]) / med["C"]
    tokens = cfg["batch"] * cfg["seq"]
    model = (f"GPTModel {cfg['layers']} layers x hidden {cfg['hidden']}, {cfg['heads']} heads, vocab "
             f"{cfg['vocab']}, fp32, megatron-core local spec; batch {cfg['batch']} x {cfg['seq']} tokens, micro "
             f"batch {cfg['micro']} ({cfg['batch'] // cfg['micro']} microbatches); Adam; TP={tp} "
             f"({tp} rank(s) x torch.set_num_threads({threads}))")
    machine = (f"{platform.machine()}, nproc={nproc}, torch {torch.__version__}, Python "
               f"{platform.python_version()}, 1-min load average at the end {os.getloadavg()[0]:.1f}; "
               f"median (min - max) of {cfg['reps']} interleaved repetitions after {cfg['warmup']} warm-up")
    argv = " ".join(sys.argv[1:])
    rows = [
        "| step (one optimizer step) | model forwards (`step/forward_calls`) | median (min - max) |",
        "|---|---|---|",
        f"| A: `policy_step`, cispo anchor old, `old_logprob_pass=\"always\"` (pi_old pass + fwd/bwd) | "
        f"{calls['A']:.0f} | {span['A']} |",
        f"| B: `policy_step`, cispo anchor rollout (pi_old pass skipped) | {calls['B']:.0f} | {span['B']} |",
        f"| C: plain CE step, mcore `vocab_parallel_cross_entropy`, same schedule + Adam | {calls['C']:.0f} | "
        f"{span['C']} |",
        f"| the pi_old pass alone (`compute_logprobs`, forward-only schedule) | {cfg['batch'] // cfg['micro']} | "
        f"{span['pass']} |",
        f"| loss head alone, mcore CE fwd+bwd (x {cfg['batch'] // cfg['micro']} microbatches) | - | "
        f"{span['head_ce']} |",
        f"| loss head alone, `token_logprobs`+entropy + `compute_policy_loss` fwd+bwd (same) | - | "
        f"{span['head_plugin']} |",
        "",
        "| ratio | median of per-repetition ratios | ratio of fastest runs | target (issue 5) |",
        "|---|---|---|---|",
        f"| B / A: iteration without / with the pi_old pass | {ratio['A', 'B'][0]:.3f} (saves {saving:.1%}) | "
        f"{ratio['A', 'B'][1]:.3f} (saves {1 - ratio['A', 'B'][1]:.1%}) | saves >= {TARGETS['saving']:.0%}: "
        f"{'met' if saving >= TARGETS['saving'] else 'missed'} |",
        f"| B / C: `policy_step` / plain CE step | {ratio['C', 'B'][0]:.3f} (overhead {overhead:+.1%}) | "
        f"{ratio['C', 'B'][1]:.3f} ({ratio['C', 'B'][1] - 1:+.1%}) | <= {TARGETS['overhead']:.0%}: "
        f"{'met' if overhead <= TARGETS['overhead'] else 'missed'} |",
        f"| (plugin head - CE head) / C: the loss head's share of that overhead | {head_extra:+.1%} (of medians) "
        "| - | - |",
        "",
        "| B with `loss.head` | median (min - max) | tokens/s (batch x seq / median) | / logits head "
        "(median of per-repetition ratios) |",
        "|---|---|---|---|",
        *(f"| `{head}` | {span[key]} | {tokens / med[key]:,.0f} | "
          f"{statistics.median(b / a for a, b in zip(per_rep['B'], per_rep[key])):.3f} |"
          for head, key in zip(HEADS, ("B", *(f"B_{h}" for h in HEADS[1:])))),
    ]
    return "\n".join([
        f"Command: `python benchmarks/bench_policy_step.py{' ' + argv if argv else ''}`", "",
        f"Setup: {model}.", "", f"Machine: {machine}.", "", *rows])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, few repetitions (smoke run)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (gloo processes)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (override)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default 1)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (override): a larger one weighs the head")
    args = ap.parse_args(argv)
    threads = args.threads or 1
    cfg = dict(QUICK if args.quick else FULL)
    if args.reps is not None:
        cfg["reps"] = args.reps
    if args.vocab is not None:
        cfg["vocab"] = args.vocab
    print(run(cfg, args.tp, threads), flush=True)


if __name__ == "__main__":
    main()
