"""metrics.jsonl stays strict JSON when a metric is NaN or infinite, its readers cope with the
nulls, and the config refuses non-finite optimizer settings."""
import io
import json
import math

import pytest

from megatron_cispo.runner.metrics import MetricsWriter, json_line, read_metrics
from megatron_cispo.demo.report import summarize
from megatron_cispo.runner.experiment import OptimizerConfig, RunConfig


def _strict(line: str) -> dict:
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(line, parse_constant=refuse)


def _record(step: int, **extra) -> dict:
    return {"step": step, "reward_mean": 0.25 * step, "policy_version_lag": 0, "clip_frac": 0.1,
            "ratio_min": 0.5, "ratio_max": 2.0, "elapsed_s": float(step), **extra}


def test_nonfinite_values_are_written_as_null_and_listed(tmp_path):
    w = MetricsWriter(tmp_path, label="t", total_steps=3, log_interval=1, tensorboard=False, stream=io.StringIO())
    w.log(_record(1))
    w.log(_record(2, **{"policy/loss": float("nan"), "ratio_min": float("inf"), "step/grad_norm": float("-inf")}))
    w.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first, second = (_strict(line) for line in lines)
    assert "nonfinite" not in first  # a clean line is unchanged
    assert second["nonfinite"] == ["ratio_min", "policy/loss", "step/grad_norm"]
    assert second["policy/loss"] is None and second["ratio_min"] is None and second["step/grad_norm"] is None
    assert second["reward_mean"] == 0.5


def test_resume_keeps_the_null_lines_strict(tmp_path):
    w = MetricsWriter(tmp_path, label="t", total_steps=3, log_interval=1, tensorboard=False, stream=io.StringIO())
    for step in (1, 2, 3):
        w.log(_record(step, **{"policy/loss": float("nan") if step == 2 else 0.0}))
    w.close()
    MetricsWriter(tmp_path, label="t", total_steps=3, log_interval=1, start_step=2, tensorboard=False,
                  stream=io.StringIO()).close()
    recs = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2] and recs[1]["nonfinite"] == ["policy/loss"]


def test_json_line_leaves_ints_strings_and_lists_alone():
    line = json_line({"step": 3, "label": "x", "keys": ["a"], "v": 1.5, "bad": float("nan")})
    assert _strict(line) == {"step": 3, "label": "x", "keys": ["a"], "v": 1.5, "bad": None, "nonfinite": ["bad"]}


def test_report_summary_skips_null_values(tmp_path):
    recs = [_record(1), _record(2, ratio_min=None, ratio_max=None, clip_frac=None, nonfinite=["ratio_min"]),
            _record(3, reward_mean=None)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert read_metrics(tmp_path)[1]["ratio_min"] is None
    s = summarize(tmp_path)
    assert (s["ratio_min"], s["ratio_max"], s["clip_frac_max"]) == (0.5, 2.0, 0.1)
    assert s["reward_first"] == 0.25 and math.isnan(s["reward_last"])  # the last step's reward is null
    assert s["clip_frac_mean"] == pytest.approx(0.1)


@pytest.mark.parametrize("field", ["lr", "min_lr", "weight_decay", "clip_grad", "adam_beta1", "adam_beta2"])
def test_optimizer_settings_must_be_finite(field):
    with pytest.raises(ValueError, match=rf"optimizer\.{field} must be finite, got inf"):
        OptimizerConfig(**{field: float("inf")})


def test_max_consecutive_skips_must_be_non_negative():
    assert RunConfig(max_consecutive_skips=0).max_consecutive_skips == 0  # 0 = never stop
    with pytest.raises(ValueError, match=r"run\.max_consecutive_skips must be >= 0, got -1"):
        RunConfig(max_consecutive_skips=-1)
