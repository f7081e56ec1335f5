"""runner/resume_check.py: which changed keys a resume warns about. run.steps is bookkeeping for a
constant learning rate, but a cosine or linear decay (optimizer.lr_at(step, run.steps)) stretches
with it, so the learning rate after the resume changes: that gets the one warning line."""
from pathlib import Path

import pytest

from megatron_cispo.runner.experiment import dump_yaml, load_experiment
from megatron_cispo.runner.resume_check import changed_settings_warning, resume_changes

DEMO = str(Path(__file__).resolve().parents[2] / "yaml_configs" / "demo_cpu.yaml")


def _changes(saved: list[str], now: list[str]):
    text = dump_yaml(load_experiment(DEMO, saved))
    return resume_changes(text, load_experiment(DEMO, now), path=Path("/ckpt"))


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_more_steps_under_a_decaying_schedule_warn_because_the_learning_rate_changes(schedule):
    opt = [f"optimizer.schedule={schedule}", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4"]
    got = _changes([*opt, "run.steps=10"], [*opt, "run.steps=20"])
    assert got == [("run.steps", 10, 20)]
    cfg = load_experiment(DEMO, opt)
    assert cfg.optimizer.lr_at(5, 10) != cfg.optimizer.lr_at(5, 20)  # why it is worth a warning
    assert "run.steps 10 -> 20 (the learning-rate decay now spans the new run.steps)" in changed_settings_warning(
        Path("/ckpt"), got, 4)


@pytest.mark.parametrize("opt", [["optimizer.schedule=constant", "optimizer.warmup_steps=3"],
                                 ["optimizer.schedule=cosine", "optimizer.lr=1e-3", "optimizer.min_lr=1e-3"]])
def test_more_steps_with_a_learning_rate_that_does_not_depend_on_them_stay_silent(opt):
    assert _changes([*opt, "run.steps=10"], [*opt, "run.steps=20"]) == []
    cfg = load_experiment(DEMO, opt)
    assert [cfg.optimizer.lr_at(s, 10) for s in range(10)] == [cfg.optimizer.lr_at(s, 20) for s in range(10)]
