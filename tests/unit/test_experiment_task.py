"""The demo's task, rewards, advantages and the sampler's version queue (single process, no megatron)."""
import pytest
import torch

from megatron_cispo.rollout.inprocess import InProcessEngine
from megatron_cispo.rollout.sampler import Sampler
from megatron_cispo.rollout.task import PAD, Task, group_advantages
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
    assert t.loss_mask(torch.tensor([t.total_len])).tolist() == [[False, False, False, False, True, True, True]]


@pytest.mark.parametrize("task", ["copy", "reverse", "sort", "add"])
@pytest.mark.parametrize("reward", ["per_position", "exact_match"])
def test_fixed_length_tasks_score_every_answer_position_as_before(task, reward):
    """Fixed-length rows are total_len long whatever they hold (EOS included), and their rewards
    are bit-for-bit the fraction (or all) of positions equal to the reference."""
    t = _task(task=task, digits=3, reward=reward)
    tokens = torch.randint(0, t.vocab_size, (64, t.total_len), generator=torch.Generator().manual_seed(1))
    tokens[:, : t.prompt_len + 2] = t.prompts(0, 0, 64)
    tokens[:8, -t.answer_len:] = t.answers(tokens[:8, : t.prompt_len + 2])  # some exact rows
    assert (tokens == t.eos).any()
    correct = tokens[:, -t.answer_len:] == t.answers(tokens[:, : t.prompt_len + 2])
    expect = correct.all(1).float() if reward == "exact_match" else correct.float().mean(1)
    rewards, got = t.rewards(tokens)
    assert torch.equal(rewards, expect) and torch.equal(got, correct)
    assert t.lengths(tokens).eq(t.total_len).all()
    old_mask = torch.zeros(64, t.total_len - 1, dtype=torch.bool)
    old_mask[:, -t.answer_len:] = True
    assert torch.equal(t.loss_mask(t.lengths(tokens)), old_mask)


def test_dedup_answers_are_the_distinct_digits_in_increasing_order_then_eos():
    t = _task(task="dedup", digits=4)
    assert (t.eos, t.vocab_size, t.answer_len, t.variable_length) == (13, 14, 5, True)
    prompts = torch.tensor([[t.bos, 3, 1, 3, 1, t.sep], [t.bos, 0, 0, 0, 0, t.sep], [t.bos, 9, 2, 7, 4, t.sep]])
    e = t.eos
    assert t.answers(prompts).tolist() == [[1, 3, e, PAD, PAD], [0, e, PAD, PAD, PAD], [2, 4, 7, 9, e]]
    small = _task(task="dedup", digits=4, base=2)  # fewer symbols than digits
    assert small.answers(torch.tensor([[small.bos, 1, 0, 1, 1, small.sep]])).tolist() == [[0, 1, small.eos, 0, 0]]


def _dedup_rows(t, answers):
    """Rows of the prompt 3 1 3 1 (reference 1 3 EOS) with the given answers, padded with PAD."""
    rows = [[t.bos, 3, 1, 3, 1, t.sep] + a + [PAD] * (t.answer_len - len(a)) for a in answers]
    return torch.tensor(rows)


def test_dedup_rewards_read_the_answer_through_its_first_eos():
    t = _task(task="dedup", digits=4)
    e = t.eos
    tokens = _dedup_rows(t, [
        [1, 3, e],            # exact
        [1, 3, e, 9, 9],      # exact; what follows the first EOS is never read
        [1, 4, e],            # one wrong digit: 2/3
        [1, 3, 5, e],         # one digit too many: 2 right of 4 positions
        [1, e],               # one digit short: the EOS sits where 3 belongs, 1/3
        [1, 3, 5, 6, 7],      # no EOS: the whole answer_len counts, 2/5
        [e, 1, 3, e, 0],      # EOS first: an empty answer, 0/3
    ])
    assert t.lengths(tokens).tolist() == [9, 9, 9, 10, 8, 11, 7]
    rewards, correct = t.rewards(tokens)
    torch.testing.assert_close(rewards, torch.tensor([1, 1, 2 / 3, 2 / 4, 1 / 3, 2 / 5, 0]), rtol=0, atol=1e-7)
    T, F = True, False
    assert correct.tolist() == [[T, T, T, F, F], [T, T, T, F, F], [T, F, T, F, F], [T, T, F, F, F],
                                [T, F, F, F, F], [T, T, F, F, F], [F, F, F, F, F]]
    exact, _ = _task(task="dedup", digits=4, reward="exact_match").rewards(tokens)
    assert exact.tolist() == [1, 1, 0, 0, 0, 0, 0]


def test_dedup_loss_mask_ends_at_each_rows_last_target():
    t = _task(task="dedup", digits=2)  # [BOS] d d [SEP] a a EOS: total_len 7, targets 0..5
    mask = t.loss_mask(torch.tensor([5, 6, 7]))
    assert mask.int().tolist() == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]


def test_token_credit_needs_a_fixed_length_task():
    with pytest.raises(ValueError, match="rollout.credit='token' needs a fixed-length task, got task='dedup'"):
        RolloutConfig(task="dedup", credit="token")


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


class _EosHeavyEngine(InProcessEngine):
    """Logits that give EOS probability 0.3 and every other id the same share, at every position."""

    def __init__(self, vocab: int, eos: int):
        super().__init__(seed=0)  # the Sampler's seed: its draws are keyed by it
        self.ready = True
        self.logp = torch.full((vocab,), 0.7 / (vocab - 1)).log()
        self.logp[eos] = torch.tensor(0.3).log()

    def logits(self, tokens, routes=None):
        return self.logp.expand(*tokens.shape, -1).clone()


def test_sampler_ends_dedup_rows_at_the_first_eos_and_pads_past_it():
    from megatron_cispo.step import Rollouts

    mcfg = ModelConfig(vocab_size=16, seq_length=12, hidden_size=8, num_layers=1, num_attention_heads=2)
    s = Sampler(mcfg, RolloutConfig(task="dedup", digits=4, precision="fp32"), seed=0)
    t = s.task
    s.engine = lambda version: _EosHeavyEngine(16, t.eos)
    raw_tokens, raw_lp = s.generate(s.engine(0), t.prompts(0, 0, 16).repeat_interleave(4, 0), 0)
    batch = s.rollouts(0)
    n, start = 64, t.prompt_len + 2
    answer = raw_tokens[:, start:]
    first = [row.tolist().index(t.eos) if t.eos in row.tolist() else None for row in answer]
    expect = torch.tensor([start + (f + 1 if f is not None else t.answer_len) for f in first])
    assert torch.equal(batch.lengths, expect)
    assert len(set(expect.tolist())) >= 4  # rows of many lengths, some without EOS
    real = torch.arange(t.total_len) < expect[:, None]
    assert torch.equal(batch.tokens[real], raw_tokens[real]) and (batch.tokens[~real] == PAD).all()
    targets = torch.arange(t.total_len - 1)
    assert torch.equal(batch.loss_mask, (targets >= start - 1) & (targets < expect[:, None] - 1))
    lp = torch.zeros(n, t.total_len - 1)
    lp[:, -t.answer_len:] = raw_lp
    assert torch.equal(batch.rollout_logprobs, torch.where(batch.loss_mask, lp, 0.0))
    assert (batch.rollout_logprobs[batch.loss_mask] < 0).all()
    assert torch.equal(batch.rewards, t.rewards(raw_tokens)[0])  # padding never changes a reward
    assert torch.equal(batch.advantages, group_advantages(batch.rewards, 4))
    fields = batch.rollout_fields()
    assert torch.equal(fields["lengths"], batch.lengths)
    Rollouts(**fields)  # the step accepts it: nothing trained at or past a row's end


def test_sampler_rows_of_fixed_length_tasks_are_total_len_long():
    mcfg = ModelConfig(vocab_size=16, seq_length=12, hidden_size=8, num_layers=1, num_attention_heads=2)
    s = Sampler(mcfg, RolloutConfig(task="sort", digits=3, precision="fp32"), seed=0)
    s.engine = lambda version: _EosHeavyEngine(16, s.task.eos)
    batch = s.rollouts(0)
    assert (batch.tokens == s.task.eos).any()  # EOS is just a wrong digit here
    assert batch.lengths.eq(s.task.total_len).all() and batch.lengths.dtype == torch.int64
    assert torch.equal(batch.loss_mask, s.task.loss_mask(batch.lengths))
    assert batch.loss_mask.sum(1).eq(s.task.answer_len).all()
