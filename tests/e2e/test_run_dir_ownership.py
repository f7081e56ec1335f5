"""The CLI as a user runs it twice into one run_dir: in sequence (another seed) and at the same time (the
first job under torchrun, the second beside it on the harness's ranks)."""
import time

import yaml

from e2e_helpers import DEMO, TINY, Job, metrics, ranks


def _args(run_dir, *extra):
    return [DEMO, *TINY, "parallelism.tp=1", f"run.run_dir={run_dir}", *extra]


def test_a_fresh_run_never_truncates_or_prunes_an_earlier_run_and_resume_finds_its_own_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    ranks(1, _args(run_dir, "run.steps=6", "run.checkpoint_interval=2"))
    first = metrics(run_dir)
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5, 6]

    refused = ranks(1, _args(run_dir, "run.steps=2", "run.checkpoint_interval=2", "run.seed=7"), check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"run.run_dir={run_dir} already holds a run" in refused.stderr
    assert metrics(run_dir) == first  # untouched

    ranks(1, _args(run_dir, "run.steps=2", "run.checkpoint_interval=2", "run.seed=7", "run.overwrite=true"))
    (previous,) = [p for p in run_dir.iterdir() if p.name.startswith("previous_")]
    assert metrics(previous) == first
    assert sorted(p.name for p in (previous / "checkpoints").iterdir()) == ["step_000004", "step_000006"]
    # The new run's step-2 checkpoint survives although the old run's steps 4 and 6 sort later.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000002"]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]

    resumed = ranks(1, _args(run_dir, "run.steps=3", "run.checkpoint_interval=2", "run.seed=7", "run.resume=true"))
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000002'}" in resumed.stdout
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]


def test_a_second_job_on_a_busy_run_dir_fails_at_once_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    first = Job(tmp_path, 2, _args(run_dir, "run.steps=100000"))
    try:
        first.wait_for_steps(run_dir, 1)  # the first job holds the lock and is training
        holder = (run_dir / ".lock").read_text().strip()
        t0 = time.monotonic()
        second = ranks(2, _args(run_dir, "run.steps=2", "run.overwrite=true"), check=False, timeout=120)
        assert time.monotonic() - t0 < 60
        assert first.proc.poll() is None  # the first job was still running all along
    finally:
        first.kill()
    assert second.returncode == 2, second.stderr[-3000:]
    lines = [line for line in second.stderr.splitlines() if "is in use by" in line]
    assert len(lines) == 1 and holder in lines[0], second.stderr[-3000:]  # said once, by rank 0
    # The second job moved nothing aside and wrote nothing: the first job's steps run on from 1.
    assert not [p for p in run_dir.iterdir() if p.name.startswith("previous_")]
    steps = [r["step"] for r in metrics(run_dir)]
    assert steps == list(range(1, len(steps) + 1)) and steps, steps
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["steps"] == 100000
