"""Sampling-mask replay on one process: KeptSet (compressed rows, as vLLM returns them), the
logprob ops' keep= (values and gradients against an fp64 masked log_softmax, transcriptions of
vLLM's and slime's formulas), the Rollouts fields and the microbatch kept sets, and the demo
sampler's top-k / top-p."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_cispo.fused_head import fused_token_logprobs
from megatron_cispo.kept_set import KeptSet
from megatron_cispo.rollout.inprocess import InProcessEngine
from megatron_cispo.logprobs import token_logprobs

N, V, T = 40, 300, 0.7


def _case(n=N, v=V, seed=0, scale=3.0):
    """logits [n, v] fp64, targets [n], and a random kept mask [n, v] holding each target; row 5
    keeps the full vocabulary (an empty set), row 6 only its target."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g, dtype=torch.float64) * scale
    t = torch.randint(0, v, (n,), generator=g)
    keep = torch.rand(n, v, generator=g) < 0.1
    keep[torch.arange(n), t] = True
    if n > 6:
        keep[5] = False
        keep[6] = False
        keep[6, t[6]] = True
    return x, t, keep


def _dense_reference(x, t, keep, temperature=T, valid=None):
    """fp64: log_softmax((x / T) masked to -inf outside the kept set)[target], rows without a kept
    set over the full vocabulary; entropy of the full distribution."""
    z = x / temperature
    replay = keep.any(1, keepdim=True)
    lp = torch.log_softmax(torch.where(replay & ~keep, -torch.inf, z), -1).gather(1, t[:, None]).squeeze(1)
    lp = lp if valid is None else torch.where(valid, lp, 0.0)
    return lp, -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)


def _weights(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)


def _grad_of(fn, x, *weights):
    xl = x.clone().requires_grad_()
    out = fn(xl)
    out = out if isinstance(out, tuple) else (out,)
    sum((o * w.to(o.dtype)).sum() for o, w in zip(out, weights)).backward()
    return out, xl.grad


# ------------------------------------------------------------------ KeptSet


def test_from_lists_is_vllms_layout_and_take_gathers_rows_in_any_order():
    ks = KeptSet.from_lists([[3, 1], [], [7], [0, 2, 4]])
    assert ks.ids.tolist() == [1, 3, 7, 0, 2, 4] and ks.offsets.tolist() == [0, 2, 2, 3, 6]
    assert ks.ids.dtype == torch.int32 and ks.offsets.dtype == torch.int64 and ks.n == 4
    part = ks.take(torch.tensor([3, -1, 0, 0, 2]))
    assert part.offsets.tolist() == [0, 3, 3, 5, 7, 8]
    assert part.ids.tolist() == [0, 2, 4, 1, 3, 1, 3, 7]
    empty = ks.take(torch.zeros(0, dtype=torch.long))
    assert empty.n == 0 and empty.ids.numel() == 0


def test_from_mask_matches_from_lists():
    _, _, keep = _case(n=7, v=30)
    a = KeptSet.from_mask(keep)
    b = KeptSet.from_lists([row.nonzero().squeeze(1).tolist() for row in keep])
    assert torch.equal(a.ids, b.ids) and torch.equal(a.offsets, b.offsets)


@pytest.mark.parametrize("ids, offsets, match", [
    ([1, 2], [1, 2], r"keep.offsets: expected offsets\[0\] = 0"),
    ([1, 2], [0, 1], r"offsets\[-1\] = 2 \(len\(ids\)\)"),
    ([1, 2, 3], [0, 2, 1, 3], "and a decrease"),
    ([1, -2], [0, 1, 2], "keep.ids: expected vocabulary ids >= 0, found -2"),
    ([1, 5, 5], [0, 3], r"strictly ascending.*found 5 then 5 at position 0"),
    ([4, 2], [0, 2], r"found 4 then 2 at position 0; sort"),
])
def test_invalid_kept_sets_say_what_was_expected(ids, offsets, match):
    with pytest.raises(ValueError, match=match):
        KeptSet(torch.tensor(ids), torch.tensor(offsets))


def test_descending_ids_across_positions_are_fine_and_wrong_types_are_refused():
    KeptSet(torch.tensor([5, 9, 1]), torch.tensor([0, 2, 3]))  # a new position may start lower
    with pytest.raises(ValueError, match="keep.ids: expected a 1-d int tensor"):
        KeptSet(torch.tensor([1.0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"keep.offsets: expected a 1-d int \[N\+1\] tensor"):
        KeptSet(torch.tensor([1]), torch.tensor([[0, 1]]))


# ------------------------------------------------------------------ token_logprobs(keep=)


@pytest.mark.parametrize("chunk_rows", [None, 1, 7])
@pytest.mark.parametrize("entropy", [False, True])
def test_values_and_grads_match_an_fp64_masked_log_softmax(chunk_rows, entropy):
    x, t, keep = _case()
    g1, g2 = _weights(N)
    ref, ref_grad = _grad_of(lambda xl: _dense_reference(xl, t, keep)[:1 + entropy], x, g1, g2)
    out, grad = _grad_of(lambda xl: token_logprobs(xl, t, temperature=T, keep=KeptSet.from_mask(keep),
                                                   return_entropy=entropy, chunk_rows=chunk_rows),
                         x.float(), g1, g2)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=0, atol=1e-5)
    if not entropy:  # the logprob gradient is exactly 0 outside the kept set of a replayed row
        replayed = keep.any(1, keepdim=True)
        assert (grad[replayed.expand_as(keep) & ~keep] == 0).all()
    assert out[0][6] == 0.0  # a set of one: the target has probability 1


def test_gradient_is_one_hot_minus_kept_softmax_over_temperature():
    x, t, keep = _case(n=3, v=20)
    keep[0, :6] = True  # enough kept ids for the softmax part to matter
    xl = x.float().clone().requires_grad_()
    token_logprobs(xl, t, temperature=T, keep=KeptSet.from_mask(keep))[0].backward()
    z = (x[0] / T).masked_fill(~keep[0], -torch.inf)
    expected = (F.one_hot(t[0], 20).double() - torch.softmax(z, -1)) / T
    torch.testing.assert_close(xl.grad[0].double(), expected, rtol=0, atol=1e-6)
    assert (xl.grad[1:] == 0).all()


def test_entropy_stays_the_full_distributions():
    x, t, keep = _case()
    _, ent = token_logprobs(x.float(), t, keep=KeptSet.from_mask(keep), return_entropy=True)
    _, ent_full = token_logprobs(x.float(), t, return_entropy=True)
    torch.testing.assert_close(ent, ent_full, rtol=0, atol=0)


def test_kept_set_far_below_the_vocabulary_max_does_not_underflow():
    # the kept logits sit 500 nats under a dropped token: shifted by the full max, exp underflows
    x, t, keep = _case(n=4, v=50, scale=1.0)
    t[t == 0] = 1
    keep[torch.arange(4), t] = True
    x[:, 0] = 500.0
    keep[:, 0] = False
    lp = token_logprobs(x.float(), t, keep=KeptSet.from_mask(keep))
    ref, _ = _dense_reference(x, t, keep, temperature=1.0)
    assert torch.isfinite(lp).all()
    torch.testing.assert_close(lp.double(), ref, rtol=0, atol=1e-5)


def test_bf16_logits_give_bf16_grads_rounded_once():
    x, t, keep = _case()
    x = x.to(torch.bfloat16)
    g1, _ = _weights(N)
    _, ref_grad = _grad_of(lambda xl: _dense_reference(xl, t, keep)[:1], x.double(), g1)
    _, grad = _grad_of(lambda xl: token_logprobs(xl, t, temperature=T, keep=KeptSet.from_mask(keep)), x, g1)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad, ref_grad.to(torch.bfloat16), rtol=2 ** -7, atol=1e-7)


def test_untrained_positions_are_skipped_even_with_a_target_outside_their_set():
    x, t, keep = _case()
    mask = torch.ones(N, dtype=torch.bool)
    mask[9] = False
    keep[9] = False
    keep[9, (t[9] + 1) % V] = True  # the target is not kept: fine, the position is not trained
    lp, grad = _grad_of(lambda xl: token_logprobs(xl, t, keep=KeptSet.from_mask(keep), mask=mask,
                                                  temperature=T), x.float(), torch.ones(N))
    assert lp[0][9] == 0 and (grad[9] == 0).all()
    torch.testing.assert_close(lp[0].double(), _dense_reference(x, t, keep, valid=mask)[0], rtol=0, atol=1e-5)


def test_a_trained_target_outside_its_kept_set_names_the_position():
    x, t, keep = _case(n=12)
    keep[7, t[7]] = False
    with pytest.raises(ValueError, match=rf"keep: the target {int(t[7])} at position \(1, 1\) is not in its "
                                         r"kept set of \d+ ids"):
        token_logprobs(x.float().view(2, 6, V), t.view(2, 6), keep=KeptSet.from_mask(keep))


def test_kept_sets_must_match_the_positions_and_the_vocabulary():
    x, t, keep = _case()
    with pytest.raises(ValueError, match=rf"keep: expected kept sets of {N} positions .* found {N - 1}"):
        token_logprobs(x.float(), t, keep=KeptSet.from_mask(keep[:-1]))
    with pytest.raises(ValueError, match=rf"keep.ids: expected ids in \[0, {V - 10}\) \(vocab_size\)"):
        token_logprobs(x.float(), t % 10, keep=KeptSet.from_mask(keep), vocab_size=V - 10)
    with pytest.raises(ValueError, match="keep: expected a KeptSet or None, found dict"):
        token_logprobs(x.float(), t, keep={"ids": 1})


# ------------------------------------------------------------------ transcriptions


def test_matches_vllms_documented_replay_formula():
    # vLLM docs, "Sampling Mask (Distribution Replay)" (PR #49577), the trainer side:
    #   keep = zeros(V, bool); keep[mask_ids] = True
    #   log_prob = log_softmax(logits.masked_fill(~keep, -inf))[sampled_token]
    # with the logits divided by the temperature first (vLLM filters after temperature).
    x, t, keep = _case()
    rows = [keep[i].nonzero().squeeze(1).tolist() for i in range(N) if i != 5]  # vLLM: every row replayed
    ids = [i for i in range(N) if i != 5]
    ours = token_logprobs(x[ids].float(), t[ids], temperature=T, keep=KeptSet.from_lists(rows))
    for j, (mask_ids, sampled_token) in enumerate(zip(rows, t[ids].tolist())):
        vkeep = torch.zeros(V, dtype=torch.bool)
        vkeep[mask_ids] = True
        log_prob = torch.log_softmax((x[ids[j]] / T).masked_fill(~vkeep, -torch.inf), -1)[sampled_token]
        assert abs(float(ours[j]) - float(log_prob)) < 1e-5


def test_matches_slimes_dense_keep_mask_on_each_shard():
    # slime, slime/backends/megatron_utils/loss.py::_fill_topp_mask_rows (as quoted in research14
    # section 6): a [T, V_local] bool mask per TP shard, rows without replay data all True, then
    # log-probs from logits.masked_fill(~keep, -inf) and entropy from the unmasked logits.
    x, t, keep = _case()
    ks = KeptSet.from_mask(keep)
    ids, offsets = ks.ids.tolist(), ks.offsets.tolist()
    tp = 2
    vocab_local = V // tp
    masks = []
    for tp_rank in range(tp):
        vocab_start, vocab_end = tp_rank * vocab_local, (tp_rank + 1) * vocab_local
        mask = torch.ones(N, vocab_local, dtype=torch.bool)
        for response_idx in range(N):
            if offsets[response_idx] == offsets[response_idx + 1]:
                continue  # no replay data for this row: slime leaves it all True
            local_ids = [token_id - vocab_start for token_id in ids[offsets[response_idx]:offsets[response_idx + 1]]
                         if vocab_start <= token_id < vocab_end]
            mask[response_idx].fill_(False)
            if local_ids:
                mask[response_idx, torch.tensor(local_ids)] = True
        masks.append(mask)
    z = x / T
    slime_lp = torch.log_softmax(z.masked_fill(~torch.cat(masks, 1), -torch.inf), -1).gather(1, t[:, None]).squeeze(1)
    slime_ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    lp, ent = token_logprobs(x.float(), t, temperature=T, keep=ks, return_entropy=True)
    torch.testing.assert_close(lp.double(), slime_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), slime_ent, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ fused head


@pytest.mark.parametrize("chunk_rows", [1, 5, None])
@pytest.mark.parametrize("entropy", [False, True])
def test_fused_head_keep_matches_linear_then_masked_log_softmax(chunk_rows, entropy):
    s, b, h = 8, 3, 16
    x, t, keep = _case(n=s * b, v=V)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(s, b, h, generator=g, dtype=torch.float64)
    weight = torch.randn(V, h, generator=g, dtype=torch.float64) * 3 / h ** 0.5
    w1, w2 = _weights(s * b)
    h64, wt64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = _dense_reference(F.linear(h64, wt64).view(-1, V), t, keep)
    (ref[0] * w1 + (ref[1] * w2 if entropy else 0)).sum().backward()
    hl, wl = hidden.float().requires_grad_(), weight.float().requires_grad_()
    out = fused_token_logprobs(hl, wl, t.view(s, b), temperature=T, keep=KeptSet.from_mask(keep),
                               return_entropy=entropy, chunk_rows=chunk_rows)
    lp, ent = out if entropy else (out, None)
    (lp.reshape(-1) * w1.float() + (ent.reshape(-1) * w2.float() if entropy else 0)).sum().backward()
    torch.testing.assert_close(lp.reshape(-1).double(), ref[0], rtol=0, atol=1e-5)
    if entropy:
        torch.testing.assert_close(ent.reshape(-1).double(), ref[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(hl.grad.double(), h64.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(wl.grad.double(), wt64.grad, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ Rollouts and microbatches


def _rollouts_with_keep(lengths=(13, 5, 9, 2, 11, 7, 4, 6), s=12, v=20, seed=3):
    """Rollouts whose response targets carry kept sets (random, holding the target), and those
    sets as Python lists per (row, position): [] where nothing is replayed."""
    from megatron_cispo.step import Rollouts

    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    tokens = torch.randint(0, v, (n, s + 1), generator=g)
    lengths = torch.tensor(lengths)
    pos = torch.arange(s)[None]
    loss_mask = (pos >= 1) & (pos < lengths[:, None] - 1)
    keep = (torch.rand(n, s, v, generator=g) < 0.3) & loss_mask[..., None]
    keep |= F.one_hot(tokens[:, 1:], v).bool() & loss_mask[..., None]
    lists = [[keep[i, j].nonzero().squeeze(1).tolist() for j in range(s)] for i in range(n)]
    ks = KeptSet.from_lists([row for r in lists for row in r])
    batch = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=torch.randn(n, generator=g), lengths=lengths,
                     keep_ids=ks.ids, keep_offsets=ks.offsets)
    return batch, lists


def _sets(batch):
    """Kept sets of a Rollouts as [row][position] lists."""
    n, s = batch.tokens.shape[0], batch.tokens.shape[1] - 1
    off, ids = batch.keep_offsets.tolist(), batch.keep_ids.tolist()
    return [[ids[off[i * s + j]:off[i * s + j + 1]] for j in range(s)] for i in range(n)]


def test_kept_sets_survive_select_and_dp_shard_row_by_row():
    batch, lists = _rollouts_with_keep()
    from megatron_cispo.step import Rollouts

    part = batch.select(torch.tensor([6, 1, 3]))
    assert _sets(Rollouts(**part)) == [lists[6], lists[1], lists[3]]
    assert _sets(Rollouts(**batch.select(slice(2, 5)))) == lists[2:5]
    r1 = batch.dp_shard(dp_rank=1, dp=2, minibatches=2)
    assert _sets(r1) == [lists[i] for i in (2, 3, 6, 7)]
    assert torch.equal(r1.tokens, batch.tokens[[2, 3, 6, 7]])


def test_rollouts_check_their_kept_sets():
    from megatron_cispo.step import Rollouts

    batch, _ = _rollouts_with_keep()
    fields = batch.select(slice(None))
    with pytest.raises(ValueError, match="rollouts.keep_ids and rollouts.keep_offsets come together"):
        Rollouts(**{**fields, "keep_offsets": None})
    with pytest.raises(ValueError, match=r"rollouts.keep_offsets has shape \(96,\); expected \[n\*s \+ 1\] = \(97,\)"):
        Rollouts(**{**fields, "keep_offsets": fields["keep_offsets"][:-1]})
    sets = [fields["keep_ids"][a:b].tolist() for a, b in zip(fields["keep_offsets"][:-1], fields["keep_offsets"][1:])]
    sets[13] = [int(batch.tokens[1, 2]) ^ 1]  # row 1, target 1 (trained): a set without its target
    keep = KeptSet.from_lists(sets)
    with pytest.raises(ValueError, match=r"rollouts.keep: the target \d+ at position \(1, 1\) is not in its kept set"):
        Rollouts(**{**fields, "keep_ids": keep.ids, "keep_offsets": keep.offsets})


@pytest.mark.parametrize("packed, cp", [(False, 1), (True, 1), (True, 2)])
def test_each_microbatch_carries_its_positions_kept_sets(packed, cp):
    from megatron_cispo.step import StepConfig
    from megatron_cispo.step.packing import Layout, microbatches

    batch, lists = _rollouts_with_keep()
    s = batch.tokens.shape[1] - 1
    step_cfg = StepConfig(micro_batch_size=4, max_tokens_per_microbatch=24 if packed else None)
    seen = set()
    for cp_rank in range(cp):
        for mb in microbatches(batch, None, step_cfg, Layout(cp=cp, cp_rank=cp_rank, pad_multiple=2 * cp),
                               dp_group=None):
            ks, gidx = mb.kept_set, mb.gather_index.reshape(-1).tolist()
            assert ks.n == len(gidx)
            off, ids = ks.offsets.tolist(), ks.ids.tolist()
            for p, g in enumerate(gidx):
                want = [] if g < 0 else lists[g // s][g % s]  # padding: empty (the full vocabulary)
                assert ids[off[p]:off[p + 1]] == want
                if g >= 0 and want:
                    assert int(mb.targets.reshape(-1)[p]) in want
                    seen.add(g)
    assert seen == {i * s + j for i, r in enumerate(lists) for j, k in enumerate(r) if k}


def test_head_logprobs_scores_the_microbatch_over_its_kept_sets_with_either_head():
    from megatron_cispo.step import Microbatch
    from megatron_cispo.step.head import FusedHead, head_logprobs

    b, s, h = 3, 5, 8
    x, t, keep = _case(n=b * s, v=V)
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(b, s, h, generator=g), torch.randn(V, h, generator=g)
    mb = Microbatch(targets=t.view(b, s), loss_mask=torch.ones(b, s), advantages=torch.zeros(b, s),
                    kept_set=KeptSet.from_mask(keep))
    ref, _ = _dense_reference(F.linear(hidden.double(), weight.double()).view(-1, V), t, keep, temperature=1.0)
    logits_lp = head_logprobs(mb, F.linear(hidden, weight), temperature=1.0, vocab_size=None, entropy=False)
    fused_lp = head_logprobs(dataclasses.replace(mb, fused=FusedHead(weight, False)), hidden,
                             temperature=1.0, vocab_size=None, entropy=False)
    for lp in (logits_lp, fused_lp):
        assert lp.shape == (b, s)
        torch.testing.assert_close(lp.reshape(-1).double(), ref, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ the demo sampler and its YAML keys


@pytest.mark.parametrize("key, value, match", [
    ("top_k", -1, "rollout.top_k must be >= 0, got -1"),
    ("top_p", 0.0, r"rollout.top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
    ("top_p", 1.5, r"rollout.top_p must be in \(0, 1\]"),
])
def test_rollout_top_k_and_top_p_are_validated(key, value, match):
    from megatron_cispo.runner.experiment import RolloutConfig

    with pytest.raises(ValueError, match=match):
        RolloutConfig(**{key: value})


def test_top_k_top_p_transcribes_vllms_apply_top_k_top_p():
    from megatron_cispo.rollout.sampler import top_k_top_p

    # vllm-project/vllm vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p and
    # apply_top_k_only (commit 3babc05), as vLLM writes them
    def apply_top_k_only(logits, k):
        no_top_k_mask = k == logits.shape[1]
        k = k.masked_fill(no_top_k_mask, 1)
        max_top_k = k.max()
        k_index = k.sub_(1).unsqueeze(1)
        top_k_mask = logits.topk(max_top_k, dim=1).values.gather(1, k_index.long())
        top_k_mask.masked_fill_(no_top_k_mask.unsqueeze(1), -float("inf"))
        logits.masked_fill_(logits < top_k_mask, -float("inf"))
        return logits

    def vllm_apply_top_k_top_p(logits, k, p):
        if p is None:
            if k is None:
                return logits
            return apply_top_k_only(logits, k)
        logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
        if k is not None:
            top_k_mask = logits_sort.size(1) - k.to(torch.long)
            top_k_mask = logits_sort.gather(1, top_k_mask.unsqueeze(dim=1))
            top_k_mask = logits_sort < top_k_mask
            logits_sort.masked_fill_(top_k_mask, -float("inf"))
        if p is not None:
            probs_sort = logits_sort.softmax(dim=-1)
            probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
            top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)
            top_p_mask[:, -1] = False
            logits_sort.masked_fill_(top_p_mask, -float("inf"))
        return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 30, generator=g) * 2
    logits[0, :4] = 3.0  # ties at the k-th value are kept
    for k, p in ((1, 1.0), (4, 1.0), (0, 0.5), (7, 0.8), (30, 0.95), (30, 1.0), (0, 1.0)):
        vk = torch.full((16,), k) if k else None
        vp = torch.full((16,), p) if p < 1 else None
        assert torch.equal(top_k_top_p(logits, k, p), vllm_apply_top_k_top_p(logits.clone(), vk, vp))


class _BigramEngine(InProcessEngine):
    """Stands in for the sampler's TorchGPT: logits [b, s, V] that depend on the previous token."""

    def __init__(self, vocab: int, seed: int = 0):
        super().__init__(seed=1)  # the Sampler's seed: its draws are keyed by it
        self.ready = True
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 2

    def logits(self, tokens, routes=None):
        return self.table[tokens]


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (0, 0.7), (4, 0.9)])
def test_sampler_returns_kept_sets_and_logprobs_renormalised_over_them(top_k, top_p):
    from megatron_cispo.rollout.sampler import Sampler
    from megatron_cispo.runner.experiment import RolloutConfig
    from megatron_cispo.runner.model import ModelConfig
    from megatron_cispo.step import Rollouts

    vocab, temperature = 16, 0.8
    mcfg = ModelConfig(vocab_size=vocab, seq_length=12, hidden_size=16, num_layers=1, num_attention_heads=2)
    sampler = Sampler(mcfg, RolloutConfig(prompts_per_step=8, group_size=2, top_k=top_k, top_p=top_p,
                                          temperature=temperature), seed=1)
    engine = _BigramEngine(vocab)
    sampler.engine = lambda version: engine
    batch = sampler.rollouts(0)
    r = Rollouts(**batch.rollout_fields())  # checks that every trained target is in its set
    sizes = r.keep_offsets.diff().view(r.loss_mask.shape)
    assert (sizes[r.loss_mask] >= 1).all() and (sizes[~r.loss_mask] == 0).all()
    assert (sizes[r.loss_mask] < vocab).any()  # the filter dropped something
    if top_k:
        assert (sizes[r.loss_mask] <= top_k).all()
    # the sampler's logprob of each trained target is its log_softmax over the kept set
    x = engine.logits(batch.tokens[:, :-1]).reshape(-1, vocab)
    t, m = batch.tokens[:, 1:].reshape(-1), r.loss_mask.reshape(-1)
    lp = token_logprobs(x, t, keep=r.kept(), mask=m, temperature=temperature)
    torch.testing.assert_close(lp.view(r.loss_mask.shape), batch.rollout_logprobs, rtol=0, atol=1e-5)
    full = token_logprobs(x, t, mask=m, temperature=temperature)
    assert (lp - full)[m].max() > 1e-3  # renormalising really changed them


def test_sampler_without_top_k_or_top_p_sends_no_kept_sets():
    from megatron_cispo.rollout.sampler import Sampler
    from megatron_cispo.runner.experiment import RolloutConfig
    from megatron_cispo.runner.model import ModelConfig

    mcfg = ModelConfig(vocab_size=16, seq_length=12, hidden_size=16, num_layers=1, num_attention_heads=2)
    sampler = Sampler(mcfg, RolloutConfig(prompts_per_step=2, group_size=2), seed=1)
    sampler.engine = lambda version: _BigramEngine(16)
    fields = sampler.rollouts(0).rollout_fields()
    assert "keep_ids" not in fields and "keep_offsets" not in fields
