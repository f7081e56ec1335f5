"""The demo with Geo-RS + MIS turned on by YAML overrides, as README.md shows: under the demo's
staleness both corrections drop something, the run completes, and the drops are logged."""
from e2e_helpers import DEMO, TINY, metrics, ranks

CORRECTIONS = ["loss.cispo.anchor=rollout", "loss.correction.geo_rs=[0.8,1.25]", "loss.correction.mis=[0.5,2.0]"]


def test_geo_rs_and_mis_drop_stale_tokens_and_the_demo_completes(tmp_path):
    # A higher learning rate than TINY's demo default makes the 2-version-stale sampler drift.
    proc = ranks(2, [DEMO, *TINY, *CORRECTIONS, "parallelism.tp=1", "run.steps=8", "optimizer.lr=0.01",
                     f"run.run_dir={tmp_path}"])
    assert "done in" in proc.stdout
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert max(r["correction/geo_rs_dropped_frac"] for r in records) > 0
    assert max(r["correction/mis_masked_frac"] for r in records) > 0
    assert all(r["correction/dropped_token_frac"] < 1 for r in records)  # every step still trains on something
