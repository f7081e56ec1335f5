"""End-to-end helpers: launch `megatron_cispo.train` under torchrun as a user would, read metrics."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_cispo.demo.metrics import TIMING_KEYS as TIMING  # wall-clock keys, left out of comparisons
from megatron_cispo.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "yaml_configs" / "demo_cpu.yaml")
# A smaller batch than the demo's, fp32 sampler (layouts compare to 1e-4), checkpoints every 2 steps.
TINY = ["rollout.prompts_per_step=8", "rollout.group_size=4", "parallelism.micro_batch_size=8",
        "rollout.precision=fp32", "run.log_interval=1", "run.tensorboard=false"]


def env() -> dict[str, str]:
    out = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out.pop("RANK", None)
    out.pop("WORLD_SIZE", None)
    return out


def torchrun_cmd(nproc: int, args: list[str], *, nnodes: int = 1, node_rank: int = 0, port: int,
                 python: str = sys.executable) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node_rank),
            "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", "megatron_cispo.train", *args]


def torchrun(nproc: int, args: list[str], *, timeout: float = 240, check: bool = True,
             python: str = sys.executable) -> subprocess.CompletedProcess:
    """`python` (another venv's, e.g. the other megatron-core tier's) runs torchrun and the job."""
    for _ in range(3):
        proc = subprocess.run(torchrun_cmd(nproc, args, port=free_port(), python=python), cwd=ROOT, env=env(),
                              capture_output=True, text=True, timeout=timeout)
        # free_port's port can be taken by another socket before torchrun binds it (seen once in ~1000
        # launches): the rendezvous never started and nothing ran, so the same launch on a new port is the test
        if not (proc.returncode != 0 and "EADDRINUSE" in proc.stderr and "_rendezvous" in proc.stderr):
            break
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


class Job:
    """torchrun in its own session, output to files (a pipe could fill and stall it)."""

    def __init__(self, tmp_path: Path, nproc: int, args: list[str]):
        self.out, self.err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(torchrun_cmd(nproc, args, port=free_port()), cwd=ROOT, env=env(),
                                         stdout=out, stderr=err, start_new_session=True)

    def workers(self) -> dict[int, int]:
        """{rank: pid} of the workers torchrun started (its children, each with RANK in its env)."""
        found = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                environ = (stat.parent / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            rank = [v[5:] for v in environ if v.startswith(b"RANK=")]
            if ppid == self.proc.pid and rank:
                found[int(rank[0])] = int(stat.parent.name)
        return found

    def wait_for_steps(self, run_dir: Path, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not (run_dir / "metrics.jsonl").is_file() or len(metrics(run_dir)) < n:
            assert self.proc.poll() is None, self.output()[-3000:]
            assert time.monotonic() < deadline, f"no step {n} in {timeout}s:\n{self.output()[-3000:]}"
            time.sleep(0.1)

    def output(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            for pid in self.workers().values():  # torchrun starts each worker in its own session
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # SIGKILL also ends a stopped worker
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
