"""Resuming with settings that differ from the checkpoint's, through the CLI: optimizer settings
apply after the load (with one warning line), what the checkpoint was made for is refused in one
line (exit 2), another model shape without a saved config is one line too, a larger
rollout.staleness samples with the oldest version the checkpoint holds, and every start's config
is kept.

One single-process run of 4 steps, checkpointing every 2, is the reference; each case resumes a
copy of it without its step-4 checkpoint.
"""
import shutil

import pytest
import yaml

from e2e_helpers import DEMO, TIMING, TINY, metrics, ranks

STEPS = 4


def _args(run_dir, *extra):
    return [DEMO, *TINY, "parallelism.tp=1", f"run.steps={STEPS}", "run.checkpoint_interval=2",
            f"run.run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    ranks(1, _args(run_dir))
    return run_dir


def _resumable(reference, tmp_path, step=2):
    """A copy of the reference run that stopped after its checkpoint of `step`."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    for ckpt in (run_dir / "checkpoints").iterdir():
        if int(ckpt.name.split("_")[1]) > step:
            shutil.rmtree(ckpt)
    return run_dir, run_dir / "checkpoints" / f"step_{step:06d}"


def _one_line(proc, text):
    lines = [line for line in proc.stderr.splitlines() if text in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    # no rank printed a traceback
    assert "[rank0]" not in proc.stderr and "megatron_cispo/" not in proc.stderr.replace(DEMO, ""), proc.stderr[-3000:]
    return lines[0]


def test_a_changed_weight_decay_applies_after_resume_with_one_warning_and_every_start_keeps_its_config(
        reference, tmp_path):
    run_dir, ckpt = _resumable(reference, tmp_path)
    proc = ranks(1, _args(run_dir, "run.resume=true", "optimizer.weight_decay=0.5"))
    assert _one_line(proc, "warning: resuming") == (
        f"warning: resuming {ckpt} with changed settings, applied from step 3: optimizer.weight_decay 0.0 -> 0.5 "
        "(run_dir/config_history/ keeps each start's config)")
    ref, got = metrics(reference), metrics(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    same = lambda r: {k: v for k, v in r.items() if k not in TIMING}  # noqa: E731
    assert same(got[2]) == same(ref[2])  # step 3 is scored with step 2's weights; its update has the decay
    assert same(got[3]) != same(ref[3]), "weight_decay=0.5 trained like weight_decay=0.0"
    assert got[3]["loss"] != ref[3]["loss"]
    history = sorted((run_dir / "config_history").iterdir())
    assert [p.name for p in history] == ["start_001_at_step_000000.yaml", "start_002_at_step_000002.yaml"]
    decay = [yaml.safe_load(p.read_text())["optimizer"]["weight_decay"] for p in history]
    assert decay == [0.0, 0.5] and yaml.safe_load((run_dir / "config.yaml").read_text())["optimizer"]["weight_decay"] == 0.5
    saved = run_dir / "checkpoints" / "step_000004" / "config.yaml"
    assert yaml.safe_load(saved.read_text())["optimizer"]["weight_decay"] == 0.5  # what trained up to step 4


def test_changes_the_checkpoint_cannot_carry_are_refused_in_one_line_naming_each_key(reference, tmp_path):
    run_dir, ckpt = _resumable(reference, tmp_path)
    before = metrics(run_dir)
    proc = ranks(1, _args(run_dir, "run.resume=true", "run.seed=7", "optimizer.name=sgd", "model.hidden_size=32"),
                 check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_line(proc, "cannot continue with changed")
    assert (f"run.resume: {ckpt} cannot continue with changed model.hidden_size (saved 64, now 32), optimizer.name "
            "(saved 'adam', now 'sgd'), run.seed (saved 1234, now 7): ") in line
    assert line.endswith("Resume with the saved values, or start a new run (another run.run_dir)")
    assert metrics(run_dir) == before


def test_another_model_shape_without_a_saved_config_is_one_line_naming_the_tensor(reference, tmp_path):
    # A checkpoint written before checkpoints held their config: the load itself finds the difference
    # (torch's CheckpointException is a BaseException; it printed 164 lines with 7 tracebacks).
    run_dir, ckpt = _resumable(reference, tmp_path)
    (ckpt / "config.yaml").unlink()
    proc = ranks(1, _args(run_dir, "run.resume=true", "model.hidden_size=32"), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_line(proc, "cannot load the model and optimizer")
    assert f"from {ckpt}: CheckpointingException: Global shape mismatch for loaded " in line
    assert "tensor for key embedding." in line and line.endswith("it was saved by another model or optimizer")


def test_a_larger_staleness_on_resume_samples_with_the_oldest_version_the_checkpoint_holds(reference, tmp_path):
    # At step 4 the sampler holds versions 2-4 (staleness 2); staleness 5 wants version 0 for steps 5 and 6.
    run_dir, ckpt = _resumable(reference, tmp_path, step=4)
    proc = ranks(1, _args(run_dir, "run.resume=true", "run.steps=6", "rollout.staleness=5",
                          "loss.cispo.anchor=old"))
    assert _one_line(proc, "warning: resuming").endswith(
        "applied from step 5: loss.cispo.anchor 'rollout' -> 'old', rollout.staleness 2 -> 5 "
        "(run_dir/config_history/ keeps each start's config)")
    got = metrics(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [(r["sampler_version"], r["policy_version_lag"]) for r in got[4:]] == [(2, 2), (2, 3)]
