"""Checkpoints that survive faults: a corrupt newest checkpoint falls back to the previous one with a
warning naming the file, none intact is refused in one line, pruning sorts by step, and a disk
that fills up during a save stops the run in one line with the partial checkpoint removed.

One (tp, pp, dp) = (2, 1, 1) CLI run of 4 steps, checkpointing every 2, is the reference; the
fault cases corrupt copies of its checkpoints and call checkpoint.resume_point in this process.
"""
import json
import os
import shutil
import subprocess

import pytest
from torch.distributed.checkpoint import FileSystemReader

from e2e_helpers import DEMO, TINY, assert_metrics_close, metrics, ranks
from megatron_cispo.train import EXIT_SAVE_FAILED
from megatron_cispo.config import ConfigError
from megatron_cispo.runner import checkpoint, checkpoint_files

STEPS = 4


def _args(run_dir, *extra):
    return [DEMO, *TINY, f"run.steps={STEPS}", "run.checkpoint_interval=2", f"run.run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref") / "tp2"
    ranks(2, _args(run_dir, "parallelism.tp=2"))
    return run_dir


def _copy(reference, run_dir):
    shutil.copytree(reference / "checkpoints", run_dir / "checkpoints")
    shutil.copy(reference / "metrics.jsonl", run_dir / "metrics.jsonl")
    return run_dir / "checkpoints"


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _corrupt(step_dir, case):
    """Damage one file of a checkpoint as a crash or a full disk would; returns that file."""
    if case == "truncated_model_shard":  # rank 1's shard of the model and optimizer
        path = step_dir / "__1_0.distcp"
        _truncate(path)
    elif case == "missing_model_shard":  # e.g. a rank that wrote to another run_dir
        path = step_dir / "__1_0.distcp"
        path.unlink()
    elif case == "deleted_COMPLETE":  # by hand: save() renames a step directory into place only after COMPLETE
        path = step_dir / "COMPLETE"
        path.unlink()
    elif case == "empty_COMPLETE":
        path = step_dir / "COMPLETE"
        path.write_text("")
    elif case == "garbage_sampler":
        path = step_dir / "sampler.pt"
        path.write_bytes(b"\x80\x04garbage" * 100)
    elif case == "garbage_common":  # common.pt, or (megatron-core 0.19+) the common_state bytes in a shard
        path = step_dir / checkpoint_files.COMMON
        if path.is_file():
            path.write_bytes(b"\x80\x04garbage" * 100)
        else:
            key = checkpoint_files.common_state_object().unique_key
            item = next(item for index, item in FileSystemReader(str(step_dir)).read_metadata().storage_data.items()
                        if index.fqn == key)
            path = step_dir / item.relative_path
            with open(path, "r+b") as f:
                f.seek(item.offset)
                f.write(b"\xff" * item.length)
    return path


@pytest.mark.parametrize("case", ["truncated_model_shard", "missing_model_shard", "empty_COMPLETE",
                                  "deleted_COMPLETE", "garbage_sampler", "garbage_common"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one_with_a_warning(reference, tmp_path,
                                                                                   capsys, case):
    ckpts = _copy(reference, tmp_path)
    assert checkpoint.resume_point(tmp_path) == ckpts / "step_000004"  # intact as written
    bad = _corrupt(ckpts / "step_000004", case)
    capsys.readouterr()
    assert checkpoint.resume_point(tmp_path) == ckpts / "step_000002"
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 1 and str(bad) in warnings[0], warnings


def test_resume_refuses_in_one_line_when_no_checkpoint_is_intact(reference, tmp_path, capsys):
    ckpts = _copy(reference, tmp_path)
    bad4 = _corrupt(ckpts / "step_000004", "truncated_model_shard")
    bad2 = _corrupt(ckpts / "step_000002", "garbage_sampler")
    with pytest.raises(ConfigError) as e:
        checkpoint.resume_point(tmp_path)
    message = str(e.value)
    assert "\n" not in message and str(ckpts) in message and str(bad4) in message and str(bad2) in message
    assert len(capsys.readouterr().err.strip().splitlines()) == 2  # one warning per checkpoint tried


def test_unfinished_saves_are_ignored_and_no_checkpoint_means_a_fresh_start(reference, tmp_path, capsys):
    ckpts = tmp_path / "checkpoints"
    # A save killed before its rename (a hidden .tmp directory) is no checkpoint, and no warning.
    shutil.copytree(reference / "checkpoints" / "step_000004", ckpts / ".step_000006.tmp")
    assert checkpoint.resume_point(tmp_path) is None and capsys.readouterr().err == ""
    # A step directory without COMPLETE was damaged after its save: unusable, never silently skipped.
    shutil.copytree(reference / "checkpoints" / "step_000004", ckpts / "step_000008")
    (ckpts / "step_000008" / "COMPLETE").unlink()
    with pytest.raises(ConfigError, match="no intact checkpoint.*step_000008/COMPLETE: missing"):
        checkpoint.resume_point(tmp_path)
    shutil.copytree(reference / "checkpoints" / "step_000002", ckpts / "step_000002")
    assert checkpoint.resume_point(tmp_path) == ckpts / "step_000002"


def _fake_complete(ckpts, step):
    path = ckpts / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text(json.dumps({"step": step}))
    return path


def test_pruning_sorts_by_step_not_by_name(tmp_path):
    ckpts = tmp_path / "checkpoints"
    steps = [999_998, 999_999, 1_000_000]  # "step_1000000" sorts before "step_999998" as a string
    paths = [_fake_complete(ckpts, s) for s in steps]
    assert checkpoint.last_complete(tmp_path) == paths[-1]
    gone = checkpoint_files.prune(tmp_path, keep=2, newest=paths[-1])
    assert gone == [paths[0]] and paths[1].is_dir() and paths[2].is_dir()


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path, capsys):
    # An older run (or an abandoned history) left steps 4 and 6; this run has just written step 2.
    ckpts = tmp_path / "checkpoints"
    stale = [_fake_complete(ckpts, 4), _fake_complete(ckpts, 6)]
    (ckpts / ".step_000008.tmp").mkdir()  # a save killed before its rename
    newest = _fake_complete(ckpts, 2)
    gone = checkpoint_files.prune(tmp_path, keep=1, newest=newest)
    assert newest.is_dir() and stale[1].is_dir()  # the one just written, and the highest step
    assert sorted(gone) == sorted([stale[0], ckpts / ".step_000008.tmp"]) and not stale[0].exists()
    warning = capsys.readouterr().err
    assert "step_000004, step_000006" in warning and "higher step" in warning


def test_the_cli_resumes_on_another_layout_from_the_previous_checkpoint_when_the_newest_is_truncated(
        reference, tmp_path):
    ckpts = _copy(reference, tmp_path)
    bad = _corrupt(ckpts / "step_000004", "truncated_model_shard")
    proc = ranks(1, _args(tmp_path, "run.resume=true", "parallelism.tp=1"))
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warnings) == 1 and str(bad) in warnings[0] and "truncated" in warnings[0], proc.stderr[-3000:]
    assert f"resumed from {ckpts / 'step_000002'}" in proc.stdout
    resumed = metrics(tmp_path)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # steps 3-4 trained again, at tp 1
    assert_metrics_close(resumed, metrics(reference), steps=STEPS, atol=1e-4)
    assert checkpoint_files.verify(ckpts / "step_000004") is None  # rewritten whole


def test_the_cli_refuses_to_resume_when_no_checkpoint_is_intact(reference, tmp_path):
    ckpts = _copy(reference, tmp_path)
    for step in (2, 4):
        _corrupt(ckpts / f"step_{step:06d}", "empty_COMPLETE")
    proc = ranks(2, _args(tmp_path, "run.resume=true", "parallelism.tp=2"), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]  # ConfigError's exit code
    errors = [line for line in proc.stderr.splitlines() if "no intact checkpoint" in line]
    assert len(errors) == 1 and str(ckpts) in errors[0], proc.stderr[-3000:]  # no rank printed a traceback:
    assert "ConfigError" not in proc.stderr and "megatron_cispo/" not in proc.stderr.replace(DEMO, "")


@pytest.fixture
def small_disk(tmp_path):
    """A real full disk: a 4 MiB tmpfs holds one checkpoint of the 2-rank TINY run (2.7 MiB), not two."""
    path = tmp_path / "disk"
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)]).returncode:
        pytest.skip("needs root with permission to mount a small tmpfs (a real ENOSPC)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_full_disk_during_a_checkpoint_stops_in_one_line_and_removes_the_partial_checkpoint(small_disk):
    run_dir = small_disk / "run"
    proc = ranks(2, [DEMO, *TINY, "parallelism.tp=1", "run.steps=6", "run.checkpoint_interval=2",
                     f"run.run_dir={run_dir}"], check=False)
    assert proc.returncode == EXIT_SAVE_FAILED, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "not written" in line]
    assert len(lines) == 1, proc.stderr[-3000:]  # said once, by rank 0; no rank printed a traceback:
    assert "[rank0]" not in proc.stderr and "megatron_cispo/" not in proc.stderr.replace(DEMO, "")
    tmp, ckpts = run_dir / "checkpoints" / ".step_000004.tmp", run_dir / "checkpoints"
    assert lines[0].startswith("checkpoint of step 4 not written: ") and "No space left on device" in lines[0]
    assert f"; {tmp} (" in lines[0] and f" MiB are free in {ckpts}; the earlier checkpoints are untouched" in lines[0]
    assert not tmp.exists() and sorted(p.name for p in ckpts.iterdir()) == ["step_000002"]
    assert checkpoint_files.verify(ckpts / "step_000002") is None
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
