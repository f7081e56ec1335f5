"""The demo's two runs (`bash launch/demo.sh`: 60 steps per anchor, 4 processes, TP=2 x DP=2), read from
the session's README-order run (tests/e2e/conftest.py, readme_run), plus a fresh fp32 sampler run."""
from e2e_helpers import ROOT, metrics, ranks

STEPS = 60  # launch/demo.sh's default
REQUIRED = ("step", "reward_mean", "loss", "grad_norm", "ratio_mean", "ratio_min", "ratio_max", "clip_frac_low",
            "clip_frac_high", "tokens", "tokens_per_s", "policy_version_lag")


def _demo(readme_run):
    return readme_run.clone / "runs" / "demo", readme_run.output("bash launch/demo.sh")


def test_demo_runs_write_metrics_figures_and_progress(readme_run):
    out, printed = _demo(readme_run)
    for anchor in ("rollout", "old"):
        recs = metrics(out / anchor)
        assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
        for r in recs:
            assert set(REQUIRED) <= set(r), set(REQUIRED) - set(r)
            assert r["step/optimizer_steps"] == 1.0  # the fully-async regime: one step per batch
            assert r["tokens"] == 64 * 4  # 16 prompts x 4 samples x 4 answer tokens
        # the sampler lags: version max(0, t - 2) at step t
        assert [r["policy_version_lag"] for r in recs] == [min(t, 2) for t in range(STEPS)]
        assert (out / anchor / "metrics.png").stat().st_size > 0
        assert f"[cispo:{anchor}] step {STEPS}/{STEPS}" in printed
    assert "ETA" in printed and (out / "comparison.png").stat().st_size > 0


def test_old_anchor_is_inert_exactly(readme_run):
    out, printed = _demo(readme_run)
    for r in metrics(out / "old"):
        assert r["ratio_min"] == r["ratio_max"] == r["ratio_mean"] == 1.0
        assert r["clip_frac_low"] == r["clip_frac_high"] == 0.0
        assert r["step/old_logprob_pass"] == 0.0  # pi_old came from the training forward, no extra pass
    assert "[PASS] cispo:old: old anchor: ratio exactly 1" in printed  # the report's check


def test_rollout_anchor_sees_sampler_mismatch_and_clips(readme_run):
    out, printed = _demo(readme_run)
    recs = metrics(out / "rollout")
    # step 1 already differs from 1: the sampler runs in bf16 against the fp32 trainer
    assert recs[0]["ratio_min"] < 1.0 < recs[0]["ratio_max"]
    assert all(r["step/old_logprob_pass"] == 0.0 for r in recs)  # the rollout anchor needs no pi_old at all
    assert "[PASS] cispo:rollout: rollout anchor: clip fraction > 0" in printed


def test_fresh_fp32_sampler_makes_the_rollout_anchor_equal_the_old(tmp_path):
    # No staleness, no precision gap: pi_rollout is pi_theta up to float rounding.
    ranks(1, [str(ROOT / "yaml_configs/cispo_rollout.yaml"), "parallelism.tp=1", "rollout.staleness=0",
              "rollout.precision=fp32", "run.steps=2", f"run.run_dir={tmp_path}"])
    for r in metrics(tmp_path):
        assert abs(r["ratio_min"] - 1) < 1e-4 and abs(r["ratio_max"] - 1) < 1e-4
        assert r["clip_frac"] == 0.0 and r["policy_version_lag"] == 0
