"""Shared by test_moe_aux_loss.py (router gradients) and test_moe_router_metrics.py (moe/ metrics):
a tiny MoE GPT (4 experts, top-2) with scaled routers, policy_step runs on it in every layout,
and the router's losses by hand. Each layout is spawned once per test session (layout_results),
its runs shared by both test files.

Inputs are chosen so that first-fit-decreasing packing makes the same bins at every pad multiple
(1, 2, 4): a load-balancing loss is per microbatch, so the layouts must route the same bins.
"""
import importlib

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


def _clear_router_loss_tracker():
    """Drop megatron-core's per-layer router-loss tracker, which it sizes by the first model's
    layers (0.18+: a MoEMetricsTracker object; 0.16-0.17: a module-level dict)."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    else:
        destroy_moe_metrics_tracker()


def _build(*, tp=1, pp=1, vp=None, cp=1, sp=False, ep=1, aux, z, lr, layers=1, dense=()):
    """An MoE GPT (4 experts, top-2; the global layers `dense` without experts) with scaled
    routers, and plain SGD that never clips."""
    from megatron_cispo.runner import model
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer

    mcfg = ModelConfig(vocab_size=V, seq_length=S + 1, hidden_size=32, num_layers=layers, num_attention_heads=4,
                       num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_aux_loss_coeff=aux, moe_z_loss_coeff=z)
    _clear_router_loss_tracker()
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
    step_module.step_layout = lambda chunks, step_cfg, pg=None: Layout(pad_multiple=4, padding_mask=True)
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
    what this rank's router saw. 'uncompensated' turns step.moe's TP x CP compensation off (the
    coefficients as configured, whatever megatron-core's release)."""
    import megatron_cispo.step.moe as moe
    from megatron.core import parallel_state as mpu

    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.runner import distributed
    from megatron_cispo.base.weights import gather_full_state
    from megatron_cispo.step import Rollouts, StepConfig, policy_step

    tp, cp, sp, ep = layout.get("tp", 1), layout.get("cp", 1), layout.get("sp", False), layout.get("ep", 1)
    pp, vp = layout.get("pp", 1), layout.get("vp")
    distributed.init_distributed(tp=tp, pp=pp, vp=vp, cp=cp, ep=ep)
    tokens, lengths, loss_mask, adv, noise = make_batch()
    table = moe.loss_factors
    out = {}
    for run in runs:
        compensated, packed, micro, shard = RUNS[run]
        moe.loss_factors = table if compensated else (lambda config, padding_mask: (1.0, 1.0))
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
    moe.loss_factors = table
    return out


_RUNS: dict[str, list] = {}
LAYOUTS = {"tp2_sp": {"tp": 2, "sp": True}, "cp2": {"cp": 2}, "dp2_ep2": {"ep": 2}, "pp4_vp2": {"pp": 4, "vp": 2}}


def layout_results(name: str) -> list[dict]:
    """Per-rank results of a layout; tp2_sp also runs once without the compensation and once
    padded (its DP shard is the whole batch); dp2_ep2 runs padded only, on its DP shard."""
    if name not in _RUNS:
        runs = {"tp2_sp": ("compensated", "uncompensated", "padded"), "dp2_ep2": ("padded", "packed_windows"),
                "pp4_vp2": ("interleaved", "dense_stage")}.get(name, ("compensated",))
        _RUNS[name] = spawn(layout_worker, LAYOUTS[name].get("pp", 2), (LAYOUTS[name], runs))
    return _RUNS[name]


_REFERENCES: list = []


def references() -> dict:
    """One process's results of every run (no DP shard: its shard is the whole batch)."""
    if not _REFERENCES:
        _REFERENCES.append(spawn(layout_worker, 1, ({}, ("compensated", "padded", "packed_windows", "interleaved",
                                                          "dense_stage")))[0])
    return _REFERENCES[0]
