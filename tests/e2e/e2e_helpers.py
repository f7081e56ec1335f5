"""End-to-end helpers: launch `megatron_cispo.train` under torchrun as a user would, or on the in-process
harness's ranks where the launcher is not the subject (`ranks`), and read metrics."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import pytest

from megatron_cispo.runner.metrics import TIMING_KEYS as TIMING  # wall-clock keys, left out of comparisons
from megatron_cispo.testing import RankFailed, free_port, spawn

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


_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _cli_rank(argv: list[str], out_dir: str, run_env: dict[str, str]) -> int:
    """One rank of `ranks`: `megatron_cispo.train.main(argv)` as torchrun's worker would run it (ROOT as the
    cwd, env()'s variables, stdout and stderr at fd level in files, so child processes' output is kept)."""
    rank = os.environ["RANK"]
    os.chdir(ROOT)
    ours = {k: os.environ[k] for k in _RANK_ENV}  # the harness's; the rest is the caller's env() as of now
    os.environ.clear()
    os.environ.update({**run_env, **ours})
    warnings.simplefilter("ignore")  # what env()'s PYTHONWARNINGS=ignore does at a process's start
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(os.path.join(out_dir, f"{name}.{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    from megatron_cispo.train import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - as a process would: the traceback on stderr, exit 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def ranks(nproc: int, args: list[str], *, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    """`megatron_cispo.train` on `nproc` gloo ranks forked from the harness's forkserver (torch and
    megatron-core already imported), for tests whose subject is the run, not the launcher: the same
    main(), config, process groups and files as under torchrun, without its agent and per-rank imports
    (about 6-10 s a launch on 2 cores). Every rank runs to its end (torchrun would stop the others at
    the first failure); returncode is the first non-zero rank code, stdout and stderr are the ranks'
    in rank order. Launcher behaviour (signals, exit summaries, nodes) stays with `torchrun`."""
    out_dir = Path(tempfile.mkdtemp(prefix="cispo_ranks_"))
    run_env = {k: v for k, v in env().items() if k not in _RANK_ENV}  # the forkserver's env is from its start
    try:
        codes = spawn(_cli_rank, nproc, (list(args), str(out_dir), run_env), timeout_s=timeout)
        failure = ""
    except RankFailed as e:
        codes, failure = [1] * nproc, f"\n{e}"
    read = lambda name: "".join((out_dir / f"{name}.{r}").read_text(errors="replace")  # noqa: E731
                                for r in range(nproc) if (out_dir / f"{name}.{r}").is_file())
    proc = subprocess.CompletedProcess(["ranks", str(nproc), *args], next((c for c in codes if c), 0),
                                       read("stdout"), read("stderr") + failure)
    shutil.rmtree(out_dir, ignore_errors=True)
    if check and proc.returncode != 0:
        pytest.fail(f"ranks exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def killed_after_step_2(reference: Path, run_dir: Path) -> None:
    """The state of a job killed right after its step-2 checkpoint: that checkpoint and its metrics."""
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "step_000002", run_dir / "checkpoints" / "step_000002")
    shutil.copy(reference / "metrics.jsonl", run_dir / "metrics.jsonl")  # steps 3-4 are cut on resume


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

    def __init__(self, tmp_path: Path, nproc: int, args: list[str], *, nnodes: int = 1, node_rank: int = 0,
                 port: int | None = None):
        """nnodes > 1: this node's torchrun (node_rank), all nodes' on the same `port` of 127.0.0.1."""
        self.out, self.err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        cmd = torchrun_cmd(nproc, args, nnodes=nnodes, node_rank=node_rank, port=port or free_port())
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=out, stderr=err, start_new_session=True)

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


def served_per_step(recs: list[dict]) -> list[tuple[int, int]]:
    """(replica 0's, replica 1's) prompts in each step, from the running totals rollout/engine<k>_prompts."""
    totals = [(0, 0)] + [(int(r["rollout/engine0_prompts"]), int(r["rollout/engine1_prompts"])) for r in recs]
    return [(a - pa, b - pb) for (pa, pb), (a, b) in zip(totals, totals[1:])]
