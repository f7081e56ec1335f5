"""MoE routing replay's guards: routers that cannot take routes (no seam, fused or sinkhorn
router, CUDA graphs) get 'rollout' refused in one line and 'off' ignoring the routes (nothing
installed, no mismatch metric, one warning); which layers' routers megatron reruns in the
backward (recomputes_router). The replay itself: test_routing_replay.py.
"""
import warnings
from types import SimpleNamespace

import torch

from megatron_cispo.testing import spawn
from test_routing_replay import EXPERTS, LAYERS, N, S, TOPK, _batch, _model, _step


def guards_worker():
    from megatron_cispo.runner import distributed

    distributed.init_distributed()
    g = torch.Generator().manual_seed(9)
    return unusable_routers(torch.rand(N, S, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOPK])


def unusable_routers(rand):
    """Routers without the seam (probe patched) and with CUDA graphs on: 'rollout' refused, 'off'
    trains as if the rollouts had no routes."""
    from megatron.core.utils import get_model_config

    from megatron_cispo.step import routing_replay

    out = {}
    saved = routing_replay._seam_missing
    routing_replay._seam_missing = lambda: "no router_replay seam (test)"
    try:
        chunks, opt = _model()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                out["off"] = _step(chunks, opt, _batch(rand.clone()), mode="off")
            except ValueError as e:
                out["off"] = f"{type(e).__name__}: {e}"
        out["said"] = [str(w.message) for w in said if "routing_replay" in str(w.message)]
        out["installed"] = hasattr(chunks[0], routing_replay._ATTR)
        try:
            _step(chunks, opt, _batch(rand.clone()), mode="rollout")
        except ValueError as e:
            out["rollout"] = str(e)
    finally:
        routing_replay._seam_missing = saved
    chunks, opt = _model()
    tcfg = get_model_config(chunks[0])
    tcfg.cuda_graph_impl = "local"  # refused before any forward: no capture, no GPU needed
    try:
        _step(chunks, opt, _batch(rand.clone()), mode="rollout")
    except ValueError as e:
        out["graphs"] = str(e)
    finally:
        tcfg.cuda_graph_impl = "none"
    chunks, opt = _model()
    tcfg = get_model_config(chunks[0])
    balancing, tcfg.moe_router_load_balancing_type = tcfg.moe_router_load_balancing_type, "sinkhorn"
    try:  # read by the check only: the router chose its routing when built
        out["sinkhorn"] = _step(chunks, opt, _batch(rand.clone()), mode="off")
    finally:
        tcfg.moe_router_load_balancing_type = balancing
    out["own"] = _step(*_model(), _batch(), mode="off")  # the same model without routes
    return out


_CACHE: dict = {}


def _runs() -> dict:
    if "runs" not in _CACHE:
        _CACHE["runs"] = {"unusable": spawn(guards_worker, 1, timeout_s=300)[0]}
    return _CACHE["runs"]


def test_off_on_routers_without_the_seam_ignores_the_routes_and_says_so_once():
    runs = _runs()
    u = runs["unusable"]
    assert not isinstance(u["off"], str), u["off"]  # not refused
    metrics, trainer, _ = u["off"]
    own_metrics, own_trainer, _ = u["own"]
    assert not any(k.startswith("moe/route_mismatch") or "fallback" in k for k in metrics)
    assert torch.equal(trainer, own_trainer)  # routed as without routes
    assert metrics["policy/loss"] == own_metrics["policy/loss"]
    assert not u["installed"]
    assert len(u["said"]) == 1 and "routed_experts are ignored" in u["said"][0] and "no router_replay seam" in u["said"][0]
    assert u["rollout"] == "loss.routing_replay='rollout': no router_replay seam (test)"


def test_off_with_a_sinkhorn_config_ignores_the_routes():
    u = _runs()["unusable"]
    metrics, trainer, _ = u["sinkhorn"]
    assert not any(k.startswith("moe/route_mismatch") for k in metrics)
    assert torch.equal(trainer, u["own"][1]) and metrics["policy/loss"] == u["own"][0]["policy/loss"]


def test_rollout_with_cuda_graphs_is_refused_in_one_line():
    runs = _runs()
    msg = runs["unusable"]["graphs"]
    assert msg.startswith("loss.routing_replay='rollout': CUDA graphs are on (cuda_graph_impl='local')")
    assert "\n" not in msg


def test_cuda_graph_settings_by_hand():
    from megatron_cispo.step.routing_replay import cuda_graphs

    assert cuda_graphs(SimpleNamespace(cuda_graph_impl="none")) is None
    assert cuda_graphs(SimpleNamespace()) is None  # a megatron-core without the fields
    assert cuda_graphs(SimpleNamespace(enable_cuda_graph=True, cuda_graph_impl="none")) == "enable_cuda_graph=True"
    assert cuda_graphs(SimpleNamespace(external_cuda_graph=True)) == "external_cuda_graph=True"
    assert cuda_graphs(SimpleNamespace(cuda_graph_impl="transformer_engine")) == "cuda_graph_impl='transformer_engine'"


def test_recomputes_router_by_hand():
    from megatron_cispo.step.routing_replay import recomputes_router

    full = dict(recompute_granularity="full", recompute_num_layers=2, recompute_modules=None)
    assert recomputes_router(SimpleNamespace(**full, recompute_method="uniform"), 5)
    block = SimpleNamespace(**full, recompute_method="block")
    assert [recomputes_router(block, i) for i in (0, 1, 2, None)] == [True, True, False, True]
    sel = dict(recompute_granularity="selective", recompute_method=None, recompute_num_layers=None)
    assert recomputes_router(SimpleNamespace(**sel, recompute_modules=["moe"]), 3)
    assert not recomputes_router(SimpleNamespace(**sel, recompute_modules=["moe_act"]), 0)
    assert not recomputes_router(SimpleNamespace(recompute_granularity=None), 0)
