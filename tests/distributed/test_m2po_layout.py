"""M2PO's global selection through the real policy step: every layout masks the same global tokens
and gives the single-process update.

The batch's log rho values lie on a grid of 1/8, so (log rho)^2 ties exactly, and tau is chosen
so that the cut falls inside a group of tied tokens held by both DP ranks (under one minibatch
and under two): only the (global sequence, position) tie-break decides which of them go. A
"pass" case takes pi_old from the forward-only pass that M2PO forces at one optimizer step; a
"strided" case deals rows round-robin over DP and names them with policy_step(row_ids=...).
The reference also checks, by a plain run that leaves the masked tokens out of the loss mask,
that masked tokens get no gradient and stay in the denominator.
"""
import math
import sys

import pytest
import torch

from megatron_cispo.testing import spawn

N, S, V = 8, 15, 32
BUDGET = 24
LENGTHS = [16, 9, 12, 14, 11, 16, 10, 13]
PROMPT = [2, 1, 3, 2, 1, 4, 2, 3]
CASES = {  # name: (StepConfig kwargs, pi_old given, rows of DP rank r: dp_shard, or r::dp with explicit row_ids)
    "given_one_step": ({}, True, "dp_shard"),
    "given_two_minibatches": ({"minibatch_size": 4}, True, "dp_shard"),
    "given_strided_rows": ({}, True, "strided"),
    "pass_one_step": ({}, False, "dp_shard"),
}
PASS_TAU = 0.08


def make_batch():
    """tokens, lengths, loss_mask, advantages, old [N, S] and log rho [N, S] on a grid of 1/8."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor(LENGTHS)
    pos = torch.arange(S)[None]
    loss_mask = (pos >= torch.tensor(PROMPT)[:, None]) & (pos < lengths[:, None] - 1)
    tokens = torch.randint(0, V, (N, S + 1), generator=g)
    old = -3.5 + torch.randint(-4, 5, (N, S), generator=g) / 8
    small = torch.randint(-2, 3, (N, S), generator=g) / 8
    big = torch.randint(4, 9, (N, S), generator=g) / 8 * (torch.randint(0, 2, (N, S), generator=g) * 2 - 1)
    log_rho = torch.where(torch.rand(N, S, generator=g) < 0.2, big, small)
    return tokens, lengths, loss_mask, torch.randn(N, generator=g), old, log_rho


def jitter():
    """[N, S] continuous offsets for the pass case: no ties, so a layout's rounding of pi_old
    (about 1e-7) cannot reorder two tokens."""
    return torch.rand(N, S, generator=torch.Generator().manual_seed(5)) / 16


def _order(log_rho, loss_mask):
    """Valid tokens as (m2, row, position), in the selection's total order."""
    cells = [(float(log_rho[i, t]) ** 2, i, t) for i, t in loss_mask.nonzero().tolist()]
    return sorted(cells, key=lambda c: (-c[0], c[1], c[2]))


def choose_tau(log_rho, loss_mask):
    """(tau, k): the first k tokens of the total order go, and the cut falls inside a tie group after
    tied tokens of rows 0-2 and before tied tokens of rows 4-7, so numbering the rows in any other
    order (e.g. interleaved over DP ranks, or ignoring the minibatches) masks other tokens."""
    cells = _order(log_rho, loss_mask)
    for k in range(1, len(cells)):
        v = cells[k][0]
        masked = {c[1] for c in cells[:k] if c[0] == v}
        kept = {c[1] for c in cells[k:] if c[0] == v}
        rest, before = [c[0] for c in cells[k:]], [c[0] for c in cells[k - 1:]]
        tau = math.fsum(rest) / len(rest)
        if cells[k - 1][0] == v and 2 in masked and {4, 5, 6, 7} <= kept and math.fsum(before) / len(before) > tau:
            return tau, k
    raise AssertionError("the batch has no suitable tie group; change the seed")


def worker(layout: dict, packed: bool, plain_masked: bool = False):
    from megatron.core import parallel_state as mpu

    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.base.weights import gather_full_state
    from megatron_cispo.step import Rollouts, StepConfig, compute_logprobs, policy_step

    tp, pp, cp = (layout.get(k, 1) for k in ("tp", "pp", "cp"))
    distributed.init_distributed(tp=tp, pp=pp, cp=cp)
    mcfg = ModelConfig(vocab_size=V, seq_length=S + 1, hidden_size=32, num_layers=2, num_attention_heads=4)
    tokens, lengths, loss_mask, adv, old, log_rho = make_batch()
    tau, _ = choose_tau(log_rho, loss_mask)
    dp_rank, dp = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    ps = sys.modules["megatron_cispo.step.policy_step"]
    real, captured = ps.step_selection, []
    ps.step_selection = lambda *a, **kw: captured.append(real(*a, **kw)) or captured[-1]
    out = {}
    for name, (step_kw, given, sharding) in CASES.items():
        step_cfg = StepConfig(micro_batch_size=2, max_tokens_per_microbatch=BUDGET if packed else None, **step_kw)
        chunks = build_model(mcfg, tp=tp, pp=pp, cp=cp, sequence_parallel=layout.get("sp", False), seed=3)
        opt = build_optimizer(chunks, lr=0.1, optimizer="sgd", clip_grad=1e6)  # computes the norm, never clips
        full = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=adv, lengths=lengths,
                        old_logprobs=old, rollout_logprobs=old - log_rho)
        minibatches = N // step_kw.get("minibatch_size", N)
        shard = full.dp_shard(dp_rank=dp_rank, dp=dp, minibatches=minibatches)
        ids = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=torch.arange(N).float()).dp_shard(
            dp_rank=dp_rank, dp=dp, minibatches=minibatches).advantages.long()
        if sharding == "strided":  # a loader that deals rows round-robin: policy_step must be told
            ids = torch.arange(dp_rank, N, dp)
            shard = Rollouts(**full.select(ids))
        batch = shard
        if not given:  # pi_old from the pass; the sampler's logprobs are log rho + jitter away from it
            now = compute_logprobs(chunks, shard, step_cfg)
            offset = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=adv, rollout_logprobs=log_rho + jitter())
            offset = offset.dp_shard(dp_rank=dp_rank, dp=dp, minibatches=minibatches).rollout_logprobs
            batch = Rollouts(tokens=shard.tokens, loss_mask=shard.loss_mask, advantages=shard.advantages,
                             lengths=shard.lengths, rollout_logprobs=now - offset)
        captured.clear()
        loss_cfg = from_dict(LossConfig, {"cispo": {"anchor": "old"},
                                          "correction": {"m2po": tau if given else PASS_TAU}})
        metrics = policy_step(chunks, opt, batch, loss_cfg, step_cfg,
                              row_ids=ids if sharding == "strided" else None)
        (keep, _), = captured
        out[name] = {"metrics": metrics, "state": gather_full_state(chunks),
                     "keep": {int(i): keep[r].tolist() for r, i in enumerate(ids)}}
        if plain_masked and name == "given_one_step":  # the same step with the masked tokens untrained
            chunks = build_model(mcfg, tp=tp, pp=pp, cp=cp, seed=3)
            opt = build_optimizer(chunks, lr=0.1, optimizer="sgd", clip_grad=1e6)
            plain = Rollouts(tokens=shard.tokens, loss_mask=shard.loss_mask & keep, advantages=shard.advantages,
                             lengths=shard.lengths, old_logprobs=shard.old_logprobs,
                             rollout_logprobs=shard.rollout_logprobs)
            policy_step(chunks, opt, plain, from_dict(LossConfig, {"cispo": {"anchor": "old"}}), step_cfg)
            out["plain_masked"] = {"state": gather_full_state(chunks)}
    out["initial"] = gather_full_state(build_model(mcfg, tp=tp, pp=pp, cp=cp, seed=3))
    return out


@pytest.fixture(scope="module")
def reference():
    return spawn(worker, 1, ({}, False, True))[0]


def _global_keep(results, case):
    rows = {}
    for res in results:
        rows.update(res[case]["keep"])
    return torch.tensor([rows[i] for i in range(N)])


def test_the_cut_splits_a_tie_group_held_by_both_dp_ranks(reference):
    _, _, loss_mask, _, _, log_rho = make_batch()
    tau, k = choose_tau(log_rho, loss_mask)
    cells = _order(log_rho, loss_mask)
    for case in ("given_one_step", "given_two_minibatches"):
        keep = _global_keep([reference], case)
        masked = [(i, t) for _, i, t in cells if not keep[i, t]]
        assert masked == [(i, t) for _, i, t in cells[:k]]  # the first k of the total order, ties by (row, pos)
        tied = [(i, t) for v, i, t in cells if v == cells[k][0]]
        assert any(not keep[i, t] for i, t in tied) and any(keep[i, t] for i, t in tied)
    for case in CASES:
        frac = reference[case]["metrics"]["correction/m2po_masked_frac"]
        assert 0 < frac < 1, case
        keep = _global_keep([reference], case)
        assert frac == pytest.approx(float((~keep & loss_mask).sum() / loss_mask.sum()))  # the loss's own count
        m = reference[case]["metrics"]
        assert m["correction/m2po_m2_after"] <= (tau if case.startswith("given") else PASS_TAU) \
            < m["correction/m2po_m2_before"]
    assert reference["pass_one_step"]["metrics"]["step/old_logprob_pass"] == 1.0


def test_masked_tokens_get_no_gradient_and_stay_in_the_denominator(reference):
    # token_mean and one SGD step: the update is linear in the loss, so leaving the masked tokens out
    # of the loss mask (denominator n_kept) moves the weights n_valid / n_kept times as far
    _, _, loss_mask, _, _, _ = make_batch()
    keep = _global_keep([reference], "given_one_step")
    ratio = float((loss_mask & keep).sum() / loss_mask.sum())
    init, m2po, plain = reference["initial"], reference["given_one_step"]["state"], reference["plain_masked"]["state"]
    moved = 0.0
    for name in init:
        torch.testing.assert_close(m2po[name] - init[name], (plain[name] - init[name]) * ratio, rtol=1e-4, atol=1e-7)
        moved = max(moved, float((m2po[name] - init[name]).abs().max()))
    assert moved > 1e-4


@pytest.mark.parametrize("layout,packed", [({"dp": 2}, False), ({"tp": 2, "sp": True}, True), ({"pp": 2}, False),
                                           ({"cp": 2}, True)], ids=["dp2", "tp2_sp_packed", "pp2", "cp2_packed"])
def test_every_layout_masks_the_same_tokens_and_gives_the_same_update(reference, layout, packed):
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1) * layout.get("dp", 1)
    results = spawn(worker, world, (layout, packed))
    for case in CASES:
        assert torch.equal(_global_keep(results, case), _global_keep([reference], case)), case
        for rank, res in enumerate(results):
            for key, value in reference[case]["metrics"].items():
                if key not in ("step/forward_calls", "step/microbatches"):
                    assert res[case]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-5), f"{case} {rank} {key}"
        for pname, value in reference[case]["state"].items():
            torch.testing.assert_close(results[0][case]["state"][pname], value, rtol=0, atol=1e-5,
                                       msg=f"{case} {pname}")
