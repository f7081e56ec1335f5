"""Where a vLLM run's step goes: rollout, weight sync, reward and training, from its metrics.jsonl.

    bash launch/demo_vllm.sh                                    # runs/demo_vllm/{rollout,old}
    .venv/bin/python benchmarks/bench_vllm_step.py runs/demo_vllm/rollout runs/demo_vllm/old

Per run: the engine's start-up and step 1's first generate (vLLM compiles its logprob op there), then
the mean over steps 2..N of rollout (vLLM's generate), sync (export of the synced version as an HF
directory + reload into the engine), reward (the reward worker) and train (the rest of the step: the
broadcast, the policy step and the weight gather), the bytes written per sync, the sampler/trainer
mismatch (k3 KL, where the run recomputed pi_old) and the clip fraction. Numbers are measured by the
run itself (time.perf_counter around each part, rank 0); this script only reads them.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def split(run_dir: str | Path) -> dict:
    every = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x]
    recs = [r for r in every if "reward_mean" in r]  # the steps: step 0 holds only the evaluation before them
    start = every[0].get("rollout/engine_start_s", every[0].get("eval/rollout_engine_start_s")) if every else None
    if not recs or "rollout/seconds" not in recs[0]:
        raise SystemExit(f"{run_dir}: no rollout/seconds in metrics.jsonl (not a rollout.engine=vllm run)")
    later = [r for r in recs if "rollout/engine_start_s" not in r]  # steps without an engine start
    parts = ("rollout/seconds", "sync/seconds", "reward/seconds")
    out = {"run": str(run_dir), "steps": len(recs),
           "engine_start_s": float("nan") if start is None else start, "first_generate_s": recs[0]["rollout/seconds"],
           **{p.split("/")[0]: _mean([r.get(p) for r in later]) for p in parts},
           "step": _mean([r["step_time_s"] for r in later]),
           "sync_mb": _mean([r["sync/bytes"] / 2**20 for r in later if r["sync/bytes"] > 0]),
           "k3": _mean([r.get("mismatch/k3_kl") for r in recs]),
           "clip": _mean([r.get("cispo/clip_frac_low", 0.0) + r.get("cispo/clip_frac_high", 0.0) for r in recs])}
    out["train"] = out["step"] - out["rollout"] - out["sync"] - out["reward"]
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    head = (f"{'run':<28} {'steps':>5} {'start s':>8} {'1st gen s':>9} {'step s':>7} {'rollout':>8} {'sync':>7} "
            f"{'reward':>7} {'train':>7} {'sync MB':>8} {'k3 mismatch':>11} {'clip':>6}")
    print(head)
    print("-" * len(head))
    for d in argv:
        s = split(d)
        print(f"{s['run'][-28:]:<28} {s['steps']:>5} {s['engine_start_s']:>8.1f} {s['first_generate_s']:>9.1f} "
              f"{s['step']:>7.3f} {s['rollout']:>8.3f} {s['sync']:>7.3f} {s['reward']:>7.3f} {s['train']:>7.3f} "
              f"{s['sync_mb']:>8.2f} {s['k3']:>11.2e} {s['clip']:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
