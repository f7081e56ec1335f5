"""MoE routing replay (loss.routing_replay: rollout) in every layout: dp2, ep2 (dp2), tp2+SP, pp2, cp2.

A 2-layer MoE GPT (moe_helpers: 4 experts, top-2, aux and z-loss on). One process records the
model's own routes of the global batch (an eval forward over whole rows); then, per layout:
1. with those routes replayed, every router on every rank routes each token exactly as recorded
   (checked inside the router, per rank: its routing map against the routes it was handed) and
   moe/route_mismatch is 0;
2. with random valid routes (some tokens -1), every rank's routers follow them, and the loss,
   moe/ metrics and post-step parameters equal one process's within 1e-5 (packed; padded too where
   the layout allows: CP needs packing).
The routes travel through Rollouts.dp_shard, packing (THD), CP's load-balanced chunks, the SP
slice and the pipeline stages (each stage's routers get their layers' routes).
3. dp2 with a bad route on DP rank 1: both ranks raise BadRoutes with one message naming the
   global sample index (not rank 1's local row).
In tp2_sp and cp2 the step runs on process groups handed in (groups_helpers.own_groups), and no
parallel_state getter is called from megatron_cispo's code inside policy_step.
"""
import pytest
import torch

from groups_helpers import own_groups, watch_parallel_state
from moe_helpers import AUX_COEFF, BUDGET, EXPERTS, LENGTHS, S, TOL, TOPK, Z_COEFF, _build, _routers, make_batch
from megatron_cispo.testing import spawn

LAYERS = 2
LAYOUTS = {"tp2_sp": {"tp": 2, "sp": True}, "pp2": {"pp": 2}, "cp2": {"cp": 2}, "dp2": {}, "dp2_ep2": {"ep": 2}}
CHECKED = ("policy/loss", "cispo/ratio_mean", "moe/aux_loss", "moe/z_loss", "moe/expert_tokens_max",
           "moe/route_mismatch", "moe/route_mismatch_l0", "moe/route_mismatch_l1", "moe/replay_fallbacks")


def random_routes() -> torch.Tensor:
    g = torch.Generator().manual_seed(21)
    routes = torch.rand(len(LENGTHS), S, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOPK]
    routes[1, 3:6, 0] = -1  # fallbacks (real tokens of row 1) in layer 0, one in layer 1
    routes[5, 2, 1, 1] = -1
    return routes


def _router_check(chunks, tally: list):
    """Per router forward with routes: tokens whose routing map differs from a given route, and
    the routed tokens checked."""
    def hook(router, args, out):
        replay = router.router_replay
        if replay is not None and replay.routes is not None and replay.replace:
            routes, routed = replay.routes, (replay.routes >= 0).all(-1)
            given = torch.zeros_like(out[1]).scatter(1, routes.clamp(min=0), True)
            tally.append(((given != out[1]).any(-1) & routed).sum().item())
            tally.append(-routed.sum().item())
    return [r.register_forward_hook(hook) for r in _routers(chunks)]


def worker(layout: dict, routes: dict, runs: tuple, hand_in: bool = False):
    from megatron.core import parallel_state as mpu

    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.runner import distributed
    from megatron_cispo.base.weights import gather_full_state
    from megatron_cispo.step import Rollouts, StepConfig, policy_step

    tp, cp, sp, ep, pp = (layout.get(k, d) for k, d in (("tp", 1), ("cp", 1), ("sp", False), ("ep", 1), ("pp", 1)))
    distributed.init_distributed(tp=tp, pp=pp, cp=cp, ep=ep)
    tokens, lengths, loss_mask, adv, noise = make_batch()
    pg = own_groups() if hand_in else None  # every group handed in (step/groups.py), no global read of ours
    out = {}
    if routes is None:  # the one-process reference: record the model's own routes first
        chunks, _ = _build(aux=AUX_COEFF, z=Z_COEFF, lr=1.0, layers=LAYERS)
        seen = []
        hooks = [r.register_forward_hook(lambda m, a, o: seen.append(o[1].nonzero()[:, 1].view(S, -1, TOPK)))
                 for r in _routers(chunks)]
        with torch.no_grad():
            chunks[0].eval()
            chunks[0](tokens[:, :-1], torch.arange(S).expand(len(LENGTHS), S), None)
        for h in hooks:
            h.remove()
        routes = {"recorded": torch.stack(seen, 2).transpose(0, 1).contiguous(), "random": random_routes()}
        out["routes"] = routes
    for run in runs:
        kind, packed = run.split("_")
        chunks, opt = _build(tp=tp, pp=pp, cp=cp, sp=sp, ep=ep, aux=AUX_COEFF, z=Z_COEFF, lr=1.0, layers=LAYERS)
        tally: list = []
        hooks = _router_check(chunks, tally)
        batch = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=adv, lengths=lengths,
                         rollout_logprobs=noise * loss_mask, routed_experts=routes[kind])
        batch = batch.dp_shard(dp_rank=mpu.get_data_parallel_rank(), dp=mpu.get_data_parallel_world_size())
        step_cfg = StepConfig(micro_batch_size=2, max_tokens_per_microbatch=BUDGET if packed == "packed" else None)
        loss_cfg = from_dict(LossConfig, {"cispo": {"anchor": "rollout"}, "routing_replay": "rollout"})
        seen: list = []
        undo = watch_parallel_state(seen) if hand_in else (lambda: None)
        try:
            metrics = policy_step(chunks, opt, batch, loss_cfg, step_cfg, pg_collection=pg)
        except ValueError as e:
            out[run] = f"{type(e).__name__}: {e}"
            continue
        finally:
            undo()
        for h in hooks:
            h.remove()
        out[run] = {"metrics": metrics, "state": gather_full_state(chunks), "globals_read": seen,
                    "differs": sum(t for t in tally if t >= 0), "checked": -sum(t for t in tally if t < 0)}
    return out


RUNS = ("recorded_packed", "random_packed", "random_padded")
_CACHE: dict = {}


def reference() -> dict:
    if "ref" not in _CACHE:
        _CACHE["ref"] = spawn(worker, 1, ({}, None, RUNS), timeout_s=300)[0]
    return _CACHE["ref"]


def test_one_process_replays_recorded_and_random_routes():
    ref = reference()
    for run in RUNS:
        r = ref[run]
        assert r["differs"] == 0 and r["checked"] > 0, run
    assert ref["recorded_packed"]["metrics"]["moe/route_mismatch"] == 0.0
    m = ref["random_packed"]["metrics"]
    assert m["moe/route_mismatch"] > 0.3 and m["moe/replay_fallbacks"] == 4.0


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_follow_the_routes_and_match_one_process(name):
    ref = reference()
    runs = RUNS if name != "cp2" else RUNS[:2]
    hand_in = name in ("tp2_sp", "cp2")  # the step on groups handed in: the routes' SP slice, the TP x CP sums
    results = spawn(worker, 2, (LAYOUTS[name], ref["routes"], runs, hand_in), timeout_s=400)
    for rank, res in enumerate(results):
        for run in runs:
            r, want = res[run], ref[run]
            assert not hand_in or r["globals_read"] == [], f"{name} rank {rank} {run}: {r['globals_read']}"
            assert r["differs"] == 0, f"{name} rank {rank} {run}: {r['differs']} tokens off their route"
            if not (name == "pp2" and rank == 0):  # pp2: rank 0 holds layer 1 only, still routed
                assert r["checked"] > 0, f"{name} rank {rank} {run}: no routed token reached a router"
            for key in CHECKED:
                assert r["metrics"][key] == pytest.approx(want["metrics"][key], rel=TOL, abs=TOL), \
                    f"{name} rank {rank} {run} {key}"
            for k, v in want["state"].items():
                torch.testing.assert_close(r["state"][k], v, rtol=0, atol=TOL, msg=f"{name} {run} {k}")


def test_a_bad_route_on_one_dp_rank_names_the_global_sample_on_every_rank():
    bad = random_routes()
    bad[6, 2, 1, 0] = EXPERTS  # global row 6: DP rank 1's local row 2
    results = spawn(worker, 2, ({}, {"bad": bad}, ("bad_packed",)), timeout_s=300)
    want = (f"BadRoutes: rollouts.routed_experts: sample 6 (global index), MoE layer 1 (model layer 2), "
            f"position 2: expert {EXPERTS} is outside [0, {EXPERTS})")
    assert [r["bad_packed"][:len(want)] for r in results] == [want, want]
    assert results[0]["bad_packed"] == results[1]["bad_packed"]
