"""policy_step's moe/ metrics (step.moe.RouterStats) against the routers' values by hand in one
process, and exact over DP, EP, TP, CP and PP (the model and runs: moe_helpers.py).

1. One process: moe/aux_loss, moe/z_loss, moe/expert_tokens_max / _min from the routers' captured
   inputs, for every run (packed, padded, packed windows, 8 layers interleaved, dense stages).
2. tp2-sp, cp2 and dp2-ep2 report the single-process metrics; at dp2-ep2 packed, rank 0 runs an
   all-padding filler bin and still trains like one process.
3. pp4 vp2 (interleaved schedule) with 8 MoE layers, and with layers 4 and 8 dense (PP rank 3
   holds no router), reproduce one process, moe/ metrics included.
"""
import pytest
import torch

from moe_helpers import TOL, layout_results
from moe_helpers import references as reference_runs


@pytest.fixture
def references():
    return reference_runs()  # spawned once per session, shared with test_moe_aux_loss.py

MOE_KEYS = ("moe/aux_loss", "moe/z_loss", "moe/expert_tokens_max", "moe/expert_tokens_min")


def test_router_metrics_are_the_routers_values_by_hand_in_one_process(references):
    for run, r in references.items():
        for key in MOE_KEYS:
            assert r["metrics"][key] == pytest.approx(r["by_hand"][key], rel=1e-5), f"{run} {key}"
        assert r["metrics"]["moe/expert_tokens_max"] > r["metrics"]["moe/expert_tokens_min"]


@pytest.mark.parametrize("name,run", [("tp2_sp", "compensated"), ("cp2", "compensated"), ("tp2_sp", "padded"),
                                      ("dp2_ep2", "padded")])
def test_router_metrics_are_exact_over_dp_ep_tp_and_cp(references, name, run):
    for rank, r in enumerate(layout_results(name)):
        for key in MOE_KEYS:
            assert r[run]["metrics"][key] == pytest.approx(references[run]["metrics"][key], rel=TOL), \
                f"{name} rank {rank} {key}"
    if name == "dp2_ep2":  # the two ranks routed different rows: the DP reduction is not a copy
        mine = [r[run]["by_hand"]["moe/expert_tokens_max"] for r in layout_results(name)]
        assert max(mine) < references[run]["metrics"]["moe/expert_tokens_max"]


def test_an_all_padding_bin_at_dp2_ep2_trains_like_one_process(references):
    """Packed at dp=2, rank 0 runs an empty filler bin; megatron-core's Switch loss over no token is
    0/0, and its NaN gradient used to skip every such step (step/moe.py turns the aux loss off for
    that forward: the bin has no token, so it adds nothing)."""
    ref = references["packed_windows"]
    assert ref["metrics"]["step/optimizer_steps"] == 1.0 and ref["metrics"]["step/microbatches"] == 5
    for rank, r in enumerate(layout_results("dp2_ep2")):
        m = r["packed_windows"]["metrics"]
        assert m["step/skipped_nonfinite"] == 0.0 and m["step/optimizer_steps"] == 1.0, f"rank {rank}: {m}"
        assert m["step/microbatches"] == 3  # 2 or 3 real bins, evened over DP
        for key, value in ref["metrics"].items():
            if key not in ("step/forward_calls", "step/microbatches"):
                assert m[key] == pytest.approx(value, rel=TOL, abs=TOL), f"rank {rank} {key}"
        state = r["packed_windows"]["state"]
        for k, v in ref["state"].items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=TOL, msg=k)


@pytest.mark.parametrize("run", ["interleaved", "dense_stage"])
def test_pp4_vp2_trains_and_reports_router_metrics_like_one_process(references, run):
    """The interleaved schedule calls forward_step once per chunk and microbatch: moe/aux_loss and
    moe/z_loss are still means over microbatches (they came out 1/vp too small). dense_stage: PP
    rank 3 holds only dense layers, no router, and must still join the reductions (it hung)."""
    ref = references[run]
    results = layout_results("pp4_vp2")
    if run == "dense_stage":
        assert [bool(r[run]["valid"]) for r in results] == [True, True, True, False]  # rank 3: no router
    for rank, r in enumerate(results):
        m = r[run]["metrics"]
        assert set(m) == set(ref["metrics"]) and set(MOE_KEYS) <= set(m), f"rank {rank}"
        for key, value in ref["metrics"].items():
            if key not in ("step/forward_calls", "step/microbatches"):
                assert m[key] == pytest.approx(value, rel=TOL, abs=TOL), f"{run} rank {rank} {key}"
    state = results[0][run]["state"]
    assert set(state) == set(ref["state"])
    for k, v in ref["state"].items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=TOL, msg=f"{run} {k}")


