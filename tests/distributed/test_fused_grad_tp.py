"""fused_grad_logprobs over TP = 2 and 4 gloo ranks, with and without sequence parallelism,
against fused_token_logprobs on one process (full weight) + autograd of the same separable loss:
lp, entropy, the gradients of hidden and of this rank's weight shard, what coef_fn saw, and the
collectives (the same on every rank, per chunk), over an even vocabulary, a padded one, and one
where a rank holds only padding.

One 4-rank launch: megatron's TP group (tp=4) is the default group; explicit subgroups give TP=2.
"""
import pytest
import torch

from megatron_cispo.testing import spawn

from head_helpers import rel_to_whole, run_tp_layouts, select_cases

S, B, H, CHUNK = 8, 2, 16, 3  # 16 rows in chunks of 3: 6 chunks, the last one short
# Padded to the next multiple of 8 * tp: 96 never, 83 always, 20 leaves rank 3 of 4 all padding.
VOCABS = (96, 83, 20)
DTYPES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None)}
TEMPERATURE, CLIP, ENT_W = 0.8, 1.2, 0.05


def _data(vocab, padded, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=g).to(dtype)
    weight = torch.randn(padded, H, generator=g) * 3 / H ** 0.5
    weight[vocab:] = 5.0  # junk padding rows: logits that would dominate if they counted
    t = torch.randint(0, vocab, (S, B), generator=g)
    t[1, 0] = -100
    mask = torch.ones(S, B, dtype=torch.bool)
    mask[5, 1] = False
    adv = torch.randn(S, B, generator=g)
    anchor = torch.randn(S, B, generator=g) * 0.1 - 3.0
    return hidden, weight.to(dtype), t, mask, adv, anchor


def _case(tp, group, rank, single, vocab, sp, dtype_name, count):
    from megatron_cispo.fused_grad import fused_grad_logprobs
    from megatron_cispo.fused_head import fused_token_logprobs

    dtype, head_dtype = DTYPES[dtype_name]
    padded = -(-vocab // (8 * tp)) * 8 * tp
    vl = padded // tp
    hidden, weight, t, mask, adv, anchor = _data(vocab, padded, dtype, seed=vocab + tp)
    valid = mask & (t != -100)
    kw = dict(temperature=TEMPERATURE, return_entropy=True, vocab_size=vocab, mask=mask, head_dtype=head_dtype)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp_r, ent_r = fused_token_logprobs(h, w, t, tp_group=single, **kw)
    ratio = torch.exp(lp_r - anchor).clamp(max=CLIP).detach()
    ((-adv * ratio * lp_r).sum() - ENT_W * (ent_r * valid).sum()).backward()

    seen = []

    def coef_fn(r0, r1, lp, ent):
        seen.append((r0, r1, lp.clone(), ent.clone()))
        a, k = adv.reshape(-1)[r0:r1], anchor.reshape(-1)[r0:r1]
        return -a * torch.exp(lp - k).clamp(max=CLIP), torch.full_like(ent, -ENT_W)

    sl = S // tp if sp else S
    rows = slice(rank * vl, (rank + 1) * vl)
    mine = hidden[rank * sl:(rank + 1) * sl] if sp else hidden
    h2, w2 = mine.clone().requires_grad_(), weight[rows].clone().requires_grad_()
    count.clear()
    lp, ent, z = fused_grad_logprobs(h2, w2, t, coef_fn, tp_group=group, sequence_parallel=sp,
                                     chunk_rows=CHUNK, **kw)
    fwd = list(count)
    count.clear()
    z.backward()
    ref_gh = h.grad[rank * sl:(rank + 1) * sl] if sp else h.grad

    return {"lp": (lp - lp_r).abs().max().item(), "ent": (ent - ent_r).abs().max().item(),
            "grad_hidden_rel": rel_to_whole(h2.grad, ref_gh, h.grad),
            "grad_weight_rel": rel_to_whole(w2.grad, w.grad[rows], w.grad),
            "grad_dtypes": (h2.grad.dtype, w2.grad.dtype), "grad_shape": tuple(h2.grad.shape),
            "padding_grad_zero": bool((w2.grad[max(0, vocab - rank * vl):] == 0).all()),
            "seen_rows": [(r0, r1) for r0, r1, *_ in seen],
            "seen": (torch.cat([s[2] for s in seen]), torch.cat([s[3] for s in seen])),
            "collectives": (fwd, list(count))}


def _worker():
    return run_tp_layouts(_case, (4, 2), VOCABS, DTYPES, native_vocabs=(83,))


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, timeout_s=300)


# values: fp32 math on the same logits; gradients relative to the largest entry: fp32 to
# rounding, bf16 to a few ulps (per-chunk bf16 parts, a bf16 TP sum)
TOL = {"fp32": (1e-5, 1e-5), "bf16": (1e-5, 2 ** -6)}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_values_entropy_and_both_grads_match_one_process(results, tp, sp, dtype):
    value_tol, grad_tol = TOL[dtype]
    for where, r in select_cases(results, tp=tp, sp=sp, dtype=dtype):
        assert r["lp"] < value_tol and r["ent"] < value_tol, (where, r)
        assert r["grad_hidden_rel"] < grad_tol and r["grad_weight_rel"] < grad_tol, (where, r)
        assert r["padding_grad_zero"], (where, r)
        assert r["grad_dtypes"] == (DTYPES[dtype][0],) * 2 and r["grad_shape"] == ((S // tp if sp else S), B, H)


@pytest.mark.parametrize("tp", [2, 4])
def test_every_rank_runs_the_same_chunks_and_coef_fn_sees_the_same_values(results, tp):
    chunks = [(r0, min(S * B, r0 + CHUNK)) for r0 in range(0, S * B, CHUNK)]
    by_key = {}
    for (rank, key), r in select_cases(results, tp=tp):
        assert r["seen_rows"] == chunks, (rank, key)
        by_key.setdefault(key, []).append((rank, r))
    for key, ranks in by_key.items():  # the ranks of one TP group: ranks r and r % tp share it
        groups = {}
        for rank, r in ranks:
            groups.setdefault(rank // tp, []).append(r)
        for members in groups.values():
            for r in members[1:]:
                assert all(torch.equal(a, b) for a, b in zip(r["seen"], members[0]["seen"])), key
                assert r["collectives"] == members[0]["collectives"], key


@pytest.mark.parametrize("tp", [2, 4])
def test_collectives_per_chunk_max_and_sum_then_one_hidden_grad_sum_none_in_backward(results, tp):
    n_chunks = -(-S * B // CHUNK)
    for where, r in select_cases(results, tp=tp):
        sp, path = where[1][2], where[1][4]
        fwd, bwd = r["collectives"]
        grad_sum = ["reduce_scatter"] if path == "native" else ["SUM"]  # gloo: all-reduce, then a slice
        assert fwd == (["all_gather"] if sp else []) + ["MAX", "SUM"] * n_chunks + grad_sum, (where, fwd)
        assert bwd == [], (where, bwd)


@pytest.mark.parametrize("tp", [2, 4])
def test_native_reduce_scatter_path_matches_too(results, tp):
    for where, r in select_cases(results, tp=tp, path="native"):
        assert r["lp"] < 1e-5 and r["grad_hidden_rel"] < 1e-5 and r["grad_weight_rel"] < 1e-5, (where, r)
