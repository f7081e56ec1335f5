"""The sampler's plain-torch GPT reproduces a megatron-core MoE GPTModel (local spec, SequentialMLP
experts, TopKRouter) from its full state: same routing, same expert mix, same logits in fp32."""
import pytest
import torch

from megatron_cispo.rollout.torch_engine import TorchGPT
from megatron_cispo.runner.model import ModelConfig
from megatron_cispo.testing import spawn

ROUTER_SCALE = 10.0  # spreads the router logits so no token's top-k choice is a near-tie


def _cfg(experts: int, topk: int) -> ModelConfig:
    return ModelConfig(vocab_size=16, seq_length=12, hidden_size=16, num_layers=2, num_attention_heads=2,
                       ffn_hidden_size=24, init_std=0.1, num_moe_experts=experts, moe_router_topk=topk)


def megatron_moe_worker(experts, topk):
    """One process: the megatron MoE GPT's logits on random tokens, its full state, and the
    smallest gap between a token's k-th and (k+1)-th router logit over every layer."""
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import build_model
    from megatron_cispo.base.weights import gather_full_state

    distributed.init_distributed()
    cfg = _cfg(experts, topk)
    model = build_model(cfg, tp=1, pp=1, seed=11, wrap_ddp=False)[0].eval()
    assert model.config.moe_router_pre_softmax == (topk == 1)
    gaps = []

    def margin(router, inputs, _out):
        logits = (inputs[0].float() @ router.weight.float().t()).sort(-1, descending=True).values
        gaps.append((logits[..., topk - 1] - logits[..., topk]).min() if topk < experts else torch.tensor(1.0))

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.mul_(ROUTER_SCALE)
        hooks = [m.register_forward_hook(margin) for n, m in model.named_modules() if n.endswith("mlp.router")]
        tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length), generator=torch.Generator().manual_seed(0))
        logits = model(tokens, torch.arange(cfg.seq_length).expand_as(tokens), None)
    for h in hooks:
        h.remove()
    routed = {n: int(p.numel()) for n, p in model.named_parameters() if "local_experts" in n}
    return {"tokens": tokens, "logits": logits.detach().float().cpu(), "state": gather_full_state([model]),
            "min_gap": min(g.item() for g in gaps), "expert_params": routed}


@pytest.fixture(scope="module", params=[(4, 2), (3, 1)], ids=["top2_of_4", "top1_of_3"])
def megatron_moe(request):
    experts, topk = request.param
    return _cfg(experts, topk), spawn(megatron_moe_worker, 1, (experts, topk), timeout_s=120)[0]


def test_torch_gpt_reproduces_megatron_moe_logits_in_fp32(megatron_moe):
    cfg, ref = megatron_moe
    assert ref["min_gap"] > 1e-3, "router top-k choice is a near-tie; raise ROUTER_SCALE"
    assert any(".experts.local_experts.0." in n for n in ref["state"])
    logits = TorchGPT(ref["state"], cfg, dtype=torch.float32).logits(ref["tokens"])
    torch.testing.assert_close(logits, ref["logits"], atol=1e-5, rtol=0)


def test_torch_gpt_reads_grouped_gemm_expert_names(megatron_moe):
    """TEGroupedMLP's experts.linear_fc1.weight<i> names give the same model as local_experts.<i>."""
    cfg, ref = megatron_moe
    grouped = {}
    for name, t in ref["state"].items():
        if ".local_experts." in name:
            head, tail = name.split(".local_experts.")
            i, linear, kind = tail.split(".")
            name = f"{head}.{linear}.{kind}{i}"
        grouped[name] = t
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight0" in grouped
    local = TorchGPT(ref["state"], cfg).logits(ref["tokens"])
    assert torch.equal(TorchGPT(grouped, cfg).logits(ref["tokens"]), local)


def test_torch_gpt_names_a_missing_expert_weight(megatron_moe):
    cfg, ref = megatron_moe
    gone = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"
    with pytest.raises(KeyError, match=r"lacks 1 GPTModel parameters.*local_experts\.2\.linear_fc2"):
        TorchGPT({k: v for k, v in ref["state"].items() if k != gone}, cfg)


def test_bf16_moe_sampler_rolls_out_a_variable_length_batch(megatron_moe):
    """The stale sampler runs the MoE state in bf16 (routing in fp32) on the dedup task."""
    from megatron_cispo.rollout.sampler import Sampler
    from megatron_cispo.runner.experiment import RolloutConfig
    from megatron_cispo.step import Rollouts

    cfg, ref = megatron_moe
    bf16 = TorchGPT(ref["state"], cfg, dtype=torch.bfloat16).logits(ref["tokens"])
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), ref["logits"], atol=0.05, rtol=0)
    s = Sampler(cfg, RolloutConfig(task="dedup", digits=2, prompts_per_step=4, group_size=2, precision="bf16"), seed=0)
    s.sync(0, ref["state"])
    batch = s.rollouts(0)
    assert batch.tokens.shape == (8, s.task.total_len) and batch.rollout_logprobs.dtype == torch.float32
    Rollouts(**batch.rollout_fields())
