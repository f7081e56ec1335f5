"""MoE router aux-loss and z-loss gradients through policy_step, pinned by hand and across layouts.

1. One process, advantages 0 (so the CISPO gradient is exactly 0): the router weight's SGD update
   is -lr * sum_mb T_mb * d aux_mb / dW / sum_mb T_mb. Here aux_mb is megatron's switch
   load-balancing loss, recomputed by hand from the router's captured inputs, and T_mb is the
   microbatch's valid (non-padding) tokens. The update is the same for every loss_agg: the aux
   gradient never sees the policy loss's denominator.
2. TP=2 with sequence parallelism and CP=2 reproduce the single-process packed step with aux and
   z-loss on, padding split unevenly over the ranks included. Without step.moe's TP x CP
   compensation, the router weights are visibly off.
3. pp4 vp2 (interleaved schedule) with 8 MoE layers, and with layers 4 and 8 dense (PP rank 3
   holds no router), reproduce one process, moe/ metrics included.
4. A microbatch built by hand without n_seqs keeps the aux loss (make_forward_step).
Inputs are chosen so that first-fit-decreasing packing makes the same bins at every pad multiple
(1, 2, 4): a load-balancing loss is per microbatch, so the layouts must route the same bins.
"""
import importlib

import pytest
import torch

from megatron_cispo.testing import spawn

S, V = 15, 32
EXPERTS, TOPK = 4, 2
ROUTER_SCALE = 50.0  # router std 0.02 -> 1: top-k choices far from ties (checked: MIN_ROUTER_GAP)
MIN_ROUTER_GAP = 1e-3  # router-logit gap between the k-th and (k+1)-th expert; layouts differ by ~1e-6
BUDGET = 24
# target lengths 3, 15, 8, 11, 11, 15, 14, 8: bins {1,2} {5,7} {0,6} {3,4} at pad multiples 1, 2 and 4
LENGTHS = [4, 16, 9, 12, 12, 16, 15, 9]
AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
AUX_COEFF, Z_COEFF = 0.01, 1e-3
TOL = 1e-5
HAND_ATOL = 1e-6  # fp32 update of O(1) weights: ~1e-7 of rounding, against updates of ~1e-2


def make_batch(lengths=LENGTHS):
    """Rows of `lengths` real tokens, a loss mask on the response, per-row advantages and a
    rollout logprob offset (a sampler a little behind the trainer)."""
    g = torch.Generator().manual_seed(11)
    n = len(lengths)
    lengths = torch.tensor(lengths)
    tokens = torch.randint(0, V, (n, S + 1), generator=g)
    pos = torch.arange(S)[None]
    loss_mask = (pos >= 2) & (pos < lengths[:, None] - 1)
    return tokens, lengths, loss_mask, torch.randn(n, generator=g), -0.3 * torch.rand(n, S, generator=g)


def _dense_layers_spec(mcfg, dense: tuple):
    """runner.model's block spec with the global layers `dense` (1-based) built as dense MLPs, as
    megatron's moe_layer_freq does (runner.model builds every layer MoE)."""
    from dataclasses import replace

    from megatron.core.transformer import transformer_block as tb

    from megatron_cispo.runner import specs

    dense_layer = specs.layer_spec(replace(mcfg, num_moe_experts=None, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0))

    def block_spec(layer, tcfg, vp_stage):
        first = tb.get_transformer_layer_offset(tcfg, vp_stage=vp_stage) + 1
        n = tb.get_num_layers_to_build(tcfg, vp_stage=vp_stage)
        return tb.TransformerBlockSubmodules(
            layer_specs=[dense_layer if first + i in dense else layer for i in range(n)],
            layer_norm=specs._torch_norm_for(tb.LayerNormImpl))
    return block_spec


def _build(*, tp=1, pp=1, vp=None, cp=1, sp=False, ep=1, aux, z, lr, layers=1, dense=()):
    """An MoE GPT (4 experts, top-2; the global layers `dense` without experts) with scaled
    routers, and plain SGD that never clips."""
    from megatron_cispo.runner import model
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer

    mcfg = ModelConfig(vocab_size=V, seq_length=S + 1, hidden_size=32, num_layers=layers, num_attention_heads=4,
                       num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_aux_loss_coeff=aux, moe_z_loss_coeff=z)
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()  # megatron sizes it by the first model's layers
    saved = model.block_spec
    if dense:
        model.block_spec = _dense_layers_spec(mcfg, dense)
    try:
        chunks = build_model(mcfg, tp=tp, pp=pp, vp=vp, cp=cp, ep=ep, sequence_parallel=sp, seed=5)
    finally:
        model.block_spec = saved
    with torch.no_grad():
        for c in chunks:
            for name, p in c.named_parameters():
                if name.endswith("router.weight"):
                    p.mul_(ROUTER_SCALE)  # replicated over TP and CP: every layout scales the same weights
    return chunks, build_optimizer(chunks, lr=lr, optimizer="sgd", clip_grad=0.0)


def _routers(chunks) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]


def _router(chunks):
    (router,) = _routers(chunks)
    return router


def _capture_router_inputs(router, seen: list):
    """Record (hidden_states [s, b, h], padding_mask [s, b], True = padding) of every training
    forward of the router (MoELayer calls it as router(hidden_states, padding_mask))."""
    def hook(module, args):
        if module.training and torch.is_grad_enabled():
            seen.append((args[0].detach().clone(), args[1].detach().clone()))
    return router.register_forward_pre_hook(hook)


def _logit_gap(x, pad, weight) -> float:
    """Smallest router-logit gap between the k-th and (k+1)-th expert over the valid tokens."""
    top = (x.reshape(-1, weight.shape[1]).double() @ weight.double().t()).topk(TOPK + 1, dim=-1).values
    return (top[:, TOPK - 1] - top[:, TOPK])[~pad.reshape(-1)].min().item()


def switch_aux_loss(x, pad, weight, coeff):
    """megatron's 'aux_loss' (Switch load balancing) of one microbatch, by hand, in fp64.

    x: [s, b, h] router input; pad: [s, b] bool, True = padding; weight: [E, h].
    aux = coeff * E * sum_i f_i * P_i over the T valid tokens, with f_i = (tokens routed to i) / (T k)
    and P_i = (sum of the softmax scores of i) / T; padding is neither routed nor scored.
    Returns (aux, T)."""
    valid = ~pad.reshape(-1)
    scores = torch.softmax(x.reshape(-1, x.shape[-1]).double() @ weight.t(), dim=-1)[valid]
    routed = torch.zeros_like(scores).scatter(1, scores.detach().topk(TOPK, dim=-1).indices, 1.0)
    t = int(valid.sum())
    f = routed.sum(0) / (t * TOPK)
    p = scores.sum(0) / t
    return coeff * EXPERTS * (f * p).sum(), t


def hand_aux_worker(lr=100.0):
    """One process. For each loss_agg: a fresh model, policy_step with advantages 0, the router's
    captured inputs, and the router update next to the hand-computed -lr * gradient."""
    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.runner import distributed
    from megatron_cispo.step import Rollouts, StepConfig, policy_step
    from megatron_cispo.step.packing import Layout

    distributed.init_distributed()
    # One process packs without padding (pad multiple 1). Pad every sequence to a multiple of 4,
    # as CP=2 does, so that the router gets packing padding through padding_mask.
    step_module = importlib.import_module("megatron_cispo.step.policy_step")  # not the function
    step_module.step_layout = lambda chunks, step_cfg: Layout(pad_multiple=4, padding_mask=True)
    tokens, lengths, loss_mask, _, noise = make_batch()
    out = {}
    for agg in AGGS:
        chunks, opt = _build(aux=AUX_COEFF, z=0.0, lr=lr)
        router = _router(chunks)
        w0 = router.weight.detach().clone()
        seen: list = []
        hook = _capture_router_inputs(router, seen)
        batch = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=torch.zeros(len(LENGTHS)),
                         lengths=lengths, rollout_logprobs=noise * loss_mask)
        loss_cfg = from_dict(LossConfig, {"cispo": {"anchor": "rollout"}, "loss_agg": agg})
        metrics = policy_step(chunks, opt, batch, loss_cfg,
                              StepConfig(micro_batch_size=len(LENGTHS), max_tokens_per_microbatch=BUDGET))
        hook.remove()
        w = w0.double().requires_grad_()
        weighted, total = 0.0, 0
        for x, pad in seen:
            aux, t = switch_aux_loss(x, pad, w, AUX_COEFF)
            weighted, total = weighted + t * aux, total + t
        (grad,) = torch.autograd.grad(weighted / total, w)
        out[agg] = {"update": (router.weight.detach() - w0).double(), "expected": -lr * grad,
                    "gap": min(_logit_gap(x, pad, w0) for x, pad in seen),
                    "padding": sum(int(pad.sum()) for _, pad in seen), "microbatches": len(seen),
                    "metrics": metrics}
    return out


def router_metrics_by_hand(seen: dict, weights: dict) -> dict:
    """policy_step's moe/ metrics in one process, from the routers' inputs (seen: layer -> [(x,
    pad)], weights: layer -> router weight): per layer the mean over microbatches of the unscaled
    aux loss and of mean logsumexp^2 over valid tokens, then the mean over MoE layers; the valid
    tokens routed to the busiest and idlest expert of any layer."""
    aux, z, top, low = [], [], [], []
    for layer, mbs in seen.items():
        w = weights[layer].double()
        aux.append(sum(float(switch_aux_loss(x, pad, w, 1.0)[0]) for x, pad in mbs) / len(mbs))
        zs, routed = [], torch.zeros(EXPERTS, dtype=torch.float64)
        for x, pad in mbs:
            logits = (x.reshape(-1, x.shape[-1]).double() @ w.t())[~pad.reshape(-1)]
            zs.append(float(torch.logsumexp(logits, -1).square().mean()))
            routed += torch.zeros_like(logits).scatter(1, logits.topk(TOPK, dim=-1).indices, 1.0).sum(0)
        z.append(sum(zs) / len(zs))
        top.append(float(routed.max()))
        low.append(float(routed.min()))
    return {"moe/aux_loss": sum(aux) / len(aux), "moe/z_loss": sum(z) / len(z),
            "moe/expert_tokens_max": max(top), "moe/expert_tokens_min": min(low)}


# Per run: (TP x CP compensation on, packed, micro_batch_size, on this rank's DP shard). "padded"
# and "packed_windows" route the same microbatches at dp=2 as in one process; at dp=2
# "packed_windows" packs rows 0-3 into 2 bins and rows 4-7 into 3, so rank 0 runs an all-padding
# bin to keep the EP all-to-alls in step.
RUNS = {"compensated": (True, True, 8, False), "uncompensated": (False, True, 8, False),
        "padded": (True, False, 2, True), "packed_windows": (True, True, 4, True),
        "interleaved": (True, True, 8, False), "dense_stage": (True, True, 8, False)}
# The model of a run, when not one MoE layer. "interleaved": 8 MoE layers, one per virtual stage at
# pp4 vp2 (the schedule calls forward_step once per chunk and microbatch; gloo refuses vp at pp2).
# "dense_stage": layers 4 and 8 dense, so that PP rank 3 holds no router and still joins
# RouterStats' reductions.
RUN_MODEL = {"interleaved": {"layers": 8}, "dense_stage": {"layers": 8, "dense": (4, 8)}}


def layout_worker(layout: dict, runs=("compensated",), lr=1.0):
    """policy_step with aux and z-loss on; per run, the metrics, the gathered post-step state and
    what this rank's router saw. 'uncompensated' turns step.moe's TP x CP compensation off, as
    on a megatron-core that carries the upstream fix."""
    import megatron_cispo.step.moe as moe
    from megatron.core import parallel_state as mpu

    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.weights import gather_full_state
    from megatron_cispo.step import Rollouts, StepConfig, policy_step

    tp, cp, sp, ep = layout.get("tp", 1), layout.get("cp", 1), layout.get("sp", False), layout.get("ep", 1)
    pp, vp = layout.get("pp", 1), layout.get("vp")
    distributed.init_distributed(tp=tp, pp=pp, vp=vp, cp=cp, ep=ep)
    tokens, lengths, loss_mask, adv, noise = make_batch()
    fixed_in = moe.FIXED_IN
    out = {}
    for run in runs:
        compensated, packed, micro, shard = RUNS[run]
        moe.FIXED_IN = fixed_in if compensated else (0, 0)
        chunks, opt = _build(tp=tp, pp=pp, vp=vp, cp=cp, sp=sp, ep=ep, aux=AUX_COEFF, z=Z_COEFF, lr=lr,
                             **RUN_MODEL.get(run, {}))
        routers = _routers(chunks)
        w0 = {r.layer_number: r.weight.detach().clone() for r in routers}
        seen: dict = {r.layer_number: [] for r in routers}
        hooks = [_capture_router_inputs(r, seen[r.layer_number]) for r in routers]
        initial = gather_full_state(chunks)
        batch = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=adv, lengths=lengths,
                         rollout_logprobs=noise * loss_mask)
        step_cfg = StepConfig(micro_batch_size=micro, max_tokens_per_microbatch=BUDGET if packed else None)
        if shard:
            batch = batch.dp_shard(dp_rank=mpu.get_data_parallel_rank(), dp=mpu.get_data_parallel_world_size())
        metrics = policy_step(chunks, opt, batch, from_dict(LossConfig, {"cispo": {"anchor": "rollout"}}), step_cfg)
        for h in hooks:
            h.remove()
        # an all-padding filler bin routes nothing
        seen = {k: [(x, pad) for x, pad in v if not pad.all()] for k, v in seen.items()}
        flat = [(k, x, pad) for k, v in seen.items() for x, pad in v]
        out[run] = {"metrics": metrics, "initial": initial, "state": gather_full_state(chunks),
                    "gap": min((_logit_gap(x, pad, w0[k]) for k, x, pad in flat), default=float("inf")),
                    "valid": [int((~pad).sum()) for _, _, pad in flat], "seen": [pad.numel() for _, _, pad in flat],
                    "by_hand": router_metrics_by_hand(seen, w0) if flat else None}
    moe.FIXED_IN = fixed_in
    return out


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


_RUNS: dict[str, list] = {}
LAYOUTS = {"tp2_sp": {"tp": 2, "sp": True}, "cp2": {"cp": 2}, "dp2_ep2": {"ep": 2}, "pp4_vp2": {"pp": 4, "vp": 2}}


def _layout_results(name: str) -> list[dict]:
    """Per-rank results of a layout; tp2_sp also runs once without the compensation and once
    padded (its DP shard is the whole batch); dp2_ep2 runs padded only, on its DP shard."""
    if name not in _RUNS:
        runs = {"tp2_sp": ("compensated", "uncompensated", "padded"), "dp2_ep2": ("padded", "packed_windows"),
                "pp4_vp2": ("interleaved", "dense_stage")}.get(name, ("compensated",))
        _RUNS[name] = spawn(layout_worker, LAYOUTS[name].get("pp", 2), (LAYOUTS[name], runs))
    return _RUNS[name]


@pytest.fixture(scope="module")
def references():
    return spawn(layout_worker, 1, ({}, ("compensated", "padded", "packed_windows", "interleaved",
                                         "dense_stage")))[0]


@pytest.fixture(scope="module")
def reference(references):
    return references["compensated"]


def _max_router_diff(state, ref_state) -> float:
    return max((state[k] - v).abs().max().item() for k, v in ref_state.items() if k.endswith("router.weight"))


@pytest.mark.parametrize("name", ["tp2_sp", "cp2"])
def test_aux_and_z_loss_step_matches_single_process(reference, name):
    results = [r["compensated"] for r in _layout_results(name)]
    assert reference["gap"] > MIN_ROUTER_GAP and min(r["gap"] for r in results) > MIN_ROUTER_GAP
    # the same bins, split over the two ranks with packing padding, unevenly
    valid = [sum(v) for v in zip(*(r["valid"] for r in results))]
    assert valid == reference["valid"]
    assert sum(sum(r["seen"]) for r in results) > sum(valid)
    assert results[0]["valid"] != results[1]["valid"]
    moved = _max_router_diff(reference["state"], reference["initial"])
    assert moved > 100 * TOL  # the step moved the router, by the policy, aux and z-loss gradients
    state = results[0]["state"]
    assert set(state) == set(reference["state"])
    for k in sorted(state, key=lambda k: not k.endswith("router.weight")):  # the router first
        torch.testing.assert_close(state[k], reference["state"][k], rtol=0, atol=TOL, msg=lambda m: (
            f"{name} {k}: {m}\n(the MoE aux/z-loss gradient scale differs from one process; see step/moe.py)"))
    per_rank = {"step/forward_calls", "step/microbatches"}
    for rank, r in enumerate(results):
        assert set(r["metrics"]) == set(reference["metrics"])
        for key, value in reference["metrics"].items():
            if key not in per_rank:
                assert r["metrics"][key] == pytest.approx(value, rel=TOL, abs=TOL), f"{name} rank {rank} {key}"


def test_without_compensation_tp2_sp_router_misses_the_reference(reference):
    r = _layout_results("tp2_sp")[0]["uncompensated"]
    assert _max_router_diff(r["state"], reference["state"]) > 20 * TOL


MOE_KEYS = ("moe/aux_loss", "moe/z_loss", "moe/expert_tokens_max", "moe/expert_tokens_min")


def test_router_metrics_are_the_routers_values_by_hand_in_one_process(references):
    for run, r in references.items():
        for key in MOE_KEYS:
            assert r["metrics"][key] == pytest.approx(r["by_hand"][key], rel=1e-5), f"{run} {key}"
        assert r["metrics"]["moe/expert_tokens_max"] > r["metrics"]["moe/expert_tokens_min"]


@pytest.mark.parametrize("name,run", [("tp2_sp", "compensated"), ("cp2", "compensated"), ("tp2_sp", "padded"),
                                      ("dp2_ep2", "padded")])
def test_router_metrics_are_exact_over_dp_ep_tp_and_cp(references, name, run):
    for rank, r in enumerate(_layout_results(name)):
        for key in MOE_KEYS:
            assert r[run]["metrics"][key] == pytest.approx(references[run]["metrics"][key], rel=TOL), \
                f"{name} rank {rank} {key}"
    if name == "dp2_ep2":  # the two ranks routed different rows: the DP reduction is not a copy
        mine = [r[run]["by_hand"]["moe/expert_tokens_max"] for r in _layout_results(name)]
        assert max(mine) < references[run]["metrics"]["moe/expert_tokens_max"]


def test_an_all_padding_bin_at_dp2_ep2_trains_like_one_process(references):
    """Packed at dp=2, rank 0 runs an empty filler bin; megatron-core's Switch loss over no token is
    0/0, and its NaN gradient used to skip every such step (step/moe.py turns the aux loss off for
    that forward: the bin has no token, so it adds nothing)."""
    ref = references["packed_windows"]
    assert ref["metrics"]["step/optimizer_steps"] == 1.0 and ref["metrics"]["step/microbatches"] == 5
    for rank, r in enumerate(_layout_results("dp2_ep2")):
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
    results = _layout_results("pp4_vp2")
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
