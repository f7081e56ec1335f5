"""MoE routing replay (step.routing_replay, loss.routing_replay): one process, a 2-layer MoE GPT.

1. The routes checked against the model: out of range, a duplicate, a wrong shape, each named by
   sample, layer and position; 'rollout' refused without routes or on a dense model.
2. Routes recorded from the model itself: the trainer routes exactly as recorded, mismatch 0.
3. Random valid routes with some -1 tokens: the trainer routes the given experts where a token has
   a route and its own where not; moe/route_mismatch and the fallbacks counted exactly; with an
   always-run pi_old pass the old-anchored ratio is 1 (the pi_old pass replays too), and the KL to
   an identical reference model is 0 (the reference pass replays too).
4. The router weight's gradient under replay equals a hand reference that gathers the same experts
   from the dense logits, and is nonzero.
5. Activation recompute of the whole layer in the backward replays the same routes (FIFO).
Routers that cannot take routes, and recomputes_router: test_routing_replay_guards.py. The
routes' checks by hand, the samplers and packing: test_routing_replay_data.py.
"""

import pytest
import torch

from megatron_cispo.testing import spawn

S, V, N, EXPERTS, TOPK, LAYERS = 11, 16, 4, 4, 2, 2
ROUTER_SCALE = 10.0  # spreads router logits: no near-tie (the recorded routes are then exact)


def _cfg(**kw):
    from megatron_cispo.runner.model import ModelConfig

    return ModelConfig(vocab_size=V, seq_length=S + 1, hidden_size=16, num_layers=LAYERS, num_attention_heads=2,
                       ffn_hidden_size=24, init_std=0.1, **{"num_moe_experts": EXPERTS, "moe_router_topk": TOPK, **kw})


def _model(wrap_ddp=True, **kw):
    from megatron_cispo.runner.model import build_model, build_optimizer

    chunks = build_model(_cfg(**kw), tp=1, pp=1, seed=3, wrap_ddp=wrap_ddp)
    if not wrap_ddp:
        return chunks, None
    with torch.no_grad():
        for name, p in chunks[0].named_parameters():
            if name.endswith("router.weight"):
                p.mul_(ROUTER_SCALE)
    return chunks, build_optimizer(chunks, lr=0.5, optimizer="sgd", clip_grad=0.0)


def _routers(chunks):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]


def _watch(chunks, seen: list):
    """Each router's routing map [tokens, E] in training forwards, and its own top-k by hand from
    its input (softmax keeps the logits' order; no expert bias), as (moe index, map, own [tokens, k])."""
    def hook(router, args, out):
        if router.training and torch.is_grad_enabled():
            x = args[0].detach()
            own = (x.reshape(-1, x.shape[-1]).float() @ router.weight.detach().float().t()).topk(TOPK, -1).indices
            seen.append((router.layer_number - 1, out[1].detach().clone(), own.sort(-1).values))
    return [r.register_forward_hook(hook) for r in _routers(chunks)]


def _map_to_routes(m: torch.Tensor) -> torch.Tensor:
    return m.nonzero()[:, 1].view(m.shape[0], TOPK)  # sorted expert ids per token (dropless)


def _batch(routes=None):
    from megatron_cispo.step import Rollouts

    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, V, (N, S + 1), generator=g)
    mask = torch.zeros(N, S, dtype=torch.bool)
    mask[:, 3:] = True
    return Rollouts(tokens=tokens, loss_mask=mask, advantages=torch.randn(N, generator=g), routed_experts=routes)


def _record(chunks, batch):
    """routes [n, s, L, k] of the model's own choice on the batch (one eval forward)."""
    seen = []

    def hook(router, args, out):
        seen.append(_map_to_routes(out[1]).view(S, N, TOPK).transpose(0, 1))
    hooks = [r.register_forward_hook(hook) for r in _routers(chunks)]
    with torch.no_grad():
        chunks[0].eval()
        chunks[0](batch.tokens[:, :-1], torch.arange(S).expand(N, S), None)
        chunks[0].train()
    for h in hooks:
        h.remove()
    return torch.stack(seen, 2)


def _step(chunks, opt, batch, mode="rollout", old_pass="auto", recompute=False, ref=None):
    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.step import StepConfig, policy_step

    seen = []
    hooks = _watch(chunks, seen)
    from megatron.core.utils import get_model_config
    tcfg = get_model_config(chunks[0])
    if recompute:  # True: every layer reruns; "block": only the first (recompute_num_layers=1)
        tcfg.recompute_granularity, tcfg.recompute_num_layers = "full", 1
        tcfg.recompute_method = "block" if recompute == "block" else "uniform"
    try:
        loss = {"routing_replay": mode, **({"kl": {"coef": 0.1}} if ref is not None else {})}
        metrics = policy_step(chunks, opt, batch, from_dict(LossConfig, loss),
                              StepConfig(micro_batch_size=2, old_logprob_pass=old_pass), ref_chunks=ref)
    finally:
        tcfg.recompute_granularity = None
        for h in hooks:
            h.remove()
    maps, own = {}, {}
    for layer, m, o in seen:  # per layer, the microbatches' maps [s, b, E] back to [n, s, k]
        maps.setdefault(layer, []).append(_map_to_routes(m).view(S, 2, TOPK).transpose(0, 1))
        own.setdefault(layer, []).append(o.view(S, 2, TOPK).transpose(0, 1))
    stack = lambda d: torch.stack([torch.cat(d[j]) for j in sorted(d)], 2)  # noqa: E731
    return metrics, stack(maps), stack(own)  # the routes taken, and the routers' own top-k


def replay_worker():
    from megatron_cispo.runner import distributed
    from megatron_cispo.base.weights import gather_full_state

    distributed.init_distributed()
    out = {}
    chunks, opt = _model()
    plain = _batch()
    recorded = _record(chunks, plain)
    g = torch.Generator().manual_seed(9)
    rand = torch.rand(N, S, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOPK]
    rand[0, 2, 1] = -1  # fallbacks: one token in layer 1, two in layer 0
    rand[1, 5:7, 0, 0] = -1
    out["recorded"], out["random"] = recorded, rand
    out["replay_recorded"] = _step(chunks, opt, _batch(recorded.clone()))
    chunks, opt = _model()
    out["measure_random"] = _step(chunks, opt, _batch(rand.clone()), mode="off")
    chunks, opt = _model()
    out["replay_random"] = _step(chunks, opt, _batch(rand.clone()), old_pass="always", ref=_model()[0])
    out["state_random"] = gather_full_state(chunks)
    chunks, opt = _model()  # the same, but the forward-only pi_old pass not replaying: the ratio moves
    from megatron_cispo.step import routing_replay
    saved = routing_replay.LayerReplay.set
    routing_replay.LayerReplay.set = lambda self, r, v, *, training, **kw: saved(
        self, r if training else torch.full_like(r, -1), v, training=training, **kw)  # eval passes: all fall back
    try:
        out["old_unreplayed"] = _step(chunks, opt, _batch(rand.clone()), old_pass="always", ref=_model()[0])
    finally:
        routing_replay.LayerReplay.set = saved
    chunks, opt = _model()
    out["recompute_random"] = _step(chunks, opt, _batch(rand.clone()), old_pass="always", recompute=True,
                                    ref=_model()[0])
    out["state_recompute"] = gather_full_state(chunks)
    chunks, opt = _model()  # 'block' recompute of layer 0 only: layer 1's router queues nothing
    queued = {}
    saved = routing_replay.LayerReplay.set
    routing_replay.LayerReplay.set = lambda self, *a, **kw: (saved(self, *a, **kw), queued.setdefault(
        self.moe_index, []).append(len(self.fifo)))[0]
    try:
        out["block_random"] = _step(chunks, opt, _batch(rand.clone()), old_pass="always", recompute="block",
                                    ref=_model()[0])
    finally:
        routing_replay.LayerReplay.set = saved
    out["block_queued"], out["state_block"] = queued, gather_full_state(chunks)
    out["errors"] = {}
    for name, routes in (("range", torch.where(rand == 3, 4, rand)), ("dup", rand.clone()),
                         ("shape", rand[:, :, :1].clone()), ("none", None)):
        if name == "dup":
            routes[2, 4, 1] = torch.tensor([1, 1])
        try:
            _step(chunks, opt, _batch(routes))
        except ValueError as e:
            out["errors"][name] = f"{type(e).__name__}: {e}"
    out["grad"] = router_grad(_model(wrap_ddp=False)[0])  # unwrapped: the gradient lands in .grad
    dense, dopt = _model(num_moe_experts=None)
    try:
        _step(dense, dopt, _batch(rand.clone()))
    except ValueError as e:
        out["errors"]["dense"] = str(e)
    return out


def router_grad(chunks):
    """A router's weight gradient with a replayed route per token, and by hand from the dense
    logits gathered at the same experts (softmax over the k gathered logits: top-k > 1)."""
    from megatron_cispo.step.routing_replay import install
    from megatron.core.utils import get_model_config

    router = _routers(chunks)[0]
    layer = [r for r in install(chunks[0], get_model_config(chunks[0])) if r.moe_index == 0][0]
    x = torch.randn(6, 1, 16, generator=torch.Generator().manual_seed(2))
    routes = torch.tensor([[0, 1], [2, 3], [3, 0], [1, 2], [-1, -1], [0, 2]])
    c = torch.randn(6, EXPERTS, generator=torch.Generator().manual_seed(3))
    router.zero_grad()
    layer.set(routes, torch.ones(6, dtype=torch.bool), training=False)
    try:
        probs, rmap = router(x)
    finally:
        layer.clear()
        layer.fifo = []
    (probs * c).sum().backward()
    got = router.weight.grad.clone()
    w = router.weight.detach().clone().requires_grad_()
    logits = x.view(6, 16) @ w.t()
    idx = torch.where(routes >= 0, routes, logits.topk(TOPK, -1).indices)
    hand = torch.zeros(6, EXPERTS).scatter(1, idx, torch.softmax(logits.gather(1, idx), -1))
    (hand * c).sum().backward()
    return {"got": got, "hand": w.grad, "map": rmap, "idx": idx}


@pytest.fixture(scope="module")
def runs():
    return spawn(replay_worker, 1, timeout_s=300)[0]


def test_routes_recorded_from_the_model_replay_exactly_with_no_mismatch(runs):
    metrics, trainer, _ = runs["replay_recorded"]
    assert torch.equal(trainer, runs["recorded"])
    assert metrics["moe/route_mismatch"] == 0.0 and metrics["moe/replay_fallbacks"] == 0.0


def _expected_mismatch(recorded, given):
    routed = (given >= 0).all(-1)
    differs = (recorded.sort(-1).values != given.sort(-1).values).any(-1) & routed
    return differs, routed


def test_given_routes_are_followed_and_fallback_tokens_keep_the_router_choice(runs):
    rec, rand = runs["recorded"], runs["random"]
    differs, routed = _expected_mismatch(rec, rand)
    metrics, trainer, own = runs["replay_random"]
    assert torch.equal(trainer[routed], rand.sort(-1).values[routed])
    # layer 0 sees the same input as when recorded: its fallback tokens route as recorded (layer 1's
    # input changed with layer 0's replayed experts, so its own choice may differ from the record)
    assert torch.equal(trainer[:, :, 0][~routed[:, :, 0]], rec[:, :, 0][~routed[:, :, 0]])
    assert metrics["moe/replay_fallbacks"] == 3.0
    assert metrics["moe/replay_fallback_frac"] == pytest.approx(3 / routed.numel())
    # layer 0's mismatch is against the recorded (own) routes; overall the router's own top-k is
    # taken before replay, on layer 1's replayed input
    assert metrics["moe/route_mismatch_l0"] == pytest.approx(
        differs[:, :, 0].sum().item() / routed[:, :, 0].sum().item(), rel=1e-12)
    # layer 1's own top-k (by hand from its replayed input) against the given routes: the exact whole
    assert torch.equal(own[:, :, 0], rec[:, :, 0])
    own_differs, _ = _expected_mismatch(own, rand)
    assert metrics["moe/route_mismatch"] == pytest.approx(own_differs.sum().item() / routed.sum().item(), rel=1e-12)
    assert metrics["moe/route_mismatch_l1"] == pytest.approx(
        own_differs[:, :, 1].sum().item() / routed[:, :, 1].sum().item(), rel=1e-12)


def test_off_routes_as_the_router_does_and_counts_the_mismatch_exactly(runs):
    rec, rand = runs["recorded"], runs["random"]
    differs, routed = _expected_mismatch(rec, rand)
    metrics, trainer, _ = runs["measure_random"]
    assert torch.equal(trainer, rec)
    assert metrics["moe/route_mismatch"] == pytest.approx(differs.sum().item() / routed.sum().item(), rel=1e-12)
    for j in range(LAYERS):
        assert metrics[f"moe/route_mismatch_l{j}"] == pytest.approx(
            differs[:, :, j].sum().item() / routed[:, :, j].sum().item(), rel=1e-12)
    assert metrics["moe/replay_fallbacks"] == 3.0


def test_the_pi_old_pass_replays_so_the_old_anchored_ratio_is_one(runs):
    m = runs["replay_random"][0]
    assert m["step/old_logprob_pass"] == 1.0
    assert m["cispo/ratio_min"] == pytest.approx(1.0, abs=1e-6) and m["cispo/ratio_max"] == pytest.approx(1.0, abs=1e-6)
    m = runs["old_unreplayed"][0]  # the check can fail: a pi_old pass routing on its own moves the ratio
    assert m["cispo/ratio_max"] - m["cispo/ratio_min"] > 1e-3


def test_the_reference_pass_replays_so_an_identical_reference_has_zero_kl(runs):
    assert abs(runs["replay_random"][0]["policy/kl"]) < 1e-9  # the reference is the initial policy
    assert runs["old_unreplayed"][0]["policy/kl"] > 1e-4  # a reference routing on its own drifts


def test_activation_recompute_replays_the_same_routes_in_the_backward(runs):
    m, trainer, _ = runs["recompute_random"]
    assert torch.equal(trainer[..., :], runs["replay_random"][1])
    assert m["moe/route_mismatch"] == runs["replay_random"][0]["moe/route_mismatch"]  # recompute not counted
    for k, v in runs["state_random"].items():
        torch.testing.assert_close(runs["state_recompute"][k], v, rtol=0, atol=1e-6, msg=k)


def test_block_recompute_queues_routes_only_for_the_layers_it_reruns(runs):
    m, trainer, _ = runs["block_random"]
    assert torch.equal(trainer, runs["replay_random"][1])
    q = runs["block_queued"]  # FIFO length after each set: layer 0 queues per training forward, layer 1 never
    assert max(q[0]) >= 1 and max(q[1]) == 0
    for k, v in runs["state_random"].items():
        torch.testing.assert_close(runs["state_block"][k], v, rtol=0, atol=1e-6, msg=k)


def test_the_router_weight_keeps_its_gradient_from_the_dense_scores(runs):
    g = runs["grad"]
    assert g["got"].abs().sum() > 0
    torch.testing.assert_close(g["got"], g["hand"], rtol=1e-5, atol=1e-7)
    assert torch.equal(_map_to_routes(g["map"]), g["idx"].sort(-1).values)


def test_bad_routes_are_refused_naming_sample_layer_and_position(runs):
    e = runs["errors"]
    assert e["range"].startswith("BadRoutes: rollouts.routed_experts: sample ") and "expert 4 is outside [0, 4)" in e["range"]
    assert "BadRoutes: " in e["dup"]
    assert "sample 2 (global index), MoE layer 1 (model layer 2), position 4: expert 1 appears twice" in e["dup"]
    assert "expected [n, s, 2, 2]" in e["shape"]
    assert "rollouts carry no routed_experts" in e["none"]
    assert "the model is dense" in e["dense"]
