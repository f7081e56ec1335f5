"""data.reward_workers: one step's samples scored by a slow reward on 1 worker and on N, side by side.

    python benchmarks/bench_rewards.py                         # a 1 s reward, 32 samples, 1 and 4 workers
    python benchmarks/bench_rewards.py --seconds 0.2 --samples 64 --workers 1 2 8

The reward sleeps (a verifier, a sandbox or a judge waits on something else), so N workers should
score a step in about 1/N of one worker's time plus their start-up; the start-up (each worker imports
the reward's module) is timed apart. Prints the wall time of one score() call per worker count and
its ratio to the first count's.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from megatron_cispo.rollout.rewards import RewardRunner

REWARD = """
import time

def slow(record, completion, token_ids):
    time.sleep(record["s"])
    return 1.0
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="what one reward call takes")
    ap.add_argument("--samples", type=int, default=32, help="samples in the step")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4], help="worker counts to compare")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "slow_reward.py"
        path.write_text(REWARD)
        records = [{"s": args.seconds}] * args.samples
        rows = []
        for n in args.workers:
            t0 = time.perf_counter()
            with RewardRunner(f"{path}:slow", timeout_s=10 * args.seconds + 10, workers=n) as runner:
                t1 = time.perf_counter()
                res = runner.score(records, ["x"] * args.samples, [[1]] * args.samples)
                t2 = time.perf_counter()
            if res.rewards != [1.0] * args.samples:
                print(f"bench_rewards: {n} workers scored {res.rewards}", file=sys.stderr)
                return 1
            rows.append((n, t1 - t0, t2 - t1))
    first = rows[0][2]
    print(f"{'workers':>7} {'start s':>8} {'score s':>8} {f'vs {rows[0][0]} worker(s)':>16}")
    for n, start, score in rows:
        print(f"{n:>7} {start:>8.2f} {score:>8.2f} {score / first:>15.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
