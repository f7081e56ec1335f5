"""Sampling-mask replay over gloo: token_logprobs(keep=) and fused_token_logprobs(keep=) at TP=2
over an uneven vocabulary shard, against the fp64 masked log_softmax of one process (values and
gradients), with the collectives of the op without keep; and policy_step carrying the kept sets
through the pi_old pass, the reference pass and the training forward on TP x SP, CP and DP,
against the single-process padded run.
"""
import pytest
import torch

from megatron_cispo.testing import spawn

# ---------------------------------------------------------------- the ops at TP = 2

S, B, H = 8, 2, 16
VOCAB, PADDED = 83, 96  # rank 1 of 2 holds 35 real columns and 13 of padding
T = 0.8


def _op_data():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    weight = torch.randn(PADDED, H, generator=g, dtype=torch.float64) * 3 / H ** 0.5
    weight[VOCAB:] = 5.0  # junk padding rows: they would dominate if they counted
    t = torch.randint(0, VOCAB, (S, B), generator=g)
    keep = (torch.rand(S, B, VOCAB, generator=g) < 0.15)
    keep.view(-1, VOCAB)[torch.arange(S * B), t.reshape(-1)] = True
    keep[2, 0] = False  # not replayed: the full vocabulary
    keep[3, 1, :] = False
    keep[3, 1, t[3, 1]] = True
    keep[4, 0, 60:] = True  # a set spanning both shards
    keep[5, 1, :41] = False  # a set entirely in rank 1's shard
    keep[5, 1, 41:] = True
    t[5, 1] = 70
    mask = torch.ones(S, B, dtype=torch.bool)
    mask[6, 0] = False
    w_lp = torch.linspace(-1, 1, S * B, dtype=torch.float64).view(S, B)
    w_lp[1, 1] = 0.0  # a row with no upstream logprob gradient
    return hidden, weight, t, keep, mask, w_lp


def _reference(hidden, weight, t, keep, mask, w_lp, entropy):
    """fp64, one process, the true vocabulary: masked log_softmax of (hidden @ weight.T) / T."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    z = (h @ w[:VOCAB].t()).view(-1, VOCAB) / T
    k = keep.view(-1, VOCAB)
    lp = torch.log_softmax(torch.where(k.any(1, keepdim=True) & ~k, -torch.inf, z), -1)
    lp = torch.where(mask.view(-1), lp.gather(1, t.view(-1, 1)).squeeze(1), 0.0)
    ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    loss = (lp * w_lp.view(-1)).sum() + (0.3 * ent.sum() if entropy else 0.0)
    loss.backward()
    return lp.view(S, B), ent.view(S, B), h.grad, w.grad


def _op_worker():
    import torch.distributed as dist
    import torch.nn.functional as F

    from megatron_cispo.fused_head import fused_token_logprobs
    from megatron_cispo.kept_set import KeptSet
    from megatron_cispo.logprobs import token_logprobs
    from megatron_cispo.runner import distributed

    rank = distributed.init_distributed(tp=2).rank
    hidden, weight, t, keep, mask, w_lp = _op_data()
    vl = PADDED // 2
    rows = slice(rank * vl, (rank + 1) * vl)
    ks = KeptSet.from_mask(keep)
    count: list = []
    real = dist.all_reduce

    def all_reduce(*a, **k):
        count.append(str(k.get("op", dist.ReduceOp.SUM)).rsplit(".", 1)[-1])
        return real(*a, **k)

    dist.all_reduce = all_reduce
    out = {}
    try:
        for entropy in (False, True):
            ref = _reference(hidden, weight, t, keep, mask, w_lp, entropy)
            for head, sp in (("logits", False), ("fused", False), ("fused", True)):
                h = (hidden[rank * S // 2:(rank + 1) * S // 2] if sp else hidden).float().requires_grad_()
                w = weight[rows].float().requires_grad_()
                kw = dict(temperature=T, vocab_size=VOCAB, mask=mask, keep=ks, return_entropy=entropy)
                count.clear()
                if head == "logits":  # the gradient reaches hidden and weight through F.linear
                    res = token_logprobs(F.linear(h, w), t, chunk_rows=3, **kw)
                else:
                    res = fused_token_logprobs(h, w, t, sequence_parallel=sp, chunk_rows=3, **kw)
                fwd = list(count)
                lp, ent = res if entropy else (res, None)
                loss = (lp * w_lp.float()).sum() + (0.3 * ent.sum() if entropy else 0.0)
                count.clear()
                loss.backward()
                ref_gh = ref[2][rank * S // 2:(rank + 1) * S // 2] if sp else ref[2]
                if head == "logits":  # F.linear's backward leaves each rank its shard's part
                    dist.all_reduce(h.grad)
                out[(head, sp, entropy)] = {
                    "lp": (lp.double() - ref[0]).abs().max().item(),
                    "ent": 0.0 if ent is None else (ent.double() - ref[1]).abs().max().item(),
                    "grad_hidden": ((h.grad.double() - ref_gh).abs().max() / ref[2].abs().max()).item(),
                    "grad_weight": ((w.grad.double() - ref[3][rows]).abs().max() / ref[3].abs().max()).item(),
                    "fwd": fwd}
    finally:
        dist.all_reduce = real
    return out


@pytest.fixture(scope="module")
def op_results():
    return spawn(_op_worker, 2, timeout_s=120)


def test_tp2_values_and_gradients_match_the_fp64_masked_softmax_of_one_process(op_results):
    for rank, res in enumerate(op_results):
        for case, r in res.items():
            assert r["lp"] < 1e-5 and r["ent"] < 1e-5, (rank, case, r)
            assert r["grad_hidden"] < 1e-5 and r["grad_weight"] < 1e-5, (rank, case, r)


def test_replay_adds_no_collective(op_results):
    for rank, res in enumerate(op_results):
        for (head, sp, entropy), r in res.items():
            # the kept max rides on the MAX all-reduce and the kept sums on the packed SUM
            assert r["fwd"] == ["MAX", "SUM"], (rank, head, sp, r)


# ---------------------------------------------------------------- the policy step

N, SEQ, V = 8, 15, 32
LENGTHS = [16, 5, 9, 12, 3, 14, 7, 11]
LOSS = {"cispo": {"anchor": "old"}, "kl": {"coef": 0.1}}  # pi_old pass (2 steps) and a reference pass


def _step_batch(with_keep: bool):
    g = torch.Generator().manual_seed(7)
    lengths = torch.tensor(LENGTHS)
    tokens = torch.randint(0, V, (N, SEQ + 1), generator=g)
    pos = torch.arange(SEQ)[None]
    loss_mask = (pos >= 2) & (pos < lengths[:, None] - 1)
    keep = (torch.rand(N, SEQ, V, generator=g) < 0.2) & loss_mask[..., None]
    keep |= torch.nn.functional.one_hot(tokens[:, 1:], V).bool() & loss_mask[..., None]
    keep[0, 5] = False  # a trained target without replay
    keep[1, 2] = False
    keep[1, 2, tokens[1, 3]] = True  # a set of one: logprob exactly 0
    rollout = -0.3 * torch.rand(N, SEQ, generator=g) * loss_mask
    fields = dict(tokens=tokens, loss_mask=loss_mask, advantages=torch.randn(N, generator=g), lengths=lengths,
                  rollout_logprobs=rollout)
    if with_keep:
        from megatron_cispo.kept_set import KeptSet
        ks = KeptSet.from_mask(keep)
        fields.update(keep_ids=ks.ids, keep_offsets=ks.offsets)
    return fields


def _step_worker(layout: dict, packed: bool, head: str, with_keep: bool = True):
    from megatron.core import parallel_state as mpu

    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.base.weights import gather_full_state
    from megatron_cispo.step import Rollouts, StepConfig, compute_logprobs, policy_step

    tp, cp = layout.get("tp", 1), layout.get("cp", 1)
    sp = layout.get("sp", False)
    distributed.init_distributed(tp=tp, cp=cp)
    mcfg = ModelConfig(vocab_size=V, seq_length=SEQ + 1, hidden_size=32, num_layers=2, num_attention_heads=4)
    step_cfg = StepConfig(micro_batch_size=2, minibatch_size=4, max_tokens_per_microbatch=24 if packed else None,
                          temperature=0.9)
    full = Rollouts(**_step_batch(with_keep))
    batch = full.dp_shard(dp_rank=mpu.get_data_parallel_rank(), dp=mpu.get_data_parallel_world_size(),
                          minibatches=2)
    chunks = build_model(mcfg, tp=tp, pp=1, cp=cp, sequence_parallel=sp, seed=3)
    ref_chunks = build_model(mcfg, tp=tp, pp=1, cp=cp, sequence_parallel=sp, seed=4)
    opt = build_optimizer(chunks, lr=0.1, optimizer="sgd", clip_grad=1e6)
    lp0 = compute_logprobs(chunks, batch, step_cfg, head=head)
    metrics = policy_step(chunks, opt, batch, from_dict(LossConfig, {**LOSS, "head": head}), step_cfg,
                          ref_chunks=ref_chunks)
    return {"lp0": lp0, "rows": batch.tokens, "metrics": metrics, "state": gather_full_state(chunks)}


@pytest.fixture(scope="module")
def step_reference():
    return spawn(_step_worker, 1, ({}, False, "logits"))[0]


def test_forward_pass_scores_over_the_kept_sets(step_reference):
    lp = step_reference["lp0"]
    assert lp[1, 2] == 0.0  # a set of one
    assert step_reference["metrics"]["step/old_logprob_pass"] == 1.0  # the pi_old pass ran (and scored over K)
    without = spawn(_step_worker, 1, ({}, False, "logits", False))[0]
    mask = _step_batch(False)["loss_mask"]
    assert (lp[mask] >= without["lp0"][mask] - 1e-6).all()  # a subset's renormalisation only raises it
    assert (lp - without["lp0"])[mask].max() > 1e-2
    assert lp[0, 5] == pytest.approx(float(without["lp0"][0, 5]), abs=1e-6)  # no replay: the full vocabulary
    assert without["metrics"]["policy/loss"] != pytest.approx(step_reference["metrics"]["policy/loss"], rel=1e-3)


@pytest.mark.parametrize("layout, head", [
    ({"tp": 2, "sp": True}, "fused"), ({"tp": 2}, "logits"), ({"cp": 2}, "logits"), ({"dp": 2}, "fused"),
], ids=["tp2_sp_fused", "tp2_logits", "cp2", "dp2_fused"])
def test_policy_step_with_kept_sets_matches_one_process_on_every_layout(step_reference, layout, head):
    world = layout.get("tp", 1) * layout.get("cp", 1) * layout.get("dp", 1)
    results = spawn(_step_worker, world, (layout, True, head))
    ref = step_reference
    for rank, res in enumerate(results):
        rows = [int(torch.nonzero((ref["rows"] == r).all(1))[0, 0]) for r in res["rows"]]
        torch.testing.assert_close(res["lp0"], ref["lp0"][rows], rtol=0, atol=1e-5, msg=f"rank {rank}")
        for key, value in ref["metrics"].items():
            if key not in ("step/forward_calls", "step/microbatches"):
                assert res["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-5), (rank, key)
    for name, value in ref["state"].items():
        torch.testing.assert_close(results[0]["state"][name], value, rtol=0, atol=1e-5, msg=name)
