"""fused_grad_logprobs on one process: fused_token_logprobs's values, and z's backward gives hidden
and weight the same gradients as a separable policy loss through fused_token_logprobs + autograd,
for every option; coef_fn sees each row once, in order; the logits never exist."""
import pytest
import torch

from megatron_cispo.fused_grad import fused_grad_logprobs
from megatron_cispo.fused_head import fused_token_logprobs
from megatron_cispo.vocab_softmax import release_workspace

from peak_storage import PeakStorage

H, V, PAD = 16, 200, 9  # the last PAD weight rows are vocabulary padding in the padded cases
CLIP, ENT_W = 1.2, 0.01
CASES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
         "bf16_fp32_head": (torch.bfloat16, torch.float32)}
# lp/ent: both paths do fp32 math on the same logits; gradients relative to the largest entry:
# fp32 to rounding, bf16 to a few ulps (the per-chunk bf16 parts), an fp32 head to its bf16 rounding
TOL = {"fp32": (1e-6, 1e-5), "bf16": (1e-5, 2 ** -6), "bf16_fp32_head": (1e-5, 2 ** -7)}


def _inputs(s, b, dtype, seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, H, generator=g).to(dtype)
    weight = torch.randn(V, H, generator=g) * 3 / H ** 0.5  # logits of std ~3
    weight[vocab:] = 50.0  # junk padding rows: they would dominate the softmax if they counted
    t = torch.randint(0, vocab, (s, b), generator=g)
    t.view(-1)[1] = -100
    t.view(-1)[4] = 10 ** 6  # masked below: never range-checked
    mask = torch.ones(s, b, dtype=torch.bool)
    mask.view(-1)[4] = False
    adv = torch.randn(s, b, generator=g)
    adv.view(-1)[2] = 0.0  # a row with no logprob gradient
    anchor = torch.randn(s, b, generator=g) * 0.1 - 3.0
    return hidden, weight.to(dtype), t, mask, adv, anchor


def _loss(lp, ent, adv, anchor, valid):
    """CISPO-like: -adv * sg(min(exp(lp - anchor), CLIP)) * lp, minus an entropy bonus on valid rows."""
    w = torch.exp(lp - anchor).clamp(max=CLIP).detach()
    return (-adv * w * lp).sum() - (0.0 if ent is None else ENT_W * (ent * valid).sum())


def _coef_fn(adv, anchor, entropy, calls):
    """The gradient of _loss per row; it returns coefficients on ignored rows too (the op drops them)."""
    a, k = adv.reshape(-1), anchor.reshape(-1)

    def coef_fn(r0, r1, lp, ent):
        calls.append((r0, r1, lp.clone(), None if ent is None else ent.clone()))
        g_lp = -a[r0:r1] * torch.exp(lp - k[r0:r1]).clamp(max=CLIP)
        return g_lp, (torch.full_like(lp, -ENT_W) if entropy else None)
    return coef_fn


def _both(s, b, case, entropy, vocab=V, **kw):
    dtype, head_dtype = CASES[case]
    hidden, weight, t, mask, adv, anchor = _inputs(s, b, dtype, vocab=vocab)
    kw.update(return_entropy=entropy, mask=mask, head_dtype=head_dtype, vocab_size=vocab)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused_token_logprobs(h, w, t, **kw)
    lp_ref, ent_ref = out if entropy else (out, None)
    valid = mask & (t != -100)
    _loss(lp_ref, ent_ref, adv, anchor, valid).backward()
    calls = []
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent, z = fused_grad_logprobs(h2, w2, t, _coef_fn(adv, anchor, entropy, calls), **kw)
    assert z.shape == () and z.dtype == torch.float32 and z.item() == 0.0 and z.grad_fn is not None
    assert not lp.requires_grad and (ent is None or not ent.requires_grad)
    z.backward()
    return (lp_ref, ent_ref, h.grad, w.grad), (lp, ent, h2.grad, w2.grad), calls


def _assert_close(ref, ours, case):
    value_tol, grad_tol = TOL[case]
    for a, r in zip(ours[:2], ref[:2]):
        if r is None:
            assert a is None
            continue
        assert a.dtype == torch.float32 and a.shape == r.shape
        torch.testing.assert_close(a, r.detach(), rtol=0, atol=value_tol)
    for a, r in zip(ours[2:], ref[2:]):
        assert a.dtype == r.dtype and a.shape == r.shape
        torch.testing.assert_close(a.float(), r.float(), rtol=0, atol=grad_tol * r.abs().max().item())


@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("chunk_rows", [1, 4, 7, None])  # 7 divides neither 18 nor 9 rows
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_values_and_grads_equal_fused_token_logprobs_through_autograd(case, entropy, chunk_rows, b):
    ref, ours, _ = _both(9, b, case, entropy, vocab=V - PAD, temperature=0.7, chunk_rows=chunk_rows)
    _assert_close(ref, ours, case)
    assert torch.equal(ours[3][V - PAD:], torch.zeros(PAD, H, dtype=ours[3].dtype))  # padding rows
    assert ours[0].view(-1)[1] == 0 and ours[0].view(-1)[4] == 0  # ignored, masked
    assert torch.equal(ours[2].reshape(-1, H)[1], torch.zeros(H, dtype=ours[2].dtype))


@pytest.mark.parametrize("entropy", [False, True])
def test_full_vocabulary_and_temperature_one(entropy):
    ref, ours, _ = _both(6, 2, "fp32", entropy, chunk_rows=5)
    _assert_close(ref, ours, "fp32")


def test_coef_fn_sees_each_row_once_in_order_with_the_returned_values():
    ref, ours, calls = _both(9, 2, "fp32", True, chunk_rows=4)
    assert [(r0, r1) for r0, r1, *_ in calls] == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 18)]
    assert torch.equal(torch.cat([c[2] for c in calls]), ours[0].view(-1))
    assert torch.equal(torch.cat([c[3] for c in calls]), ours[1].view(-1))


def test_incoming_gradient_scales_both_grads_and_zero_or_none_work():
    hidden, weight, t, mask, adv, anchor = _inputs(6, 2, torch.float32)
    grads = {}
    for g in (None, 3.0, 0.0):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        _, _, z = fused_grad_logprobs(h, w, t, _coef_fn(adv, anchor, True, []), mask=mask,
                                      return_entropy=True, chunk_rows=5)
        z.backward(None if g is None else torch.tensor(g))
        grads[g] = (h.grad, w.grad)
        with pytest.raises(RuntimeError, match="backward ran twice"):
            z.backward()
    for g1, g3, g0 in zip(*grads.values()):
        assert g1.abs().max() > 0
        torch.testing.assert_close(g3, 3 * g1, rtol=1e-6, atol=0)
        assert torch.equal(g0, torch.zeros_like(g1))
    # z in a graph that hands it no gradient at all (None, not a zero)
    h = hidden.clone().requires_grad_()
    _, _, z = fused_grad_logprobs(h, weight, t, _coef_fn(adv, anchor, False, []), mask=mask)
    ((h * 2).sum() + _NoGrad.apply(z)).backward()
    assert torch.equal(h.grad, torch.full_like(h, 2.0))


class _NoGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return None


def test_coefficients_of_ignored_rows_are_dropped_even_nan():
    hidden, weight, t, mask, adv, anchor = _inputs(6, 2, torch.float32)
    valid = (mask & (t != -100)).reshape(-1)
    grads = []
    for junk in (0.0, float("nan")):
        def coef_fn(r0, r1, lp, ent):
            g = torch.where(valid[r0:r1], -adv.reshape(-1)[r0:r1], junk)
            return g, torch.where(valid[r0:r1], -0.5, junk)
        h = hidden.clone().requires_grad_()
        fused_grad_logprobs(h, weight, t, coef_fn, mask=mask, return_entropy=True, chunk_rows=5)[2].backward()
        grads.append(h.grad)
    assert torch.isfinite(grads[1]).all()
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_frozen_inputs_and_no_grad_skip_the_gradient_work():
    hidden, weight, t, mask, adv, anchor = _inputs(6, 2, torch.float32)
    ref = fused_token_logprobs(hidden, weight, t, mask=mask)
    with torch.no_grad():
        lp, ent, z = fused_grad_logprobs(hidden.requires_grad_(), weight, t, _coef_fn(adv, anchor, False, []),
                                         mask=mask)
    assert z.grad_fn is None and ent is None
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-6)
    w = weight.clone().requires_grad_()
    fused_grad_logprobs(hidden.detach(), w, t, _coef_fn(adv, anchor, False, []), mask=mask)[2].backward()
    assert w.grad is not None and w.grad.abs().max() > 0


@pytest.mark.parametrize("case", list(CASES))
def test_logits_are_never_materialised(case):
    dtype, head_dtype = CASES[case]
    s, b, v, chunk = 64, 2, 256, 4  # 128 tokens x 256 columns of logits
    g = torch.Generator().manual_seed(1)
    h = torch.randn(s, b, 8, generator=g).to(dtype).requires_grad_()
    w = torch.randn(v, 8, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, v, (s, b), generator=g)
    release_workspace()  # so the chunk workspace is allocated, and counted, inside the mode
    with PeakStorage() as mode:
        _, _, z = fused_grad_logprobs(h, w, t, lambda r0, r1, lp, ent: (-lp, -torch.ones_like(ent)),
                                      return_entropy=True, chunk_rows=chunk, head_dtype=head_dtype)
        z.backward()
    release_workspace()
    full = s * b * v * (head_dtype or dtype).itemsize
    # 3 fp32 chunk slots [chunk, v] at most, or a weight-sized [v, h] fp32 buffer
    assert mode.peak <= 4 * max(3 * chunk * v, v * 8) < full // 4, (mode.peak, full)


def test_invalid_arguments_say_what_fused_token_logprobs_says():
    hidden, weight, t, mask, adv, anchor = _inputs(6, 2, torch.float32)
    bad = [dict(head_dtype=torch.float64), dict(temperature=0.0), dict(vocab_size=V + 1),
           dict(chunk_rows=0), dict(mask=torch.ones(6, 2)), dict(targets=t[:5]), dict(hidden=hidden[0]),
           dict(weight=weight[:, :8]), dict(weight=weight.bfloat16())]
    for kw in bad:
        args = {"hidden": hidden, "weight": weight, "targets": t}
        args.update({k: kw.pop(k) for k in list(kw) if k in args})
        with pytest.raises(ValueError) as ref:
            fused_token_logprobs(args["hidden"], args["weight"], args["targets"], **kw)
        with pytest.raises(ValueError) as ours:
            fused_grad_logprobs(args["hidden"], args["weight"], args["targets"], lambda *a: None, **kw)
        assert str(ours.value) == str(ref.value)


@pytest.mark.parametrize("ret, match", [
    (lambda r0, r1, lp, ent: -lp, "expected a \\(g_lp, g_ent or None\\) pair"),
    (lambda r0, r1, lp, ent: (-lp[:1], None), r"expected g_lp a float tensor of shape \(5,\) for rows 0:5"),
    (lambda r0, r1, lp, ent: (-lp, -lp), "return_entropy=False computes no entropy"),
])
def test_bad_coef_fn_results_are_named(ret, match):
    hidden, weight, t, *_ = _inputs(6, 2, torch.float32)
    t = t.clamp(min=0) % V
    with pytest.raises(ValueError, match=match):
        fused_grad_logprobs(hidden, weight, t, ret, chunk_rows=5)


def test_default_chunk_is_a_share_of_the_rows_the_same_whatever_the_valid_columns(monkeypatch):
    """The default chunk comes from a memory budget of the logits shard (fused_head.default_chunk_rows):
    a share of the rows. Chunks sized from a rank's valid columns would differ in count between the
    ranks of an uneven vocabulary, and their per-chunk all-reduces would not match."""
    from megatron_cispo import fused_head

    monkeypatch.setattr(fused_head, "MIN_CHUNK_ROWS", 1)
    monkeypatch.setattr(fused_head, "SHARD_CHUNKS", 4)  # 12 fp32 rows: chunks of 3
    hidden, weight, t, mask, adv, anchor = _inputs(6, 2, torch.float32, vocab=V // 2)
    calls = []
    fused_grad_logprobs(hidden, weight, t, _coef_fn(adv, anchor, False, calls), mask=mask, vocab_size=V // 2)
    assert [c[:2] for c in calls] == [(r, r + 3) for r in range(0, 12, 3)]
    calls = []  # a bf16 head's logits take half the bytes: chunks of 6 in the same budget
    fused_grad_logprobs(hidden.bfloat16(), weight.bfloat16(), t, _coef_fn(adv, anchor, False, calls), mask=mask,
                        vocab_size=V // 2)
    assert [c[:2] for c in calls] == [(0, 6), (6, 12)]


def test_default_chunk_rows_is_a_sixteenth_of_the_fp32_shard_at_least_128_rows():
    from megatron_cispo.fused_head import default_chunk_rows

    assert default_chunk_rows(2048, 4) == 128 and default_chunk_rows(8192, 4) == 512  # fp32 logits
    assert default_chunk_rows(8192, 2) == 1024 and default_chunk_rows(8192, 8) == 256  # bf16; fp32 + entropy
    assert default_chunk_rows(100, 4) == 128 and default_chunk_rows(32768, 4) == 2048


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_elementwise_passes_in_sub_blocks_of_a_chunk_give_the_same_result(monkeypatch, case, entropy):
    """A chunk's GEMM rows are split into cache-sized blocks for the softmax and gradient passes."""
    from megatron_cispo import fused_grad

    monkeypatch.setitem(fused_grad.CHUNK_BYTES, "cpu", 4 * V * 2)  # 2 rows per block: blocks of 2, 2, 2, 1
    ref, ours, _ = _both(9, 2, case, entropy, vocab=V - PAD, temperature=0.7, chunk_rows=7)
    _assert_close(ref, ours, case)


def test_fp16_with_a_gradient_is_refused_in_one_line():
    """fp16 gradients formed in forward, before the loss scale, would underflow: refused."""
    hidden, weight, t, mask, adv, anchor = _inputs(6, 2, torch.float32)
    for h, w in ((hidden.half().requires_grad_(), weight), (hidden, weight.half().requires_grad_())):
        with pytest.raises(ValueError, match=r"expected bf16 or fp32 hidden states and weight where they need a gradient, found .*fused_token_logprobs"):
            fused_grad_logprobs(h, w, t, _coef_fn(adv, anchor, False, []), mask=mask,
                                head_dtype=torch.float32)


@pytest.mark.parametrize("case", ["fp32", "bf16"])
def test_weight_with_main_grad_gets_the_fp32_sum_there(case):
    """A weight with megatron DDP's fp32 main_grad (and a hook that, like DDP's, adds param.grad to
    it): after backward main_grad holds the gradient, summed in fp32 without rounding to the
    weight's dtype, and the hook still fired (param.grad was handed over, zero)."""
    ref, _, _ = _both(9, 2, case, False, vocab=V - PAD, chunk_rows=4)
    hidden, weight, t, mask, adv, anchor = _inputs(9, 2, CASES[case][0], vocab=V - PAD)
    w = weight.clone().requires_grad_()
    w.main_grad = torch.full((V, H), 0.5)
    fired = []

    def hook(p):  # megatron DDP's per-parameter hook, in short
        fired.append(p.grad.float().abs().max().item())
        p.main_grad.add_(p.grad)
        p.grad = None
    w.register_post_accumulate_grad_hook(hook)
    _, _, z = fused_grad_logprobs(hidden.requires_grad_(), w, t, _coef_fn(adv, anchor, False, []), mask=mask,
                                  vocab_size=V - PAD, chunk_rows=4, head_dtype=CASES[case][1])
    z.backward(torch.tensor(2.0))
    assert fired == [0.0] and w.grad is None
    tol = 2 * TOL[case][1] * ref[3].float().abs().max().item()
    torch.testing.assert_close(w.main_grad - 0.5, 2 * ref[3].float(), rtol=0, atol=tol)
    assert torch.equal(w.main_grad[V - PAD:], torch.full((PAD, H), 0.5))
    if case == "bf16":  # the held sum is fp32: main_grad is finer than a bf16 gradient
        assert not torch.equal((w.main_grad - 0.5).bfloat16().float(), w.main_grad - 0.5)
