"""MoE router aux-loss and z-loss gradients through policy_step, pinned by hand and across layouts
(the model, runs and hand computations: moe_helpers.py; the moe/ metrics: test_moe_router_metrics.py).

1. One process, advantages 0 (so the CISPO gradient is exactly 0): the router weight's SGD update
   is -lr * sum_mb T_mb * d aux_mb / dW / sum_mb T_mb. Here aux_mb is megatron's switch
   load-balancing loss, recomputed by hand from the router's captured inputs, and T_mb is the
   microbatch's valid (non-padding) tokens. The update is the same for every loss_agg: the aux
   gradient never sees the policy loss's denominator.
2. TP=2 with sequence parallelism, CP=2 and EP=2 (dp2) reproduce the single-process step with aux
   and z-loss on, padding split unevenly over the ranks included: the router update to
   ROUTER_ATOL, on every megatron-core tier (step/moe.py's table says which coefficient the
   installed release needs scaled). Without that compensation the tp2-sp router misses.
3. A microbatch built by hand without n_seqs keeps the aux loss (make_forward_step).
"""
import warnings

import pytest
import torch

from megatron_cispo.testing import spawn
from moe_helpers import (AGGS, AUX_COEFF, HAND_ATOL, MIN_ROUTER_GAP, S, TOL, _build, _router, hand_aux_worker,
                         layout_results, make_batch, references, LENGTHS)

ROUTER_ATOL = 1.2e-7  # ~1 fp32 ulp of the O(1) router weights; the updates are ~1e-2


def test_router_update_is_the_hand_computed_aux_gradient_for_every_loss_agg():
    res = spawn(hand_aux_worker, 1)[0]
    first = res[AGGS[0]]
    for agg in AGGS:
        r = res[agg]
        assert r["gap"] > MIN_ROUTER_GAP, agg
        assert r["padding"] > 0 and r["microbatches"] == r["metrics"]["step/microbatches"] > 1, agg
        assert r["expected"].abs().max() > 1e3 * HAND_ATOL, agg  # the check below is not vacuous
        torch.testing.assert_close(r["update"], r["expected"], rtol=0, atol=HAND_ATOL, msg=agg)
        # the policy denominators differ (tokens vs sequences); the aux gradient must not follow them
        torch.testing.assert_close(r["update"], first["update"], rtol=0, atol=1e-7, msg=agg)


def test_the_installed_router_reads_as_the_table_says():
    """step/moe.py's probe of the installed TopKRouter source agrees with its table by release."""
    from types import SimpleNamespace

    from megatron.core import package_info

    from megatron_cispo.step.moe import loss_factors, router_scales_by_group_size

    fixed = (int(package_info.MAJOR), int(package_info.MINOR)) >= (0, 19)
    assert router_scales_by_group_size() == fixed
    cfg = SimpleNamespace(num_moe_experts=4, tensor_model_parallel_size=2, context_parallel_size=2)
    expected = {True: (1.0, 0.25), False: (1.0, 1.0)} if fixed else {True: (4.0, 1.0), False: (4.0, 4.0)}
    for mask, factors in expected.items():
        assert loss_factors(cfg, padding_mask=mask) == factors


def test_a_release_newer_than_the_table_warns_once(monkeypatch):
    import megatron_cispo.step.moe as moe

    monkeypatch.setattr(moe, "_megatron_version", lambda: (0, 21))
    moe.router_scales_by_group_size.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"megatron-core 0\.21: .*read for 0\.16-0\.19"):
            moe.router_scales_by_group_size()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            moe.router_scales_by_group_size()  # once per process
    finally:
        moe.router_scales_by_group_size.cache_clear()


def _router_updates(r) -> dict:
    return {k: (r["state"][k].double() - v.double()) for k, v in r["initial"].items() if k.endswith("router.weight")}


def _max_router_diff(r, ref) -> float:
    mine = _router_updates(r)
    return max((mine[k] - u).abs().max().item() for k, u in _router_updates(ref).items())


@pytest.mark.parametrize("name,run", [("tp2_sp", "compensated"), ("cp2", "compensated"), ("tp2_sp", "padded"),
                                      ("dp2_ep2", "padded")])
def test_aux_and_z_loss_step_matches_single_process(name, run):
    reference, results = references()[run], [r[run] for r in layout_results(name)]
    assert reference["gap"] > MIN_ROUTER_GAP and min(r["gap"] for r in results) > MIN_ROUTER_GAP
    if name != "dp2_ep2":  # the same bins, split over the two ranks with packing padding, unevenly
        valid = [sum(v) for v in zip(*(r["valid"] for r in results))]
        assert valid == reference["valid"]
        assert sum(sum(r["seen"]) for r in results) > sum(valid)
        assert results[0]["valid"] != results[1]["valid"]
    moved = max(u.abs().max().item() for u in _router_updates(reference).values())
    assert moved > 1e4 * ROUTER_ATOL  # the step moved the router, by the policy, aux and z-loss gradients
    diff = _max_router_diff(results[0], reference)
    print(f"{name} {run}: router update {moved:.3e}, off one process by {diff:.3e}")
    assert diff <= ROUTER_ATOL, (f"{name} {run}: the router update is {diff:.3e} off one process (the MoE "
                                 "aux/z-loss gradient scale; see step/moe.py)")
    state = results[0]["state"]
    assert set(state) == set(reference["state"])
    for k in state:
        torch.testing.assert_close(state[k], reference["state"][k], rtol=0, atol=TOL, msg=f"{name} {run} {k}")
    per_rank = {"step/forward_calls", "step/microbatches"}
    for rank, r in enumerate(results):
        assert set(r["metrics"]) == set(reference["metrics"])
        for key, value in reference["metrics"].items():
            if key not in per_rank:
                assert r["metrics"][key] == pytest.approx(value, rel=TOL, abs=TOL), f"{name} rank {rank} {key}"


def test_without_compensation_tp2_sp_router_misses_the_reference():
    diff = _max_router_diff(layout_results("tp2_sp")[0]["uncompensated"], references()["compensated"])
    print(f"tp2_sp uncompensated: router update off one process by {diff:.3e}")
    assert diff > 100 * ROUTER_ATOL  # 0.16.1: 2.1e-3 (the z-loss), 0.19.2: 1.2e-4 (the aux loss)


def hand_built_microbatch_worker():
    """make_forward_step on a hand-built padded microbatch, as docs/integration.md shows it (no
    n_seqs), as a dict without "n_seqs", and with n_seqs given; advantages 0, so that the router's
    gradient is its aux loss's alone. Returns each one's router gradient."""
    from megatron_cispo.config import CispoConfig, LossConfig
    from megatron_cispo.runner import distributed
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_cispo.step import Microbatch, make_forward_step

    distributed.init_distributed()
    tokens, lengths, loss_mask, _, noise = make_batch()
    b = len(LENGTHS)
    fields = dict(input_ids=tokens[:, :-1], position_ids=torch.arange(S)[None].expand(b, S), targets=tokens[:, 1:],
                  loss_mask=loss_mask, advantages=torch.zeros(b, S), rollout_logprobs=noise * loss_mask, seq_length=S)
    chunks, _ = _build(aux=AUX_COEFF, z=0.0, lr=1.0)
    router = _router(chunks)
    forward_step = make_forward_step(LossConfig(cispo=CispoConfig(anchor="rollout")))
    grads = {}
    for name, mb in (("n_seqs given", Microbatch(**fields, n_seqs=b)), ("no n_seqs", Microbatch(**fields)),
                     ("dict without n_seqs", dict(fields))):
        chunks[0].zero_grad_buffer()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([mb]), model=chunks[0],
                                    num_microbatches=1, seq_length=S, micro_batch_size=b, forward_only=False)
        grads[name] = router.weight.main_grad.detach().clone()
    return grads


def test_a_hand_built_microbatch_without_n_seqs_keeps_the_moe_aux_loss():
    """Microbatch.n_seqs used to default to 0, which forward_step reads as an all-padding bin: a
    Microbatch or dict built by hand trained an MoE model without its aux loss."""
    grads = spawn(hand_built_microbatch_worker, 1)[0]
    given = grads.pop("n_seqs given")
    assert given.abs().max() > 1e-6  # the aux loss is the router's only gradient here
    for name, g in grads.items():
        torch.testing.assert_close(g, given, rtol=0, atol=0, msg=name)
