"""Variable-length rollouts packed into THD bins, on every layout, against one process padding them.

The reference is the single-process padded run (micro_batch_size rows, no packing). Every other
run packs the same global batch under a token budget and splits it over TP with sequence
parallelism, CP, PP, DP or CP x DP; MoE models run with expert parallelism and with TP + SP.
Each launch runs every case and returns the metrics and the gathered post-step parameters.
Lengths are odd on purpose, so that packing pads them to the CP / SP multiple. A fused-head case
(loss.head=fused) is compared against the logits head's single-process result.
"""
import pytest
import torch

from megatron_cispo.testing import spawn

N, S, V = 8, 15, 32
BUDGET = 24
LENGTHS = [16, 5, 9, 12, 3, 14, 7, 11]  # real tokens per row (prompt + response), 2..S+1
CASES = {
    # name: (loss overrides, StepConfig kwargs)
    "rollout_token_mean": ({"cispo": {"anchor": "rollout"}}, {}),
    "old_two_steps_seq_mean_token_mean": (
        {"cispo": {"anchor": "old"}, "loss_agg": "seq_mean_token_mean"}, {"minibatch_size": 4}),
    "rollout_seq_mean_token_sum": ({"cispo": {"anchor": "rollout"}, "loss_agg": "seq_mean_token_sum"}, {}),
    "old_seq_tis_seq_mean_token_sum_norm": (
        {"cispo": {"anchor": "old"}, "loss_agg": "seq_mean_token_sum_norm", "max_len": 12,
         "tis": {"level": "sequence", "cap": 1.5}}, {}),
}
# The fused head (output layer + logprobs chunk by chunk) must give the logits head's update.
CASES["rollout_token_mean_fused_head"] = ({"cispo": {"anchor": "rollout"}, "head": "fused"}, {})
SAME_AS = {"rollout_token_mean_fused_head": "rollout_token_mean"}
MOE_CASES = ("rollout_token_mean", "old_two_steps_seq_mean_token_mean")


def make_batch():
    """The same global batch in every layout: right-padded rows with a loss mask on the response."""
    g = torch.Generator().manual_seed(7)
    lengths = torch.tensor(LENGTHS)
    tokens = torch.randint(0, V, (N, S + 1), generator=g)
    pos = torch.arange(S)[None]
    prompt = torch.tensor([[2], [1], [3], [2], [1], [4], [2], [3]])
    loss_mask = (pos >= prompt) & (pos < lengths[:, None] - 1)
    return tokens, lengths, loss_mask, torch.randn(N, generator=g), -0.3 * torch.rand(N, S, generator=g)


def worker(layout: dict, packed: bool, cases=tuple(CASES), moe: bool = False, table=None, batch_fn=None):
    """Run each case of `table` (default CASES; name -> (loss overrides, StepConfig kwargs)) on the
    global batch `batch_fn()` (default make_batch) and return each case's metrics and parameters."""
    from megatron.core import parallel_state as mpu

    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.base.weights import gather_full_state
    from megatron_cispo.step import Rollouts, StepConfig, compute_logprobs, policy_step

    tp, pp, cp, ep = (layout.get(k, 1) for k in ("tp", "pp", "cp", "ep"))
    sp = layout.get("sp", False)
    distributed.init_distributed(tp=tp, pp=pp, cp=cp, ep=ep)
    moe_kw = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.0) if moe else {}
    mcfg = ModelConfig(vocab_size=V, seq_length=S + 1, hidden_size=32, num_layers=2, num_attention_heads=4,
                       **moe_kw)
    tokens, lengths, loss_mask, adv, noise = (batch_fn or make_batch)()
    dp_rank, dp = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    out = {}
    for name in cases:
        loss_over, step_kw = (table or CASES)[name]
        step_cfg = StepConfig(micro_batch_size=2, max_tokens_per_microbatch=BUDGET if packed else None, **step_kw)
        chunks = build_model(mcfg, tp=tp, pp=pp, cp=cp, ep=ep, sequence_parallel=sp, seed=3)
        opt = build_optimizer(chunks, lr=0.1, optimizer="sgd", clip_grad=1e6)  # computes the norm, never clips
        full = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=adv, lengths=lengths,
                        rollout_logprobs=noise * loss_mask)
        shard = full.dp_shard(dp_rank=dp_rank, dp=dp, minibatches=N // step_kw.get("minibatch_size", N))
        # a sampler a little behind the trainer: the rollout anchor sees ratios around 1
        stale = compute_logprobs(chunks, shard, step_cfg) + shard.rollout_logprobs
        # a case with a KL penalty gets a reference a little further from the trainer than the sampler
        ref = stale - 0.5 * shard.rollout_logprobs if "kl" in loss_over else None
        batch = Rollouts(tokens=shard.tokens, loss_mask=shard.loss_mask, advantages=shard.advantages,
                         lengths=shard.lengths, rollout_logprobs=stale, ref_logprobs=ref)
        metrics = policy_step(chunks, opt, batch, from_dict(LossConfig, loss_over), step_cfg)
        out[name] = {"metrics": metrics, "state": gather_full_state(chunks)}
    return out


def _assert_matches(reference, results, cases, atol=1e-5):
    per_rank = {"step/forward_calls", "step/microbatches"}
    for case in cases:
        ref = reference[SAME_AS.get(case, case)]
        for rank, res in enumerate(results):
            got = res[case]["metrics"]
            assert set(got) == set(ref["metrics"]), case
            for key, value in ref["metrics"].items():
                if key not in per_rank:
                    assert got[key] == pytest.approx(value, rel=atol, abs=atol), f"{case} rank {rank} {key}"
        state = results[0][case]["state"]
        assert set(state) == set(ref["state"])
        for pname, value in ref["state"].items():
            torch.testing.assert_close(state[pname], value, rtol=0, atol=atol, msg=f"{case} {pname}")


@pytest.fixture(scope="module")
def reference():
    return spawn(worker, 1, ({}, False, tuple(c for c in CASES if c not in SAME_AS)))[0]


@pytest.fixture(scope="module")
def moe_reference():
    return spawn(worker, 1, ({}, False, MOE_CASES, True))[0]


def test_packed_matches_padded_on_one_process(reference):
    _assert_matches(reference, spawn(worker, 1, ({}, True)), CASES)


@pytest.mark.parametrize("layout", [
    {"tp": 2, "sp": True}, {"cp": 2}, {"pp": 2}, {"dp": 2}, {"cp": 2, "dp": 2},
], ids=["tp2_sp", "cp2", "pp2", "dp2", "cp2_dp2"])
def test_packed_layout_matches_single_process_padded(reference, layout):
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1) * layout.get("dp", 1)
    _assert_matches(reference, spawn(worker, world, (layout, True)), CASES)


@pytest.mark.parametrize("layout", [{"ep": 2, "dp": 2}, {"tp": 2, "sp": True}, {"pp": 2}],
                         ids=["moe_ep2", "moe_tp2_sp", "moe_pp2"])
def test_packed_moe_layout_matches_single_process_padded(moe_reference, layout):
    """Metrics include moe/expert_tokens_max and _min (one MoE layer per stage under pp2)."""
    world = layout.get("tp", 1) * layout.get("dp", 1) * layout.get("pp", 1)
    assert {"moe/expert_tokens_max", "moe/expert_tokens_min"} <= set(moe_reference[MOE_CASES[0]]["metrics"])
    _assert_matches(moe_reference, spawn(worker, world, (layout, True, MOE_CASES, True)), MOE_CASES)
