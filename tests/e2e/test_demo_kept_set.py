"""Sampling-mask replay end to end: the demo's sampler filters with rollout.top_k / top_p, sends
its kept sets, and the trainer scores over them, so a fresh fp32 sampler's logprobs are the
trainer's and the rollout anchor's ratio is 1 (it would be pi_full / pi_kept < 1 without replay)."""
import pytest

from e2e_helpers import ROOT, metrics, ranks


@pytest.mark.parametrize("nproc, overrides", [
    (1, ["parallelism.tp=1", "rollout.top_k=3"]),  # the demo's fused head, packed
    (2, ["parallelism.tp=2", "rollout.top_p=0.8", "rollout.top_k=6", "loss.head=logits"]),
], ids=["top_k_fused_tp1", "top_p_logits_tp2"])
def test_fresh_fp32_sampler_with_top_k_top_p_makes_the_rollout_anchor_equal_the_old(tmp_path, nproc, overrides):
    ranks(nproc, [str(ROOT / "yaml_configs/cispo_rollout.yaml"), *overrides, "rollout.staleness=0",
                  "rollout.precision=fp32", "run.steps=2", f"run.run_dir={tmp_path}"])
    for r in metrics(tmp_path):
        assert abs(r["ratio_min"] - 1) < 1e-4 and abs(r["ratio_max"] - 1) < 1e-4
        assert r["clip_frac"] == 0.0 and r["policy_version_lag"] == 0
