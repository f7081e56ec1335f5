"""End-to-end helpers: launch `megatron_cispo.train` under torchrun as a user would, read metrics."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_cispo.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "yaml_configs" / "demo_cpu.yaml")
# A smaller batch than the demo's, fp32 sampler (layouts compare to 1e-4), checkpoints every 2 steps.
TINY = ["rollout.prompts_per_step=8", "rollout.group_size=4", "parallelism.micro_batch_size=8",
        "rollout.precision=fp32", "run.log_interval=1", "run.tensorboard=false"]
TIMING = ("tokens_per_s", "step_time_s", "elapsed_s")


def env() -> dict[str, str]:
    out = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out.pop("RANK", None)
    out.pop("WORLD_SIZE", None)
    return out


def torchrun_cmd(nproc: int, args: list[str], *, nnodes: int = 1, node_rank: int = 0, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node_rank),
            "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", "megatron_cispo.train", *args]


def torchrun(nproc: int, args: list[str], *, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(torchrun_cmd(nproc, args, port=free_port()), cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


def assert_metrics_close(a: list[dict], b: list[dict], *, steps: int, atol: float) -> None:
    """Every numeric metric except wall-clock ones, step by step."""
    assert len(a) >= steps and len(b) >= steps, (len(a), len(b))
    for ra, rb in zip(a[:steps], b[:steps]):
        keys = sorted(set(ra) - set(TIMING))
        assert keys == sorted(set(rb) - set(TIMING))
        for k in keys:
            if k in ("step/forward_calls", "step/microbatches"):
                continue  # per-rank counts: they depend on how many microbatches each rank runs
            assert abs(ra[k] - rb[k]) <= atol, f"step {ra['step']} {k}: {ra[k]} vs {rb[k]}"
