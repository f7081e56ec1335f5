"""Off-policy corrections (MIS, Geo-RS, OPSM) through policy_step on every layout.

The reference is the single-process padded run. Every other launch splits the same global batch
over TP with sequence parallelism, PP, DP or CP (packed THD bins, or padded rows under PP) and
must give the same metrics (dropped fractions included: the sequence means are segment sums
reduced over CP) and the same post-step parameters. The bands are chosen so that every
correction drops some, but not all, tokens and sequences in the reference.
"""
import pytest
import torch

from megatron_cispo.testing import spawn
from test_packed_step import _assert_matches, worker

N, S, V = 8, 15, 32
LENGTHS = [16, 5, 9, 12, 3, 14, 7, 11]  # real tokens per row, odd on purpose (CP / SP padding)
CASES = {
    # name: (loss overrides, StepConfig kwargs)
    # one optimizer step: pi_old comes from the training forward itself
    "old_one_step_mis_geo_rs_opsm_tis": (
        {"cispo": {"anchor": "old"}, "tis": {"level": "token", "cap": 2.0},
         "correction": {"mis": [0.7, 1.4], "geo_rs": [0.9, 1.1], "opsm": 0.05}}, {}),
    # two optimizer steps: the second minibatch's r and OPSM's pi_theta come from updated weights
    "rollout_two_steps_seq_mean_mis_geo_rs_opsm": (
        {"cispo": {"anchor": "rollout"}, "loss_agg": "seq_mean_token_mean",
         "correction": {"mis": [0.7, 1.4], "geo_rs": [0.9, 1.1], "opsm": 0.05}}, {"minibatch_size": 4}),
}
DROPS = ("correction/mis_masked_frac", "correction/geo_rs_dropped_frac", "correction/geo_rs_dropped_token_frac",
         "correction/opsm_dropped_frac", "correction/opsm_dropped_token_frac", "correction/dropped_token_frac")


def make_batch():
    """The same global batch in every layout: right-padded rows, the loss mask on the response, and
    a sampler that is off in both directions (so OPSM and both sides of each band can trigger)."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor(LENGTHS)
    tokens = torch.randint(0, V, (N, S + 1), generator=g)
    pos = torch.arange(S)[None]
    prompt = torch.tensor([[2], [1], [3], [2], [1], [4], [2], [3]])
    loss_mask = (pos >= prompt) & (pos < lengths[:, None] - 1)
    return tokens, lengths, loss_mask, torch.randn(N, generator=g), 0.25 * torch.randn(N, S, generator=g)


def run(layout: dict, packed: bool):
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1) * layout.get("dp", 1)
    return spawn(worker, world, (layout, packed, tuple(CASES), False, CASES, make_batch))


@pytest.fixture(scope="module")
def reference():
    ref = run({}, False)[0]
    for case, res in ref.items():
        m = res["metrics"]
        for key in DROPS:  # otherwise the comparison below proves nothing
            assert 0.0 < m[key] < 1.0, f"{case}: {key}={m[key]}"
        assert m["correction/mis_ratio_min"] < 0.7 and m["correction/mis_ratio_max"] > 1.4, case
        if "old" in case:  # rho exists only with pi_old: both signs of the per-sequence mismatch occur
            assert m["mismatch/seq_log_rho_min"] < 0 < m["mismatch/seq_log_rho_max"], case
    return ref


@pytest.mark.parametrize("layout, packed", [
    ({"tp": 2, "sp": True}, True), ({"pp": 2}, False), ({"dp": 2}, True), ({"cp": 2}, True),
], ids=["tp2_sp_packed", "pp2_padded", "dp2_packed", "cp2_packed"])
def test_corrections_on_every_layout_match_the_single_process_padded_step(reference, layout, packed):
    _assert_matches(reference, run(layout, packed), CASES)
