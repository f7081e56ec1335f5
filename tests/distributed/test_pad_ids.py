"""Pad ids outside the vocabulary under untrained targets: replaced before the model sees them.

Rows right-padded with -100 or vocab_size inside the declared row length (no `lengths`, so every
position is "real"; only the loss mask says which targets train). At tp = 1 megatron's
VocabParallelEmbedding does not range-mask its input, so these ids used to crash the forward.
The step must give exactly the update of the same batch padded with id 0.
"""
import pytest
import torch

from megatron_cispo.testing import spawn

N, S, V = 4, 11, 24


def worker(packed: bool, pad_id: int | None):
    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.base.weights import gather_full_state
    from megatron_cispo.step import Rollouts, StepConfig, policy_step

    distributed.init_distributed()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (N, S + 1), generator=g)
    ends = torch.tensor([12, 7, 9, 5])  # tokens of each row before its padding
    pos = torch.arange(S + 1)[None]
    tokens = torch.where(pos < ends[:, None], tokens, 0 if pad_id is None else pad_id)
    loss_mask = (pos[:, :S] >= 2) & (pos[:, :S] < ends[:, None] - 1)  # targets of the padding: untrained
    batch = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=torch.randn(N, generator=g),
                     rollout_logprobs=-0.5 * loss_mask.float())
    chunks = build_model(ModelConfig(vocab_size=V, seq_length=S + 1, hidden_size=16, num_layers=1,
                                     num_attention_heads=2), tp=1, pp=1, seed=3)
    opt = build_optimizer(chunks, lr=0.1, optimizer="sgd", clip_grad=1e6)
    step_cfg = StepConfig(micro_batch_size=2, max_tokens_per_microbatch=2 * (S + 1) if packed else None)
    cfg = from_dict(LossConfig, {"cispo": {"anchor": "rollout"}})
    metrics = policy_step(chunks, opt, batch, cfg, step_cfg, vocab_size=V)
    return metrics, gather_full_state(chunks)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_out_of_vocabulary_pad_ids_under_untrained_targets_train_like_id_zero(packed):
    (ref_metrics, ref_state), = spawn(worker, 1, (packed, None))
    for pad_id in (-100, V):
        (metrics, state), = spawn(worker, 1, (packed, pad_id))
        for key, value in ref_metrics.items():
            assert metrics[key] == pytest.approx(value, abs=1e-6), (pad_id, key)
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=f"pad {pad_id}: {name}")
