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
"""
from types import SimpleNamespace

import pytest
import torch

from megatron_cispo.step.routing_replay import check_routes, moe_layer_numbers
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
    """Each router's routing map [tokens, E] in training forwards, as (moe index, map)."""
    def hook(router, args, out):
        if router.training and torch.is_grad_enabled():
            seen.append((router.layer_number - 1, out[1].detach().clone()))
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
    if recompute:
        tcfg.recompute_granularity, tcfg.recompute_method, tcfg.recompute_num_layers = "full", "uniform", 1
    try:
        loss = {"routing_replay": mode, **({"kl": {"coef": 0.1}} if ref is not None else {})}
        metrics = policy_step(chunks, opt, batch, from_dict(LossConfig, loss),
                              StepConfig(micro_batch_size=2, old_logprob_pass=old_pass), ref_chunks=ref)
    finally:
        tcfg.recompute_granularity = None
        for h in hooks:
            h.remove()
    own = {}
    for layer, m in seen:  # per layer, the microbatches' maps [s, b, E] back to [n, s, k]
        own.setdefault(layer, []).append(_map_to_routes(m).view(S, 2, TOPK).transpose(0, 1))
    return metrics, torch.stack([torch.cat(own[j]) for j in sorted(own)], 2)


def replay_worker():
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.weights import gather_full_state

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
    out["errors"] = {}
    for name, routes in (("range", torch.where(rand == 3, 4, rand)), ("dup", rand.clone()),
                         ("shape", rand[:, :, :1].clone()), ("none", None)):
        if name == "dup":
            routes[2, 4, 1] = torch.tensor([1, 1])
        try:
            _step(chunks, opt, _batch(routes))
        except ValueError as e:
            out["errors"][name] = str(e)
    out["sampler"] = sampler_routes(chunks, opt)
    out["grad"] = router_grad(_model(wrap_ddp=False)[0])  # unwrapped: the gradient lands in .grad
    dense, dopt = _model(num_moe_experts=None)
    try:
        _step(dense, dopt, _batch(rand.clone()))
    except ValueError as e:
        out["errors"]["dense"] = str(e)
    return out


def sampler_routes(chunks, opt):
    """The demo's torch sampler (fp32) on the model's weights: its routes, and moe/route_mismatch
    of a policy step given them (routing_replay off: measured only)."""
    from megatron_cispo.config import LossConfig
    from megatron_cispo.demo.sampler import Sampler
    from megatron_cispo.runner.experiment import RolloutConfig
    from megatron_cispo.runner.weights import gather_full_state
    from megatron_cispo.step import Rollouts, StepConfig, policy_step

    out = {}
    for precision in ("fp32", "bf16"):
        sampler = Sampler(_cfg(), RolloutConfig(precision=precision, prompts_per_step=4, group_size=2), seed=0)
        sampler.sync(0, gather_full_state(chunks))
        batch = sampler.rollouts(0)
        layers: list = []
        sampler.engine(0).logits(batch.tokens[:, :-1], routes=layers)  # one forward over every input position
        rollouts = Rollouts(**batch.rollout_fields())
        metrics = policy_step(chunks, opt, rollouts, LossConfig(), StepConfig(micro_batch_size=8)) \
            if precision == "fp32" else None
        out[precision] = {"routes": batch.routed_experts, "one_forward": torch.stack(layers, 2),
                          "lengths": batch.lengths, "metrics": metrics}
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
    metrics, trainer = runs["replay_recorded"]
    assert torch.equal(trainer, runs["recorded"])
    assert metrics["moe/route_mismatch"] == 0.0 and metrics["moe/replay_fallbacks"] == 0.0


def _expected_mismatch(recorded, given):
    routed = (given >= 0).all(-1)
    differs = (recorded.sort(-1).values != given.sort(-1).values).any(-1) & routed
    return differs, routed


def test_given_routes_are_followed_and_fallback_tokens_keep_the_router_choice(runs):
    rec, rand = runs["recorded"], runs["random"]
    differs, routed = _expected_mismatch(rec, rand)
    metrics, trainer = runs["replay_random"]
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
    assert 0.3 < metrics["moe/route_mismatch"] < 1.0


def test_off_routes_as_the_router_does_and_counts_the_mismatch_exactly(runs):
    rec, rand = runs["recorded"], runs["random"]
    differs, routed = _expected_mismatch(rec, rand)
    metrics, trainer = runs["measure_random"]
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
    m, trainer = runs["recompute_random"]
    assert torch.equal(trainer[..., :], runs["replay_random"][1])
    assert m["moe/route_mismatch"] == runs["replay_random"][0]["moe/route_mismatch"]  # recompute not counted
    for k, v in runs["state_random"].items():
        torch.testing.assert_close(runs["state_recompute"][k], v, rtol=0, atol=1e-6, msg=k)


def test_the_router_weight_keeps_its_gradient_from_the_dense_scores(runs):
    g = runs["grad"]
    assert g["got"].abs().sum() > 0
    torch.testing.assert_close(g["got"], g["hand"], rtol=1e-5, atol=1e-7)
    assert torch.equal(_map_to_routes(g["map"]), g["idx"].sort(-1).values)


def test_bad_routes_are_refused_naming_sample_layer_and_position(runs):
    e = runs["errors"]
    assert e["range"].startswith("rollouts.routed_experts: sample ") and "expert 4 is outside [0, 4)" in e["range"]
    assert "sample 2, MoE layer 1 (model layer 2), position 4: expert 1 appears twice" in e["dup"]
    assert "expected [n, s, 2, 2]" in e["shape"]
    assert "rollouts carry no routed_experts" in e["none"]
    assert "the model is dense" in e["dense"]


def _stub(**kw):
    return SimpleNamespace(**{"num_layers": 3, "moe_layer_freq": 1, "moe_router_topk": 2, "num_moe_experts": 4,
                              **kw})


def test_check_routes_by_hand():
    ok = torch.tensor([[[[0, 1], [2, 3], [-1, -1]]]])  # [1, 1, 3, 2]
    assert check_routes(ok, _stub()) is None
    bad = ok.clone()
    bad[0, 0, 2] = torch.tensor([-1, 5])  # a -1 token is unrouted, but 5 is still out of range
    assert "sample 0, MoE layer 2 (model layer 3), position 0: expert 5 is outside [0, 4)" in check_routes(bad, _stub())
    bad[0, 0, 2] = torch.tensor([-2, 1])
    assert "expert -2 is outside" in check_routes(bad, _stub())
    assert moe_layer_numbers(_stub(moe_layer_freq=2)) == [1, 3]
    assert moe_layer_numbers(_stub(moe_layer_freq=[0, 1, 1])) == [2, 3]
    assert "expected [n, s, 2, 2]" in check_routes(ok, _stub(moe_layer_freq=[0, 1, 1]))


def test_the_torch_sampler_returns_the_routes_it_used(runs):
    fp32 = runs["sampler"]["fp32"]
    n, s = fp32["lengths"].shape[0], fp32["one_forward"].shape[1]
    assert fp32["routes"].shape == (n, s, LAYERS, TOPK)
    # prefill + one decode step per token equals one causal forward over the final tokens (fp32)
    assert torch.equal(fp32["routes"], fp32["one_forward"])
    # and the trainer's routers agree with it on every real token: mismatch 0, nothing to fall back
    m = fp32["metrics"]
    assert m["moe/route_mismatch"] == 0.0 and m["moe/replay_fallbacks"] == 0.0
    assert runs["sampler"]["bf16"]["routes"].shape == (n, s, LAYERS, TOPK)


def test_a_bare_yaml_off_is_routing_replay_off():
    """PyYAML reads `routing_replay: off` as False; the documented spelling must load."""
    import yaml

    from megatron_cispo.config import LossConfig, from_dict

    assert from_dict(LossConfig, yaml.safe_load("routing_replay: off")).routing_replay == "off"
    assert from_dict(LossConfig, {"routing_replay": "rollout"}).routing_replay == "rollout"
    with pytest.raises(ValueError, match="routing_replay"):
        from_dict(LossConfig, {"routing_replay": True})


def hf_worker(path):
    """The hf engine (transformers qwen3_moe) as sampler of a megatron model loaded from the same
    checkpoint: its routes, and the trainer's moe/route_mismatch against them (fp32, replay off)."""
    from megatron_cispo.config import LossConfig
    from megatron_cispo.demo.sampler import Sampler
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.experiment import RolloutConfig
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.runner.weights import gather_full_state
    from megatron_cispo.step import Rollouts, StepConfig, policy_step

    distributed.init_distributed()
    mcfg = ModelConfig(hf_path=path)
    chunks = build_model(mcfg, tp=1, pp=1, seed=3)
    sampler = Sampler(mcfg, RolloutConfig(engine="hf", precision="fp32", prompts_per_step=4, group_size=2,
                                          digits=3, staleness=0), seed=0)
    sampler.sync(0, gather_full_state(chunks))
    batch = sampler.rollouts(0)
    metrics = policy_step(chunks, build_optimizer(chunks, lr=0.0, optimizer="sgd"), Rollouts(**batch.rollout_fields()),
                          LossConfig(), StepConfig(micro_batch_size=8))
    return {"routes": batch.routed_experts, "metrics": metrics, "top_k": mcfg.moe_router_topk}


def test_the_hf_sampler_returns_routes_the_trainer_agrees_with(tmp_path):
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    res = spawn(hf_worker, 1, (str(make_tiny_hf("qwen3_moe", tmp_path / "q", seed=1)),), timeout_s=300)[0]
    assert res["routes"].dim() == 4 and res["routes"].shape[-1] == res["top_k"]
    assert res["metrics"]["moe/route_mismatch"] == 0.0


def test_routes_are_checked_for_layout_and_travel_with_their_positions_through_packing_and_cp():
    from megatron_cispo.step import Rollouts
    from megatron_cispo.step.packing import Layout, packed_microbatches, padded_microbatches

    g = torch.Generator().manual_seed(1)
    n, s = 4, 9
    tokens = torch.randint(0, V, (n, s + 1), generator=g)
    lengths = torch.tensor([10, 5, 8, 3])
    routes = torch.rand(n, s, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOPK]
    kw = dict(tokens=tokens, loss_mask=torch.ones(n, s, dtype=torch.bool) & (torch.arange(s) < lengths[:, None] - 1),
              advantages=torch.ones(n), lengths=lengths)
    with pytest.raises(ValueError, match=r"routed_experts must be an int \[n, s, moe_layers, top_k\] tensor with "
                                         r"\[n, s\] = \(4, 9\).*got torch.int64 \(4, 10, 2, 2\)"):
        Rollouts(**kw, routed_experts=torch.zeros(n, s + 1, LAYERS, TOPK, dtype=torch.long))
    with pytest.raises(ValueError, match="routed_experts must be an int"):
        Rollouts(**kw, routed_experts=routes.float())
    batch = Rollouts(**kw, routed_experts=routes)
    assert torch.equal(batch.rows(torch.tensor([2, 0])).routed_experts, routes[[2, 0]])
    weights = (torch.zeros(n, s), torch.zeros(n, s))
    flat = routes.reshape(n * s, LAYERS, TOPK)
    mbs = [mb for r in range(2) for mb in packed_microbatches(batch, weights, [[0, 1], [2, 3]],
                                                              layout=Layout(cp=2, cp_rank=r, pad_multiple=4))]
    mbs += padded_microbatches(batch, weights, micro_batch_size=2, layout=Layout(pad_multiple=4))
    pads = 0
    for mb in mbs:
        idx, got = mb.gather_index.reshape(-1), mb.routed_experts.reshape(-1, LAYERS, TOPK)
        real = idx >= 0
        assert torch.equal(got[real], flat[idx[real]])
        assert (got[~real] == -1).all()  # padding: no route (the router's own)
        pads += int((~real).sum())
    assert pads > 0
