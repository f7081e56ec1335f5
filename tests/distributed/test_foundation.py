"""Real megatron-core (GPTModel, DDP, optimizer, pipeline schedule) on CPU over gloo.

Every layout must reproduce the single-process loss, grad norm and post-step parameters.
"""
import pytest
import torch

from megatron_cispo.testing import RankFailed, spawn

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)]
B, S, V, MICRO = 8, 16, 64, 4


def lm_train_step(chunks, opt) -> tuple:
    """One next-token cross-entropy step on the B x (S+1) random batch, this rank's DP share in
    MICRO microbatches, through get_forward_backward_func: (lm [loss_sum, tokens] summed over
    this rank's microbatches, or None off the last stage; grad norm)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    data = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(0))
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    micro = list(data.chunk(dp)[dp_rank].chunk(MICRO // dp))

    def forward_step(it, model):
        mb = next(it)
        tokens, labels = mb[:, :-1], mb[:, 1:]
        logits = model(tokens, torch.arange(S).expand_as(tokens), None)  # [b, s, v/tp]

        def loss_func(out):
            loss = vocab_parallel_cross_entropy(out.float().clone(), labels)
            n = torch.tensor(loss.numel(), dtype=torch.int)  # the microbatch's tokens (an MoE router's count)
            return loss.sum(), n, {"lm": torch.stack([loss.sum().detach(), n.float()])}
        return logits, loss_func

    opt.zero_grad()
    for c in chunks:
        c.zero_grad_buffer()
    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=chunks[0],
        num_microbatches=len(micro), seq_length=S, micro_batch_size=micro[0].shape[0],
        forward_only=False)
    _, grad_norm, _ = opt.step()
    return (torch.stack([r["lm"] for r in reports]).sum(0) if reports else None), grad_norm


def lm_step_worker(tp, pp):
    """One cross-entropy training step through get_forward_backward_func; returns what to compare."""
    from megatron.core import parallel_state as mpu

    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.base.weights import gather_full_state

    distributed.init_distributed(tp=tp, pp=pp)
    cfg = ModelConfig(vocab_size=V, seq_length=S, hidden_size=32, num_layers=4, num_attention_heads=4)
    chunks = build_model(cfg, tp=tp, pp=pp, seed=7)
    opt = build_optimizer(chunks, lr=0.5, optimizer="sgd", clip_grad=0.0)
    lm, grad_norm = lm_train_step(chunks, opt)
    return {"lm": lm, "grad_norm": grad_norm, "state": gather_full_state(chunks),
            "last_stage": mpu.is_pipeline_last_stage()}


def _global_loss(results):
    """Sum the (loss_sum, tokens) pairs that last-stage, tp-rank-0 ranks of every DP shard report."""
    tot = torch.zeros(2)
    seen = 0
    for r in results:
        if r["last_stage"] and r["lm"] is not None:
            tot += r["lm"]
            seen += 1
    return tot, seen


@pytest.fixture(scope="module")
def reference():
    return spawn(lm_step_worker, 1, (1, 1))[0]


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_layout_matches_single_process(reference, tp, pp, dp):
    results = spawn(lm_step_worker, tp * pp * dp, (tp, pp))
    ref_loss = reference["lm"][0] / reference["lm"][1]
    tot, _ = _global_loss(results)
    # every TP rank of a last stage reports the same pair, so divide by the token count once
    assert tot[1] == reference["lm"][1] * tp
    torch.testing.assert_close(tot[0] / tot[1], ref_loss, rtol=0, atol=1e-5)
    for r in results:
        assert torch.isfinite(torch.tensor(r["grad_norm"]))
        assert r["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    ref_state = reference["state"]
    state = results[0]["state"]
    assert set(state) == set(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-5, msg=name)
    # the step really moved the weights (a comparison of two untouched models proves nothing)
    moved = max((ref_state[k] - v).abs().max().item() for k, v in _initial_state().items())
    assert moved > 1e-3


def _initial_worker():
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model
    from megatron_cispo.base.weights import gather_full_state

    distributed.init_distributed(tp=1, pp=1)
    cfg = ModelConfig(vocab_size=V, seq_length=S, hidden_size=32, num_layers=4, num_attention_heads=4)
    return gather_full_state(build_model(cfg, tp=1, pp=1, seed=7))


_INITIAL = {}


def _initial_state():
    if not _INITIAL:
        _INITIAL.update(spawn(_initial_worker, 1)[0])
    return _INITIAL


def failing_worker():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("boom from the second rank")
    import time

    time.sleep(60)  # the healthy rank would wait forever on a peer in a real job


def test_failing_rank_fails_fast_with_its_traceback():
    import time

    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 failed.*ValueError: boom from the second rank"):
        spawn(failing_worker, 2, timeout_s=50)
    assert time.monotonic() - t0 < 30
