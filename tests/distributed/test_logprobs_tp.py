"""token_logprobs over TP = 1, 2 and 4 gloo ranks against a single-device fp64 reference and
against megatron-core's vocab_parallel_cross_entropy, for an even and a padded vocabulary.

One 4-rank launch covers every layout: megatron's TP group (tp=4) is the default group, and
explicit subgroups give TP=2 (ranks {0,1}, {2,3}) and TP=1 (each rank alone).
"""
import inspect

import pytest
import torch

from megatron_cispo.testing import spawn

TOKENS = 48
# Each is padded to the next multiple of 8 * tp. With 20, some ranks hold only padding.
VOCABS = (32000, 32003, 20)


def _full_logits(vocab, padded, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, vocab, generator=g, dtype=torch.float64) * 4
    t = torch.randint(0, vocab, (TOKENS,), generator=g)
    t[[2, 9]] = -100
    pad = torch.full((TOKENS, padded - vocab), 30.0, dtype=torch.float64)  # junk that must not count
    return torch.cat([x, pad], 1).to(dtype), t


def _reference(x, t, vocab, temperature):
    x64 = x.double().requires_grad_()
    logp = torch.log_softmax(x64[:, :vocab] / temperature, -1)
    valid = t != -100
    lp = torch.where(valid, logp.gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1), 0.0)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent, x64


def _mcore_cross_entropy(mce, logits, targets, group, rank, tp):
    """megatron-core's vocab_parallel_cross_entropy over `group` (None: megatron's TP group). 0.19
    takes tp_group=; before, it reads the group, rank and size from the parallel_state helpers it
    imports, which are swapped for this call."""
    if "tp_group" in inspect.signature(mce.vocab_parallel_cross_entropy).parameters:
        return mce.vocab_parallel_cross_entropy(logits, targets, tp_group=group)
    patched = {"get_tensor_model_parallel_group": lambda: group,
               "get_tensor_model_parallel_rank": lambda: rank,
               "get_tensor_model_parallel_world_size": lambda: tp}
    saved = {k: getattr(mce, k) for k in patched}
    try:
        for k, v in patched.items():
            setattr(mce, k, v)
        return mce.vocab_parallel_cross_entropy(logits, targets)
    finally:
        for k, v in saved.items():
            setattr(mce, k, v)


def _case(tp, group, rank, vocab, count):
    """Max abs errors of one layout: fp32 vs fp64 and bf16 vs megatron-core."""
    import megatron.core.tensor_parallel.cross_entropy as mce

    from megatron_cispo.logprobs import token_logprobs

    padded = -(-vocab // (8 * tp)) * 8 * tp
    vl = padded // tp
    cols = slice(rank * vl, (rank + 1) * vl)
    out = {}
    # fp32 with temperature, entropy and ignored targets against fp64 autograd
    x, t = _full_logits(vocab, padded, torch.float32, seed=vocab + tp)
    lp_r, ent_r, x64 = _reference(x, t, vocab, 0.8)
    g1 = torch.linspace(-1, 1, TOKENS, dtype=torch.float64)
    g1[5] = 0.0
    (lp_r * g1 + 0.3 * ent_r).sum().backward()
    shard = x[:, cols].clone()
    before = shard.clone()
    mine = shard.requires_grad_()
    for chunk in (1, 7, None):
        count.clear()
        lp, ent = token_logprobs(mine, t, tp_group=group, temperature=0.8, return_entropy=True,
                                 vocab_size=vocab, chunk_rows=chunk)
        out[f"collectives_fwd_chunk{chunk}"] = [str(op) for op in count]
    count.clear()
    mine.grad = None
    (lp * g1.float() + 0.3 * ent).sum().backward()
    out["collectives_bwd"] = [str(op) for op in count]
    out["fp32_lp"] = (lp.double() - lp_r).abs().max().item()
    out["fp32_ent"] = (ent.double() - ent_r).abs().max().item()
    out["fp32_grad"] = (mine.grad.double() - x64.grad[:, cols]).abs().max().item()
    out["caller_logits_unchanged"] = torch.equal(mine.detach(), before)
    # bf16 against megatron-core (padding set to -inf for it: it has no notion of vocab_size)
    xb, tb = _full_logits(vocab, padded, torch.bfloat16, seed=7 * vocab + tp)
    tb[tb < 0] = 0
    ours = xb[:, cols].clone().requires_grad_()
    lp = token_logprobs(ours, tb, tp_group=group, vocab_size=vocab)
    lp.sum().backward()
    ref_in = xb[:, cols].clone()
    ref_in[:, max(0, vocab - rank * vl):] = float("-inf")
    ref_in.requires_grad_()
    ref_lp = -_mcore_cross_entropy(mce, ref_in, tb, group, rank, tp)
    ref_lp.sum().backward()
    out["bf16_lp_vs_mcore"] = (lp - ref_lp).abs().max().item()
    ulp = torch.finfo(torch.bfloat16).eps * ref_in.grad.float().abs()  # one bf16 ulp, relative
    diff = (ours.grad.float() - ref_in.grad.float()).abs()
    out["bf16_grad_vs_mcore_ulps"] = (diff / ulp.clamp(min=1e-30)).max().item()
    out["bf16_grad_dtype"] = str(ours.grad.dtype)
    return out


def _worker():
    import torch.distributed as dist

    from megatron_cispo.runner import distributed

    env = distributed.init_distributed(tp=4)
    rank = env.rank
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(4)]
    count: list = []
    real = dist.all_reduce

    def counting(*a, **k):
        count.append(k.get("op"))
        return real(*a, **k)

    dist.all_reduce = counting
    try:
        results = {}
        for vocab in VOCABS:
            results[(4, vocab)] = _case(4, None, rank, vocab, count)  # None: megatron's TP group
            results[(2, vocab)] = _case(2, pairs[rank // 2], rank % 2, vocab, count)
            results[(1, vocab)] = _case(1, singles[rank], 0, vocab, count)
    finally:
        dist.all_reduce = real
    return results


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, timeout_s=300)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("vocab", VOCABS)
def test_fp32_values_entropy_and_grads_match_fp64_single_device(results, tp, vocab):
    for rank, res in enumerate(results):
        r = res[(tp, vocab)]
        assert r["fp32_lp"] < 1e-5 and r["fp32_ent"] < 1e-5 and r["fp32_grad"] < 1e-5, (rank, r)
        assert r["caller_logits_unchanged"], (rank, r)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("vocab", VOCABS)
def test_bf16_matches_megatron_core_within_bf16_rounding(results, tp, vocab):
    for rank, res in enumerate(results):
        r = res[(tp, vocab)]
        assert r["bf16_lp_vs_mcore"] < 1e-4, (rank, r)  # both fp32 math on the same bf16 inputs
        assert r["bf16_grad_vs_mcore_ulps"] <= 1.0, (rank, r)
        assert r["bf16_grad_dtype"] == "torch.bfloat16"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_forward_does_a_max_and_one_packed_sum_whatever_the_chunking(results, tp):
    import torch.distributed as dist

    expected = [str(dist.ReduceOp.MAX), str(dist.ReduceOp.SUM)] if tp > 1 else []
    for res in results:
        r = res[(tp, VOCABS[1])]
        for chunk in (1, 7, None):
            assert r[f"collectives_fwd_chunk{chunk}"] == expected, r
        assert r["collectives_bwd"] == [], r
