"""MoE routing replay's data: the routes checked by hand against a model's shape, the samplers
that return them (the demo's torch sampler, the hf engine on qwen3_moe), the YAML spelling of
loss.routing_replay, and the routes travelling with their positions through packing and CP.
The step's replay itself: test_routing_replay.py.
"""
from types import SimpleNamespace

import pytest
import torch

from megatron_cispo.step.routing_replay import check_routes, moe_layer_numbers
from megatron_cispo.testing import spawn
from test_routing_replay import EXPERTS, LAYERS, TOPK, V, _cfg, _model


def sampler_worker():
    """The demo's torch sampler (fp32) on the model's weights: its routes, and moe/route_mismatch
    of a policy step given them (routing_replay off: measured only)."""
    from megatron_cispo.config import LossConfig
    from megatron_cispo.rollout.sampler import Sampler
    from megatron_cispo.runner.experiment import RolloutConfig
    from megatron_cispo.base.weights import gather_full_state
    from megatron_cispo.runner import distributed
    from megatron_cispo.step import Rollouts, StepConfig, policy_step

    distributed.init_distributed()
    chunks, opt = _model()
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


def _stub(**kw):
    return SimpleNamespace(**{"num_layers": 3, "moe_layer_freq": 1, "moe_router_topk": 2, "num_moe_experts": 4,
                              **kw})


def test_check_routes_by_hand():
    ok = torch.tensor([[[[0, 1], [2, 3], [-1, -1]]]])  # [1, 1, 3, 2]
    assert check_routes(ok, _stub()) is None
    bad = ok.clone()
    bad[0, 0, 2] = torch.tensor([-1, 5])  # a -1 token is unrouted, but 5 is still out of range
    assert "sample 0 (global index), MoE layer 2 (model layer 3), position 0: expert 5 is outside [0, 4)" \
        in check_routes(bad, _stub())
    assert "sample 7 (global index), MoE layer 2" in check_routes(bad, _stub(), row_ids=torch.tensor([7]))
    bad[0, 0, 2] = torch.tensor([-2, 1])
    assert "expert -2 is outside" in check_routes(bad, _stub())
    assert moe_layer_numbers(_stub(moe_layer_freq=2)) == [1, 3]
    assert moe_layer_numbers(_stub(moe_layer_freq=[0, 1, 1])) == [2, 3]
    assert "expected [n, s, 2, 2]" in check_routes(ok, _stub(moe_layer_freq=[0, 1, 1]))


def test_the_torch_sampler_returns_the_routes_it_used():
    runs = {"sampler": spawn(sampler_worker, 1, timeout_s=300)[0]}
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
    from megatron_cispo.rollout.sampler import Sampler
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.experiment import RolloutConfig
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.base.weights import gather_full_state
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


def test_train_says_bad_routes_once_from_rank_0_without_a_traceback(capsys, monkeypatch, tmp_path):
    """policy_step raises BadRoutes alike on every rank; python -m megatron_cispo.train prints it
    from rank 0 only, in one line, exit 7 on every rank."""
    from pathlib import Path

    import megatron_cispo.runner.loop as loop
    import megatron_cispo.train as train
    from megatron_cispo.step.routing_replay import BadRoutes

    def run(cfg, finish=None):
        raise BadRoutes("rollouts.routed_experts: sample 6 (global index), MoE layer 1 ...")
    monkeypatch.setattr(loop, "run", run)
    monkeypatch.setattr(train, "SPEAK_FIRST_S", 0.0)
    demo = str(Path(__file__).resolve().parents[2] / "yaml_configs" / "demo_cpu.yaml")
    for rank, said in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        assert train.main([demo, "--world-size", "4", f"run.run_dir={tmp_path}"]) == train.EXIT_ROLLOUT_FAILED
        err = capsys.readouterr().err
        assert err.count("sample 6 (global index)") == said and "Traceback" not in err
