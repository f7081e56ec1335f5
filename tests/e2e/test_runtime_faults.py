"""The CLI under runtime faults, launched with torchrun as a user would: ranks that resolve
different configs, a rank that stops answering (SIGSTOP), and preemption (SIGTERM to torchrun)."""
import os
import signal
import time
from pathlib import Path

from e2e_helpers import DEMO, TINY, Job, metrics, torchrun
from megatron_cispo.runner.checkpoint_files import MARKER
from megatron_cispo.train import EXIT_CONFIG, EXIT_PEER_LOST


def _args(run_dir, *extra):
    return [DEMO, *TINY, "parallelism.tp=1", f"run.run_dir={run_dir}", *extra]


def test_ranks_with_different_env_values_stop_at_start_naming_the_keys(tmp_path):
    # Each rank resolves run.seed and run.run_dir from its own RANK / LOCAL_RANK (set by torchrun).
    t0 = time.monotonic()
    proc = torchrun(2, _args(tmp_path / "${LOCAL_RANK}", "run.seed=${RANK}", "run.steps=2"), check=False,
                    timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"exitcode  : {EXIT_CONFIG}" in out, out[-3000:]
    assert time.monotonic() - t0 < 60
    lines = [line for line in out.splitlines() if "differs across ranks" in line]
    assert len(lines) == 1, out[-3000:]  # said once, by rank 0
    assert "run.seed: rank 0: 0, rank 1: 1" in lines[0]
    assert f"run.run_dir: rank 0: '{tmp_path / '0'}', rank 1: '{tmp_path / '1'}'" in lines[0]
    assert "megatron_cispo/" not in out.replace(DEMO, "")  # no traceback from a rank
    assert not (tmp_path / "0" / "metrics.jsonl").exists()  # stopped before training


def test_a_rank_that_stops_answering_is_named_by_rank_0_which_exits_4(tmp_path):
    # (Rank 0 being the stopped one, and the protocol's bounds, are in tests/distributed/test_runtime_health.py.)
    run_dir = tmp_path / "run"
    job = Job(tmp_path, 2, _args(run_dir, "run.steps=100000", "run.dist_timeout_s=4"))
    try:
        job.wait_for_steps(run_dir, 1)
        workers = job.workers()
        rank0, rank1 = workers[0], workers[1]
        os.kill(rank1, signal.SIGSTOP)
        t0 = time.monotonic()
        # gloo times out after 4 s and the health check waits 4 s more; allow a loaded machine.
        while _alive(rank0):
            assert time.monotonic() - t0 < 60, job.output()[-3000:]
            time.sleep(0.1)
        # torchrun would SIGKILL the stopped worker 30 s after SIGTERM; spare the test that wait.
        os.kill(rank1, signal.SIGKILL)
        job.proc.wait(timeout=60)
    finally:
        job.kill()
    out = job.output()
    summary = out[out.index("Root Cause"):]
    assert "rank      : 0" in summary and f"exitcode  : {EXIT_PEER_LOST}" in summary, out[-3000:]
    lines = [line for line in out.splitlines() if "stopped answering" in line]
    assert len(lines) == 1, out[-3000:]  # said once, by rank 0
    assert lines[0].startswith("rank 1 stopped answering: a collective waited longer than run.dist_timeout_s (4 s)")


def _alive(pid: int) -> bool:
    """Running or stopped, not exited (a zombie waits for torchrun to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_resume_runs_to_the_end(tmp_path):
    run_dir = tmp_path / "run"
    args = _args(run_dir, "run.steps=40")  # run.checkpoint_interval stays 0: no periodic checkpoints
    job = Job(tmp_path, 2, args)
    try:
        job.wait_for_steps(run_dir, 1)
        job.proc.send_signal(signal.SIGTERM)  # torchrun forwards it to every worker
        job.proc.wait(timeout=60)
    finally:
        job.kill()
    out = job.output()
    assert job.proc.returncode != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "stopped by SIGTERM" in line]
    assert len(lines) == 1, out[-3000:]  # said once, by rank 0
    steps = [r["step"] for r in metrics(run_dir)]
    stop = steps[-1]
    assert steps == list(range(1, stop + 1)) and stop < 40, steps
    ckpt = run_dir / "checkpoints" / f"step_{stop:06d}"
    assert lines[0] == (f"[cispo:rollout] stopped by SIGTERM after step {stop}: checkpoint written to {ckpt}; "
                        "to continue, run the same command with run.resume=true"), lines[0]
    assert (ckpt / MARKER).is_file() and sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [ckpt.name]

    resumed = torchrun(2, [*args, "run.resume=true"], timeout=180)
    assert f"resumed from {ckpt}" in resumed.stdout
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 41))
