"""The demo config, a few steps per anchor, under torchrun with 4 processes (TP=2 x DP=2)."""
import subprocess
import sys

import pytest

from e2e_helpers import ROOT, env, metrics, torchrun

STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    procs = {}
    for anchor in ("rollout", "old"):
        procs[anchor] = torchrun(4, [str(ROOT / f"yaml_configs/cispo_{anchor}.yaml"), f"run.steps={STEPS}",
                                     f"run.run_dir={out / anchor}", "run.log_interval=1"])
    return out, procs


REQUIRED = ("step", "reward_mean", "loss", "grad_norm", "ratio_mean", "ratio_min", "ratio_max", "clip_frac_low",
            "clip_frac_high", "tokens", "tokens_per_s", "policy_version_lag")


@pytest.mark.parametrize("anchor", ["rollout", "old"])
def test_demo_run_writes_metrics_figure_and_progress(runs, anchor):
    out, procs = runs
    recs = metrics(out / anchor)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for r in recs:
        assert set(REQUIRED) <= set(r), set(REQUIRED) - set(r)
        assert r["step/optimizer_steps"] == 1.0  # the fully-async regime: one step per batch
        assert r["tokens"] == 64 * 4  # 16 prompts x 4 samples x 4 answer tokens
    # the sampler lags: version max(0, t - 2) at step t
    assert [r["policy_version_lag"] for r in recs] == [0, 1, 2]
    assert (out / anchor / "metrics.png").stat().st_size > 0
    assert "ETA" in procs[anchor].stdout and f"step {STEPS}/{STEPS}" in procs[anchor].stdout


def test_old_anchor_is_inert_exactly(runs):
    out, _ = runs
    for r in metrics(out / "old"):
        assert r["ratio_min"] == r["ratio_max"] == r["ratio_mean"] == 1.0
        assert r["clip_frac_low"] == r["clip_frac_high"] == 0.0
        assert r["step/old_logprob_pass"] == 0.0  # pi_old came from the training forward, no extra pass


def test_rollout_anchor_sees_sampler_mismatch(runs):
    out, _ = runs
    recs = metrics(out / "rollout")
    # step 1 already differs from 1: the sampler runs in bf16 against the fp32 trainer
    assert recs[0]["ratio_min"] < 1.0 < recs[0]["ratio_max"]
    assert recs[0]["step/old_logprob_pass"] == 0.0  # the rollout anchor needs no pi_old at all


def test_report_prints_table_and_writes_comparison_figure(runs):
    out, _ = runs
    proc = subprocess.run([sys.executable, "-m", "megatron_cispo.demo.report", str(out / "rollout"),
                           str(out / "old"), "--png", str(out / "cmp.png")], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "cispo:rollout" in proc.stdout and "cispo:old" in proc.stdout
    assert "[PASS] cispo:old: old anchor: ratio exactly 1" in proc.stdout
    assert (out / "cmp.png").stat().st_size > 0


def test_fresh_fp32_sampler_makes_the_rollout_anchor_equal_the_old(tmp_path):
    # No staleness, no precision gap: pi_rollout is pi_theta up to float rounding.
    torchrun(1, [str(ROOT / "yaml_configs/cispo_rollout.yaml"), "parallelism.tp=1", "rollout.staleness=0",
                 "rollout.precision=fp32", "run.steps=2", f"run.run_dir={tmp_path}"])
    for r in metrics(tmp_path):
        assert abs(r["ratio_min"] - 1) < 1e-4 and abs(r["ratio_max"] - 1) < 1e-4
        assert r["clip_frac"] == 0.0 and r["policy_version_lag"] == 0
