"""fused_token_logprobs over TP = 1, 2 and 4 gloo ranks, with and without sequence parallelism,
against token_logprobs(F.linear(hidden, full weight)) on one process: values, entropy, and the
gradients of hidden and of this rank's weight shard, for fp32, bf16 and an fp32 head from bf16
parameters, over an even vocabulary, a padded one, and one where a rank holds only padding.

One 4-rank launch covers every layout: megatron's TP group (tp=4) is the default group, and
explicit subgroups give TP=2 (ranks {0,1}, {2,3}) and TP=1 (each rank alone).
"""
import pytest
import torch

from megatron_cispo.testing import spawn

from head_helpers import rel_to_whole, run_tp_layouts, select_cases

S, B, H = 8, 2, 16
# Padded to the next multiple of 8 * tp: 96 never, 83 always, 20 leaves rank 3 of 4 all padding.
VOCABS = (96, 83, 20)
DTYPES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
          "bf16_fp32_head": (torch.bfloat16, torch.float32)}
TEMPERATURE, ENT_WEIGHT = 0.8, 0.3


def _data(vocab, padded, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=g).to(dtype)
    weight = torch.randn(padded, H, generator=g) * 3 / H ** 0.5
    weight[vocab:] = 5.0  # junk padding rows: logits that would dominate if they counted
    t = torch.randint(0, vocab, (S, B), generator=g)
    t[1, 0] = -100
    t[5, 1] = 10 ** 6  # masked, so never range-checked
    mask = torch.ones(S, B, dtype=torch.bool)
    mask[5, 1] = False
    loss_w = torch.linspace(-1, 1, S * B).view(S, B)
    loss_w[2, 1] = 0.0  # a row with no upstream logprob gradient
    return hidden, weight.to(dtype), t, mask, loss_w


def _grads(fn, hidden, weight, loss_w, count):
    """lp, ent, the grads of fresh hidden and weight leaves, and the collectives of each direction."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    count.clear()
    lp, ent = fn(h, w)
    fwd = list(count)
    count.clear()
    (lp * loss_w + ENT_WEIGHT * ent).sum().backward()
    return lp, ent, h.grad, w.grad, (fwd, list(count))


def _case(tp, group, rank, single, vocab, sp, dtype_name, count):
    """Errors of one layout against one process, and the collectives each direction made."""
    import torch.nn.functional as F

    from megatron_cispo.fused_head import fused_token_logprobs
    from megatron_cispo.logprobs import token_logprobs

    dtype, head_dtype = DTYPES[dtype_name]
    padded = -(-vocab // (8 * tp)) * 8 * tp
    vl = padded // tp
    hidden, weight, t, mask, loss_w = _data(vocab, padded, dtype, seed=vocab + tp)
    cd = head_dtype or dtype
    kw = dict(temperature=TEMPERATURE, return_entropy=True, vocab_size=vocab, mask=mask)
    ref = _grads(lambda h, w: token_logprobs(F.linear(h.to(cd), w.to(cd)), t, tp_group=single, **kw),
                 hidden, weight, loss_w, count)
    sl = S // tp if sp else S
    mine = hidden[rank * sl:(rank + 1) * sl] if sp else hidden
    rows = slice(rank * vl, (rank + 1) * vl)
    ours = _grads(lambda h, w: fused_token_logprobs(h, w, t, tp_group=group, sequence_parallel=sp,
                                                    chunk_rows=3, head_dtype=head_dtype, **kw),
                  mine, weight[rows], loss_w, count)
    ref_gh = ref[2][rank * sl:(rank + 1) * sl] if sp else ref[2]
    ref_gw = ref[3][rows]

    return {"lp": (ours[0] - ref[0]).abs().max().item(), "ent": (ours[1] - ref[1]).abs().max().item(),
            "grad_hidden_rel": rel_to_whole(ours[2], ref_gh, ref[2]),
            "grad_weight_rel": rel_to_whole(ours[3], ref_gw, ref[3]),
            "grad_dtypes": (str(ours[2].dtype), str(ours[3].dtype)),
            "grad_shapes": (tuple(ours[2].shape), tuple(ours[3].shape)),
            "padding_grad_zero": bool((ours[3][max(0, vocab - rank * vl):] == 0).all()),
            "collectives": ours[4]}


def _worker():
    return run_tp_layouts(_case, (4, 2, 1), VOCABS, DTYPES, native_vocabs=VOCABS)


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, timeout_s=300)


# values: both paths do fp32 math on the same logits; gradients, relative to the largest entry:
# fp32 to rounding, bf16 to a few ulps (per-chunk bf16 partials, a bf16 TP sum), an fp32 head from
# bf16 parameters to the one rounding of its fp32 gradient to bf16
TOL = {"fp32": (1e-5, 1e-5), "bf16": (1e-5, 2 ** -6), "bf16_fp32_head": (1e-5, 2 ** -7)}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_values_entropy_and_both_grads_match_one_process(results, tp, sp, dtype):
    value_tol, grad_tol = TOL[dtype]
    for where, r in select_cases(results, tp=tp, sp=sp, dtype=dtype):
        assert r["lp"] < value_tol and r["ent"] < value_tol, (where, r)
        assert r["grad_hidden_rel"] < grad_tol and r["grad_weight_rel"] < grad_tol, (where, r)
        assert r["padding_grad_zero"], (where, r)
        in_dtype = str(DTYPES[dtype][0])
        assert r["grad_dtypes"] == (in_dtype, in_dtype), (where, r)
        assert r["grad_shapes"][0] == ((S // tp if sp else S), B, H), (where, r)


@pytest.mark.parametrize("tp", [2, 4])
def test_native_reduce_scatter_path_matches_too(results, tp):
    for where, r in select_cases(results, tp=tp, path="native"):
        assert r["lp"] < 1e-5 and r["grad_hidden_rel"] < 1e-5 and r["grad_weight_rel"] < 1e-5, (where, r)
        assert r["collectives"][1] == ["all_gather", "reduce_scatter"], (where, r)  # SP: re-gather, as megatron


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_collectives_forward_max_and_packed_sum_backward_one_hidden_grad_sum(results, tp):
    for where, r in select_cases(results, tp=tp, path="gloo"):
        sp = where[1][2]
        fwd, bwd = r["collectives"]
        if tp == 1:
            assert fwd == [] and bwd == [], (where, r)
            continue
        assert fwd == (["all_gather"] if sp else []) + ["MAX", "SUM"], (where, r)
        # SP keeps only the local hidden slice and gathers it again; gloo's reduce-scatter is an
        # all-reduce, then a slice
        assert bwd == (["all_gather"] if sp else []) + ["SUM"], (where, r)
