"""The sampler's plain-torch GPT, fed by the weight sync, scores tokens exactly as the megatron trainer.

This is what makes the old anchor's ratio exactly 1 and the rollout anchor differ from it only
through staleness and sampler precision.
"""
import pytest
import torch

from megatron_cispo.testing import spawn


def sampler_vs_trainer_worker(tp, pp, temperature):
    from megatron_cispo.runner import distributed
    from megatron_cispo.config import LossConfig
    from megatron_cispo.rollout.torch_engine import TorchGPT
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.base.weights import gather_full_state
    from megatron_cispo.step import Rollouts, StepConfig, compute_logprobs, policy_step

    distributed.init_distributed(tp=tp, pp=pp)
    cfg = ModelConfig(vocab_size=16, seq_length=12, hidden_size=32, num_layers=2, num_attention_heads=4)
    chunks = build_model(cfg, tp=tp, pp=pp, seed=5)
    opt = build_optimizer(chunks, lr=1e-2, clip_grad=0.0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (8, 11), generator=g)
    batch = Rollouts(tokens=tokens, loss_mask=torch.ones(8, 10, dtype=torch.bool), advantages=torch.randn(8, generator=g))
    policy_step(chunks, opt, batch, LossConfig(), StepConfig(micro_batch_size=4))  # move off the init
    trainer = compute_logprobs(chunks, batch, StepConfig(micro_batch_size=4, temperature=temperature))
    engine = TorchGPT(gather_full_state(chunks), cfg, dtype=torch.float32)
    logits = engine.logits(tokens[:, :-1]).float() / temperature
    sampler = torch.log_softmax(logits, -1).gather(2, tokens[:, 1:].unsqueeze(2)).squeeze(2)
    return (trainer - sampler).abs().max().item()


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (2, 2)])
def test_fp32_sampler_logprobs_match_megatron_within_1e4(tp, pp):
    for err in spawn(sampler_vs_trainer_worker, tp * pp, (tp, pp, 0.8), timeout_s=240):
        assert err < 1e-4
