"""The demo's task, rewards, advantages and the sampler's version queue (single process, no megatron)."""
import pytest
import torch

from megatron_cispo.demo.sampler import Sampler
from megatron_cispo.demo.task import Task, group_advantages
from megatron_cispo.runner.experiment import RolloutConfig
from megatron_cispo.runner.model import ModelConfig


def _task(**kw):
    return Task(RolloutConfig(**kw))


@pytest.mark.parametrize("task, answer", [("copy", [3, 1, 2]), ("reverse", [2, 1, 3]), ("sort", [1, 2, 3])])
def test_answers(task, answer):
    t = _task(task=task, digits=3)
    prompt = torch.tensor([[t.bos, 3, 1, 2, t.sep]])
    assert t.answers(prompt).tolist() == [answer]


def test_add_writes_the_sum_least_significant_digit_first():
    t = _task(task="add", digits=2)
    prompt = torch.tensor([[t.bos, 4, 7, t.plus, 5, 6, t.sep]])  # 47 + 56 = 103
    assert t.answers(prompt).tolist() == [[3, 0, 1]]
    assert t.prompts(0, 0, 5)[:, 3].eq(t.plus).all()


def test_prompts_are_keyed_by_step_and_index_not_by_batch_size():
    t = _task()
    assert torch.equal(t.prompts(7, 3, 8)[:4], t.prompts(7, 3, 4))
    assert not torch.equal(t.prompts(7, 3, 4), t.prompts(7, 4, 4))


def test_per_position_and_exact_match_rewards():
    t = _task(task="copy", digits=2)
    tokens = torch.tensor([[t.bos, 1, 2, t.sep, 1, 2], [t.bos, 1, 2, t.sep, 1, 0]])
    assert t.rewards(tokens)[0].tolist() == [1.0, 0.5]
    assert _task(task="copy", digits=2, reward="exact_match").rewards(tokens)[0].tolist() == [1.0, 0.0]


def test_loss_mask_covers_answer_targets_only():
    t = _task(digits=3)
    assert t.loss_mask(1).tolist() == [[False, False, False, False, True, True, True]]


def test_group_advantages_are_normalised_per_group_and_column():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-5)
    per_pos = group_advantages(torch.tensor([[1.0, 0.0], [0.0, 0.0]]), 2)
    assert torch.allclose(per_pos, torch.tensor([[1.0, 0.0], [-1.0, 0.0]]), atol=1e-5)


def test_token_credit_needs_per_position_reward():
    with pytest.raises(ValueError, match="rollout.credit='token' needs rollout.reward='per_position'"):
        RolloutConfig(credit="token", reward="exact_match")


def _state(cfg: ModelConfig, fill: float) -> dict:
    h, v, f = cfg.hidden_size, cfg.vocab_size, 4 * cfg.hidden_size
    st = {"embedding.word_embeddings.weight": torch.full((v, h), fill),
          "embedding.position_embeddings.weight": torch.zeros(cfg.seq_length, h),
          "decoder.final_layernorm.weight": torch.ones(h), "output_layer.weight": torch.randn(v, h)}
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        st.update({p + "input_layernorm.weight": torch.ones(h), p + "pre_mlp_layernorm.weight": torch.ones(h),
                   p + "self_attention.linear_qkv.weight": torch.randn(3 * h, h) * 0.1,
                   p + "self_attention.linear_proj.weight": torch.randn(h, h) * 0.1,
                   p + "mlp.linear_fc1.weight": torch.randn(f, h) * 0.1, p + "mlp.linear_fc2.weight": torch.randn(h, f) * 0.1})
    return st


def test_sampler_uses_the_version_staleness_steps_back_and_drops_older_ones():
    mcfg = ModelConfig(vocab_size=16, seq_length=12, hidden_size=8, num_layers=1, num_attention_heads=2)
    s = Sampler(mcfg, RolloutConfig(staleness=2, precision="fp32"), seed=0)
    for v in range(5):
        s.sync(v, _state(mcfg, float(v)))
    assert sorted(s.versions) == [2, 3, 4]
    assert [s.version_for(t) for t in (0, 1, 2, 5)] == [0, 0, 0, 3]
    batch = s.rollouts(5)
    assert batch.version == 3 and batch.tokens.shape == (64, 10)
    assert torch.equal(batch.tokens[:, :6], s.task.prompts(0, 5, 16).repeat_interleave(4, 0))
    with pytest.raises(KeyError, match="no weights of policy version 1"):
        s.engine(1)


def test_sampling_is_deterministic_and_logprobs_match_the_sampled_tokens():
    mcfg = ModelConfig(vocab_size=16, seq_length=12, hidden_size=8, num_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    s = Sampler(mcfg, RolloutConfig(precision="fp32", temperature=0.7), seed=3)
    s.sync(0, _state(mcfg, 0.1))
    a, b = s.rollouts(0), s.rollouts(0)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    logits = s.engine(0).logits(a.tokens[:, :-1]).float() / 0.7
    lp = torch.log_softmax(logits, -1).gather(2, a.tokens[:, 1:].unsqueeze(2)).squeeze(2)
    torch.testing.assert_close(lp[a.loss_mask], a.rollout_logprobs[a.loss_mask], atol=1e-5, rtol=0)
    assert (a.rollout_logprobs[~a.loss_mask] == 0).all()
