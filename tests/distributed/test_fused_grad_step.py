"""loss.head=fused_grad through policy_step on every layout, against loss.head=logits on one process.

The reference is the logits head, single process, padded rows. Every launch runs the same cases
with the fused_grad head (gradient computed in the forward, losses/token_grad.py) and must give
the same loss, metrics and post-step parameters: padded and packed on one process, TP 2 with
sequence parallelism, PP 2, CP 2 (packed THD bins) and DP 2. One case (sequence TIS with pi_old
from the training forward) must fall back to the fused head, and head/fused_grad_fallback says so.
"""
import pytest

from megatron_cispo.testing import spawn
from test_packed_step import _assert_matches, worker

CASES = {
    # name: (loss overrides, StepConfig kwargs)
    # two optimizer steps: pi_old from a forward-only pass (plain fused logprobs under fused_grad)
    "cispo_old_two_steps_seq_mean_token_mean": (
        {"cispo": {"anchor": "old"}, "loss_agg": "seq_mean_token_mean"}, {"minibatch_size": 4}),
    "cispo_rollout_token_mean": ({"cispo": {"anchor": "rollout"}}, {}),
    # one optimizer step: pi_old is the training forward's own detached lp
    "ppo_kl_k3_entropy_seq_mean_token_sum": (
        {"policy_loss": "ppo", "kl": {"coef": 0.2, "estimator": "k3"}, "entropy_coef": 0.05,
         "loss_agg": "seq_mean_token_sum"}, {}),
    "ppo_two_steps_kl_k2_entropy": (
        {"policy_loss": "ppo", "kl": {"coef": 0.2, "estimator": "k2"}, "entropy_coef": -0.05},
        {"minibatch_size": 4}),
    # reads the current policy's sequence total: falls back to the fused head
    "fallback_sequence_tis_old_from_forward": (
        {"cispo": {"anchor": "old"}, "tis": {"level": "sequence", "cap": 1.5}}, {}),
}
FALLBACK = {"fallback_sequence_tis_old_from_forward"}
FUSED_GRAD = {name: ({**loss, "head": "fused_grad"}, step) for name, (loss, step) in CASES.items()}
KEY = "head/fused_grad_fallback"


def run(layout: dict, packed: bool, table):
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1) * layout.get("dp", 1)
    return spawn(worker, world, (layout, packed, tuple(table), False, table))


@pytest.fixture(scope="module")
def reference():
    return run({}, False, CASES)[0]


@pytest.mark.parametrize("layout, packed", [
    ({}, False), ({}, True), ({"tp": 2, "sp": True}, True), ({"pp": 2}, True), ({"cp": 2}, True),
    ({"dp": 2}, False),
], ids=["one_padded", "one_packed", "tp2_sp_packed", "pp2_packed", "cp2_packed", "dp2_padded"])
def test_fused_grad_step_matches_the_logits_head(reference, layout, packed):
    results = run(layout, packed, FUSED_GRAD)
    for res in results:
        for case, out in res.items():
            # 1 per microbatch that fell back, as a fraction of microbatches x DP x CP ranks
            assert out["metrics"].pop(KEY) == (1.0 if case in FALLBACK else 0.0), case
    _assert_matches(reference, results, CASES)
