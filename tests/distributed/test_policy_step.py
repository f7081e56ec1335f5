"""policy_step through megatron-core's real schedules: every layout gives the single-process update.

One launch per layout runs every case (anchors x aggregation x minibatching) and returns the
metrics and the gathered post-step parameters; (1,1,1) is the reference.
"""
import pytest
import torch

from groups_helpers import own_groups, watch_parallel_state
from megatron_cispo.testing import spawn

LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)]
N, S, V = 8, 11, 64
CASES = {
    # name: (loss overrides, StepConfig kwargs)
    "old_one_step_token_mean": ({"cispo": {"anchor": "old"}}, {}),
    "rollout_one_step_seq_mean_token_mean": (
        {"cispo": {"anchor": "rollout"}, "loss_agg": "seq_mean_token_mean"}, {}),
    "old_two_steps_seq_mean_token_sum": (
        {"cispo": {"anchor": "old"}, "loss_agg": "seq_mean_token_sum"}, {"minibatch_size": 4}),
    "rollout_two_steps_token_mean": ({"cispo": {"anchor": "rollout"}}, {"minibatch_size": 4}),
    # KL against a reference model scored inside policy_step by a forward-only pass
    "rollout_kl_ref_model": ({"cispo": {"anchor": "rollout"}, "kl": {"coef": 0.5, "estimator": "k3"}}, {}),
}


def make_batch():
    """The same global batch in every layout."""
    g = torch.Generator().manual_seed(42)
    tokens = torch.randint(0, V, (N, S + 1), generator=g)
    prompt = torch.randint(2, 6, (N, 1), generator=g)
    length = torch.randint(3, S - 4, (N, 1), generator=g)
    pos = torch.arange(S)[None]
    loss_mask = (pos >= prompt) & (pos < prompt + length)
    advantages = torch.randn(N, generator=g)
    noise = torch.randn(N, S, generator=g)
    return tokens, loss_mask, advantages, noise


def policy_step_worker(tp, pp, vp=None, layers=4, cases=tuple(CASES), micro=2, hand_in=False):
    from megatron.core import parallel_state as mpu

    from megatron_cispo.runner import distributed
    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.base.weights import gather_full_state
    from megatron_cispo.step import Rollouts, StepConfig, compute_logprobs, policy_step

    distributed.init_distributed(tp=tp, pp=pp, vp=vp)
    mcfg = ModelConfig(vocab_size=V, seq_length=S, hidden_size=32, num_layers=layers, num_attention_heads=4)
    tokens, loss_mask, adv, noise = make_batch()
    dp_rank, dp = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    out = {}
    runs = [(name, name, None) for name in cases]
    if hand_in:  # one case again, every group handed in (step/groups.py)
        runs.append(("own_groups", "rollout_two_steps_token_mean", own_groups()))
    for key, name, pg in runs:
        loss_over, step_kw = CASES[name]
        chunks = build_model(mcfg, tp=tp, pp=pp, vp=vp, seed=3)
        opt = build_optimizer(chunks, lr=0.1, optimizer="sgd", clip_grad=1.0)
        ref = build_model(mcfg, tp=tp, pp=pp, vp=vp, seed=5, wrap_ddp=False) if "ref" in name else None
        seen: list = []  # from here to policy_step's end, with groups handed in: no global read of ours
        undo = watch_parallel_state(seen) if pg is not None else (lambda: None)
        full = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=adv, rollout_logprobs=noise)
        shard = full.dp_shard(dp_rank=dp_rank, dp=dp, minibatches=N // step_kw.get("minibatch_size", N))
        current = compute_logprobs(chunks, shard, StepConfig(micro_batch_size=micro), pg_collection=pg)
        stale = current + shard.rollout_logprobs  # a sampler some versions behind: log-ratios ~ 1
        if dp_rank == 0:
            stale[0, int(shard.loss_mask[0].nonzero()[0])] = float("-inf")  # samplers do return -inf; the token must be dropped, not NaN
        batch = Rollouts(tokens=shard.tokens, loss_mask=shard.loss_mask, advantages=shard.advantages,
                         rollout_logprobs=stale)
        counted = []
        hook = chunks[0].module.register_forward_pre_hook(lambda *a: counted.append(1))
        metrics = policy_step(chunks, opt, batch, from_dict(LossConfig, loss_over),
                              StepConfig(micro_batch_size=micro, **step_kw), ref_chunks=ref, pg_collection=pg)
        if pg is not None:  # the watch sees the one fallback there is
            from megatron_cispo.step.groups import default_groups

            default_groups()
        undo()
        hook.remove()
        out[key] = {"metrics": metrics, "state": gather_full_state(chunks), "hooked_forwards": len(counted),
                    "globals_read": seen}
    return out


@pytest.fixture(scope="module")
def reference():
    return spawn(policy_step_worker, 1, (1, 1))[0]


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_layout_matches_single_process(reference, tp, pp, dp):
    own = (tp, pp, dp) == (2, 2, 2)  # and, in the layout with every group > 1, the groups handed in
    results = spawn(policy_step_worker, tp * pp * dp, (tp, pp, None, 4, tuple(CASES), 2, own))
    _assert_matches(reference, results)
    if own:
        for res in results:  # the same step, bit for bit, on groups that are not parallel_state's
            assert res["own_groups"]["metrics"] == res["rollout_two_steps_token_mean"]["metrics"]
            # and megatron_cispo read none of megatron's globals in compute_logprobs and policy_step:
            # the one read is default_groups', called after them to show that the watch sees reads
            assert res["own_groups"]["globals_read"] == ["megatron_cispo.step.groups: model_parallel_is_initialized"]
        for pname, value in results[0]["rollout_two_steps_token_mean"]["state"].items():
            assert torch.equal(results[0]["own_groups"]["state"][pname], value), pname


def test_interleaved_virtual_pipeline_matches_single_process():
    """pp=4 x vp=2 (8 layers, one per virtual stage) through the interleaved 1F1B schedule,
    which needs at least pp microbatches per step (micro_batch_size=1)."""
    cases = ("rollout_two_steps_token_mean", "old_two_steps_seq_mean_token_sum")
    ref = spawn(policy_step_worker, 1, (1, 1, None, 8, cases, 1))[0]
    _assert_matches(ref, spawn(policy_step_worker, 4, (1, 4, 2, 8, cases, 1)))


def _assert_matches(reference, results):
    for case, ref in reference.items():
        for rank, res in enumerate(results):
            got = res[case]["metrics"]
            per_rank = {"step/forward_calls", "step/microbatches"}  # model forwards and microbatches of this rank
            assert set(got) == set(ref["metrics"]), case
            for key, value in ref["metrics"].items():
                if key not in per_rank:
                    assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), f"{case} rank {rank} {key}"
        state = results[0][case]["state"]
        for pname, value in ref["state"].items():
            torch.testing.assert_close(state[pname], value, rtol=0, atol=1e-5, msg=f"{case} {pname}")


def test_update_moves_weights_and_drops_nonfinite(reference):
    before = spawn(_initial_state_worker, 1)[0]
    for case, ref in reference.items():
        moved = max((ref["state"][k] - v).abs().max().item() for k, v in before.items())
        assert moved > 1e-4, case
        assert ref["metrics"]["policy/nonfinite_dropped"] == (1.0 if "rollout" in case else 0.0), case
        assert all(v == v for v in ref["metrics"].values()), f"NaN metric in {case}"
        assert not [k for k in ref["metrics"] if k.startswith("moe/")], case  # a dense model routes nothing


def _initial_state_worker():
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model
    from megatron_cispo.base.weights import gather_full_state

    distributed.init_distributed()
    mcfg = ModelConfig(vocab_size=V, seq_length=S, hidden_size=32, num_layers=4, num_attention_heads=4)
    return gather_full_state(build_model(mcfg, tp=1, pp=1, seed=3))


def test_old_anchor_is_inert_at_one_step_and_rollout_anchor_clips(reference):
    old = reference["old_one_step_token_mean"]["metrics"]
    assert old["cispo/ratio_min"] == 1.0 and old["cispo/ratio_max"] == 1.0
    assert old["cispo/clip_frac_low"] == 0.0 and old["cispo/clip_frac_high"] == 0.0
    roll = reference["rollout_one_step_seq_mean_token_mean"]["metrics"]
    assert roll["cispo/clip_frac_high"] > 0.0
    assert roll["cispo/ratio_max"] > 5.0


def test_forward_passes_follow_the_anchor(reference):
    """4 microbatches per pass: the pi_old pass runs only where it can matter."""
    expect = {  # (old-logprob pass ran, model forwards)
        "old_one_step_token_mean": (0.0, 4),  # pi_old taken from the training forward
        "rollout_one_step_seq_mean_token_mean": (0.0, 4),  # anchor rollout: pi_old unused
        "old_two_steps_seq_mean_token_sum": (1.0, 8),  # two steps: a real pi_old pass is needed
        "rollout_two_steps_token_mean": (0.0, 4),
    }
    for case, (ran, forwards) in expect.items():
        m = reference[case]["metrics"]
        assert m["step/old_logprob_pass"] == ran, case
        assert m["step/forward_calls"] == forwards, case
        assert reference[case]["hooked_forwards"] == forwards, case
    # the reference model's pass adds 4 forwards of the reference model, none of the policy
    ref_case = reference["rollout_kl_ref_model"]
    assert ref_case["metrics"]["step/forward_calls"] == 8 and ref_case["hooked_forwards"] == 4
    assert ref_case["metrics"]["step/old_logprob_pass"] == 0.0
    assert ref_case["metrics"]["policy/kl"] > 0.0  # a different model: the KL term is really there


def missing_rollout_worker():
    from megatron_cispo.runner import distributed
    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.step import Rollouts, StepConfig, policy_step

    distributed.init_distributed(pp=2, timeout_s=120)
    mcfg = ModelConfig(vocab_size=V, seq_length=S, hidden_size=32, num_layers=2, num_attention_heads=4)
    chunks = build_model(mcfg, tp=1, pp=2, seed=3)
    tokens, loss_mask, adv, _ = make_batch()
    policy_step(chunks, build_optimizer(chunks, lr=0.1), Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=adv),
                from_dict(LossConfig, {"cispo": {"anchor": "rollout"}}), StepConfig(micro_batch_size=2))


def test_missing_rollout_logprobs_fail_on_every_stage_before_the_schedule():
    """Raised inside the last stage's loss, the first stage would wait in p2p until the timeout."""
    import time

    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"rollouts.rollout_logprobs is missing: cispo with anchor='rollout' "
                                        r"needs rollout_logprobs"):
        spawn(missing_rollout_worker, 2, timeout_s=100)
    assert time.monotonic() - t0 < 60
