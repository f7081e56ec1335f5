"""Packing rollouts into microbatches: bins, CP chunks, shifted targets, and exact aggregation weights."""
import pytest
import torch

from megatron_cispo.config import LossConfig
from megatron_cispo.losses import aggregate, token_weights
from megatron_cispo.step import Rollouts, StepConfig
from megatron_cispo.step.packing import (
    Layout,
    cp_indices,
    first_fit_decreasing,
    microbatches,
    packed_microbatches,
    padded_microbatches,
    plan_bins,
)

MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def _batch(lengths, s=12, seed=0, vocab=50):
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    lengths = torch.tensor(lengths)
    tokens = torch.randint(1, vocab, (n, s + 1), generator=g)
    tokens[torch.arange(s + 1)[None, :] >= lengths[:, None]] = 0
    pos = torch.arange(s)[None, :]
    loss_mask = (pos >= 2) & (pos < lengths[:, None] - 1)  # a 3-token prompt, then the response
    return Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=torch.randn(n, generator=g),
                    rollout_logprobs=-torch.rand(n, s, generator=g) * loss_mask, lengths=lengths)


def test_first_fit_decreasing_fills_bins_under_the_budget_deterministically():
    sizes = [7, 3, 5, 2, 8, 1, 4]
    bins = first_fit_decreasing(sizes, 10)
    assert bins == first_fit_decreasing(sizes, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3  # 30 tokens in bins of 10: optimal here


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_cp_ranks_hold_chunks_r_and_2cp_minus_1_minus_r_of_every_segment(cp):
    segs = [4 * cp, 2 * cp, 6 * cp]
    parts = [cp_indices(segs, cp, r, "cpu") for r in range(cp)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(sum(segs)))
    c0 = segs[0] // (2 * cp)
    for r, idx in enumerate(parts):
        assert idx[:c0].tolist() == list(range(r * c0, (r + 1) * c0))
        assert idx[c0:2 * c0].tolist() == list(range((2 * cp - 1 - r) * c0, (2 * cp - r) * c0))


def _check_tokens(batch, mbs):
    """Every real target position appears exactly once, with the right input, target and fields."""
    n, s = batch.tokens.shape[0], batch.tokens.shape[1] - 1
    seen = torch.zeros(n * s, dtype=torch.int64)
    for mb in mbs:
        g = mb.gather_index.reshape(-1)
        real = g >= 0
        rows, cols = g[real] // s, g[real] % s
        assert torch.equal(mb.input_ids.reshape(-1)[real], batch.tokens[rows, cols])
        assert torch.equal(mb.targets.reshape(-1)[real], batch.tokens[rows, cols + 1])
        assert torch.equal(mb.position_ids.reshape(-1)[real], cols)
        assert torch.equal(mb.loss_mask.reshape(-1)[real], batch.loss_mask[rows, cols])
        assert not mb.loss_mask.reshape(-1)[~real].any() and not mb.agg_weight.reshape(-1)[~real].any()
        assert torch.equal(mb.advantages.reshape(-1)[real], batch.advantages[rows])
        assert int(mb.num_tokens) == int(real.sum())
        seen.index_add_(0, g[real], torch.ones_like(g[real]))
    lengths = batch.target_lengths()
    want = (torch.arange(s)[None, :] < lengths[:, None]).reshape(-1).long()
    assert torch.equal(seen, want)


@pytest.mark.parametrize("cp, sp_tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_packed_microbatches_shift_before_the_split_and_cover_every_token_once(cp, sp_tp):
    batch = _batch([13, 5, 9, 2, 11, 7])
    multiple = (2 * cp if cp > 1 else 1) * sp_tp
    w = token_weights(batch.loss_mask, "token_mean")[:2]
    all_mbs = []
    bins = plan_bins(batch, 16)
    assert all(sum(int(batch.lengths[i]) - 1 for i in b) <= 16 for b in bins)
    for r in range(cp):
        layout = Layout(cp=cp, cp_rank=r, pad_multiple=multiple)
        mbs = packed_microbatches(batch, w, bins, layout=layout)
        for mb, rows in zip(mbs, bins):
            t_local = mb.input_ids.shape[1]
            padded = sum(-(-(int(batch.lengths[i]) - 1) // multiple) * multiple for i in rows)
            assert mb.input_ids.shape[0] == 1 and t_local * cp == mb.seq_length == padded
            assert t_local % sp_tp == 0  # sequence parallelism scatters the local tokens over TP
            cu = mb.packed_seq_params.cu_seqlens_q_padded
            assert int(cu[-1]) == mb.seq_length and all(int(x) % multiple == 0 for x in cu)
        all_mbs += mbs
    _check_tokens(batch, all_mbs)


def test_padded_microbatches_cover_every_token_once_and_refuse_cp():
    batch = _batch([13, 5, 9, 2])
    w = token_weights(batch.loss_mask, "token_mean")[:2]
    mbs = padded_microbatches(batch, w, micro_batch_size=2, layout=Layout(pad_multiple=4))
    assert [mb.input_ids.shape for mb in mbs] == [torch.Size([2, 12])] * 2
    _check_tokens(batch, mbs)
    with pytest.raises(ValueError, match="cp=2.* needs packed microbatches"):
        padded_microbatches(batch, w, micro_batch_size=2, layout=Layout(cp=2, pad_multiple=4))


def test_uniform_bins_are_padded_to_the_longest_and_empty_bins_are_all_padding():
    batch = _batch([13, 5, 9])
    layout = Layout(pad_multiple=2, uniform=True)
    bins = plan_bins(batch, 14) + [[]]
    mbs = packed_microbatches(batch, token_weights(batch.loss_mask, "token_mean")[:2], bins, layout=layout)
    assert all(mb.input_ids.shape == (1, 12) for mb in mbs)  # bins [12] and [4 + 8]
    assert int(mbs[-1].num_tokens) == 0 and not mbs[-1].loss_mask.any() and mbs[-1].n_seqs == 0
    _check_tokens(batch, mbs)


@pytest.mark.parametrize("mode", MODES)
def test_token_weights_make_any_split_sum_to_the_whole_batch_loss(mode):
    g = torch.Generator().manual_seed(3)
    valid = torch.rand(6, 9, generator=g) > 0.4
    valid[2] = False  # a sequence with no valid token counts in no denominator
    loss = torch.randn(6, 9, generator=g) * valid
    want_sum, want_den = aggregate(loss, valid, mode, max_len=9)
    w, share, den = token_weights(valid, mode, max_len=9)
    assert den.item() == want_den.item()
    # any split: rows in pieces and each row's tokens cut in two, as CP does
    pieces = [(slice(0, 2), slice(0, 4)), (slice(0, 2), slice(4, 9)), (slice(2, 6), slice(0, 9))]
    got = sum((loss[r, c] * w[r, c]).sum() for r, c in pieces)
    assert got.item() == pytest.approx(want_sum.item(), rel=1e-6)
    assert sum(share[r, c][valid[r, c]].sum() for r, c in pieces).item() == pytest.approx(den.item(), rel=1e-6)


def test_weighted_microbatches_carry_the_global_scale_n_over_d():
    batch = _batch([13, 5, 9, 2, 11, 7])
    cfg = LossConfig(loss_agg="seq_mean_token_mean")
    mbs = microbatches(batch, cfg, StepConfig(max_tokens_per_microbatch=16), Layout(), dp_group=None)
    n_tokens = int(batch.target_lengths().sum())
    seqs = int((batch.loss_mask.sum(1) > 0).sum())
    assert {mb.loss_scale for mb in mbs} == {n_tokens / seqs}
    assert sum(int(mb.num_tokens) for mb in mbs) == n_tokens
    scoring = microbatches(batch, None, StepConfig(micro_batch_size=2), Layout(), dp_group=None)
    assert all(mb.loss_scale is None and mb.agg_weight is None and mb.agg_share is None for mb in scoring)


def test_rollouts_refuse_lengths_that_contradict_the_loss_mask():
    batch = _batch([13, 5])
    with pytest.raises(ValueError, match="loss_mask trains a target past the end of row 1"):
        Rollouts(tokens=batch.tokens, loss_mask=torch.ones(2, 12, dtype=torch.bool), advantages=batch.advantages,
                 lengths=batch.lengths)
    with pytest.raises(ValueError, match=r"lengths must be in \[2, 13\]"):
        Rollouts(tokens=batch.tokens, loss_mask=batch.loss_mask, advantages=batch.advantages,
                 lengths=torch.tensor([14, 5]))


def test_bins_never_span_two_windows_of_micro_batch_size_rows():
    batch = _batch([13, 5, 9, 2, 11, 7, 4, 6])
    bins = plan_bins(batch, 40, window=4)
    assert all(len({i // 4 for i in b}) == 1 for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(8))
    # the rows of one window share microbatches whatever the other windows hold (a DP shard)
    half = Rollouts(**batch.select(slice(4, 8)))
    assert [[i - 4 for i in b] for b in bins if b[0] >= 4] == plan_bins(half, 40, window=4)


def test_a_row_over_the_budget_is_named_and_refused_before_any_collective():
    batch = _batch([13, 5, 9, 2])
    with pytest.raises(ValueError, match="a row of 12 tokens .* exceeds max_tokens_per_microbatch=10"):
        microbatches(batch, None, StepConfig(micro_batch_size=2, max_tokens_per_microbatch=10), Layout(),
                     dp_group=None)
