"""fused_token_logprobs on one process: the same values and gradients (hidden and weight) as
token_logprobs(F.linear(hidden, weight)), for every option, with the logits never materialised."""
import pytest
import torch
import torch.nn.functional as F

from megatron_cispo.fused_head import fused_token_logprobs
from megatron_cispo.logprobs import token_logprobs
from megatron_cispo.vocab_softmax import release_workspace

from peak_storage import PeakStorage

S, B, H, V = 6, 4, 16, 200


def _inputs(v=V, dtype=torch.float32, seed=0, s=S, b=B, h=H):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 3 / h ** 0.5).to(dtype)  # logits of std ~3
    targets = torch.randint(0, v, (s, b), generator=g)
    return hidden, weight, targets


def _loss(out, entropy):
    """A loss that weights every position differently (one weight 0: a skipped row), and uses the
    entropy when there is one."""
    lp, ent = out if entropy else (out, None)
    w = torch.linspace(-1, 1, lp.numel()).view_as(lp)
    w.view(-1)[3] = 0.0
    return (lp * w).sum() + (0.0 if ent is None else 0.3 * ent.sum())


def _run(fn, hidden, weight, entropy, **kw):
    """(outputs, grad of hidden, grad of weight) of fn(h, w, ...) on fresh leaves."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fn(h, w, return_entropy=entropy, **kw)
    _loss(out, entropy).backward()
    return (out if entropy else (out,)), h.grad, w.grad


def _reference(h, w, targets, *, head_dtype=None, **kw):
    cd = head_dtype or h.dtype
    return token_logprobs(F.linear(h.to(cd), w.to(cd)), targets, **kw)


def _compare(targets, hidden, weight, entropy, grad_tol, **kw):
    """Values within 1e-5 (both paths do fp32 math on the same logits), gradients within
    grad_tol of the reference's largest entry."""
    ours = _run(lambda h, w, **k: fused_token_logprobs(h, w, targets, **k), hidden, weight, entropy, **kw)
    kw.pop("chunk_rows", None)
    ref = _run(lambda h, w, **k: _reference(h, w, targets, **k), hidden, weight, entropy, **kw)
    for a, b in zip(ours[0], ref[0]):
        assert a.dtype == torch.float32 and a.shape == targets.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for a, b in zip(ours[1:], ref[1:]):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=grad_tol * b.abs().max().item())
    return ours


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [1, 5, None])
@pytest.mark.parametrize("entropy", [False, True])
def test_fp32_values_entropy_and_both_grads_match_linear_then_token_logprobs(temperature, chunk_rows,
                                                                            entropy):
    hidden, weight, t = _inputs()
    _compare(t, hidden, weight, entropy, 1e-5, temperature=temperature, chunk_rows=chunk_rows)


def test_entropy_alone_is_differentiable():
    hidden, weight, t = _inputs()
    grads = []
    for fn in (fused_token_logprobs, _reference):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        fn(h, w, t, return_entropy=True, temperature=1.3)[1].sum().backward()
        grads.append((h.grad, w.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item())


def test_padded_vocab_rows_are_excluded_and_get_zero_weight_grad():
    hidden, weight, t = _inputs()
    vocab = V - 7
    t = t % vocab
    weight[vocab:] = 50.0  # junk rows whose logits would dominate the softmax if they counted
    ours = _compare(t, hidden, weight, True, 1e-5, vocab_size=vocab, chunk_rows=7)
    assert torch.equal(ours[2][vocab:], torch.zeros(7, H))


def test_ignored_positions_by_index_and_mask_give_zero_logprob_and_zero_hidden_grad():
    hidden, weight, t = _inputs()
    t[1, 2] = -100
    t[4, 0] = 10 ** 6  # masked: never range-checked
    mask = torch.ones(S, B, dtype=torch.bool)
    mask[4, 0] = False
    (lp,), gh, _ = _compare(t, hidden, weight, False, 1e-5, mask=mask, chunk_rows=3)
    assert lp[1, 2] == 0 and lp[4, 0] == 0
    assert torch.equal(gh[1, 2], torch.zeros(H)) and torch.equal(gh[4, 0], torch.zeros(H))


def test_bf16_gives_fp32_logprobs_and_bf16_grads_within_bf16_rounding():
    hidden, weight, t = _inputs(dtype=torch.bfloat16)
    # the weight gradient is rounded to bf16 once per chunk before its fp32 sum (one matmul rounds
    # once): a few bf16 ulps of the largest entry
    _compare(t, hidden, weight, True, 2 ** -6, temperature=0.9, chunk_rows=5)


def test_fp32_head_from_bf16_params_matches_an_fp32_linear():
    hidden, weight, t = _inputs(dtype=torch.bfloat16)
    (lp, ent), gh, gw = _compare(t, hidden, weight, True, 1e-5, head_dtype=torch.float32, chunk_rows=5)
    assert gh.dtype == gw.dtype == torch.bfloat16
    bf16 = _run(lambda h, w, **k: fused_token_logprobs(h, w, t, **k), hidden, weight, True)
    assert (bf16[0][0] - lp).abs().max() > 0  # the head precision really changed the numbers


def test_non_contiguous_hidden_view_as_gpt_model_transposes_it():
    hidden, weight, t = _inputs()
    bsh = hidden.transpose(0, 1).contiguous()
    grads = []
    for fn in (fused_token_logprobs, _reference):
        x = bsh.clone().requires_grad_()
        view = x.transpose(0, 1)  # [s, b, h], not contiguous
        assert not view.is_contiguous()
        _loss(fn(view, weight, t, return_entropy=True), True).backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-5 * grads[1].abs().max().item())


def test_frozen_weight_or_frozen_hidden_and_no_grad_forward():
    hidden, weight, t = _inputs()
    ref = _reference(hidden, weight, t)
    with torch.no_grad():
        torch.testing.assert_close(fused_token_logprobs(hidden, weight, t), ref, rtol=0, atol=1e-5)
    h = hidden.clone().requires_grad_()
    fused_token_logprobs(h, weight, t).sum().backward()
    w = weight.clone().requires_grad_()
    fused_token_logprobs(hidden, w, t).sum().backward()
    assert h.grad is not None and w.grad is not None


@pytest.mark.parametrize("dtype, head_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                              (torch.bfloat16, torch.float32)])
def test_logits_are_never_materialised_in_forward_or_backward(dtype, head_dtype):
    s, b, h, v, chunk = 64, 2, 8, 256, 4  # 128 tokens x 256 columns of logits
    hidden, weight, t = _inputs(v=v, dtype=dtype, s=s, b=b, h=h)
    full = s * b * v * (head_dtype or dtype).itemsize
    peaks = {}
    for name, fn in (("fused", fused_token_logprobs), ("linear", _reference)):
        release_workspace()  # so the chunk workspace is allocated, and counted, inside the mode
        hl, wl = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with PeakStorage() as fwd:
            out = fn(hl, wl, t, return_entropy=True, temperature=0.8, chunk_rows=chunk,
                     head_dtype=head_dtype)
        with PeakStorage() as bwd:
            _loss(out, True).backward()
        peaks[name] = (fwd.peak, bwd.peak)
    release_workspace()
    # the detector sees the logits of the unfused path, in forward and in backward
    assert min(peaks["linear"]) >= full, peaks
    # fused: 2 fp32 chunk workspaces [chunk, v] at most, or a weight-sized [v, h] fp32 buffer
    bound = 4 * max(2 * chunk * v, v * h)
    assert max(peaks["fused"]) <= bound < full // 4, peaks


@pytest.mark.parametrize("kwargs, match", [
    (dict(head_dtype=torch.float64), "head_dtype: expected None, torch.float32"),
    (dict(temperature=0.0), "temperature: expected a finite float > 0"),
    (dict(vocab_size=V + 1), r"vocab_size: expected an int in \(0, 200\]"),
    (dict(chunk_rows=0), "chunk_rows"),
    (dict(mask=torch.ones(S, B)), "mask: expected bool"),
])
def test_invalid_arguments_say_what_was_expected(kwargs, match):
    hidden, weight, t = _inputs()
    with pytest.raises(ValueError, match=match):
        fused_token_logprobs(hidden, weight, t, **kwargs)


def test_invalid_shapes_and_dtypes_are_rejected():
    hidden, weight, t = _inputs()
    with pytest.raises(ValueError, match=r"targets: expected integer ids of shape \(6, 4\), hidden's"):
        fused_token_logprobs(hidden, weight, t[:5])
    with pytest.raises(ValueError, match=r"hidden: expected a 3-d"):
        fused_token_logprobs(hidden[0], weight, t[0])
    with pytest.raises(ValueError, match=r"weight: expected \[v_local, 16\]"):
        fused_token_logprobs(hidden, weight[:, :8], t)
    with pytest.raises(ValueError, match="pass head_dtype="):
        fused_token_logprobs(hidden, weight.bfloat16(), t)
    t[2, 3] = V
    with pytest.raises(ValueError, match=rf"\[0, {V}\).*found {V} at position \(2, 3\)"):
        fused_token_logprobs(hidden, weight, t)


@pytest.mark.parametrize("entropy", [False, True])
def test_default_chunk_holds_a_sixteenth_of_the_fp32_shard_entropy_counted(monkeypatch, entropy):
    """The default chunk is a memory budget: 1/16 of the rows' fp32 logits (fused_head.default_chunk_rows),
    halved with entropy, whose probabilities take a second fp32 block; the values are unchanged."""
    from megatron_cispo import fused_head

    monkeypatch.setattr(fused_head, "MIN_CHUNK_ROWS", 1)
    monkeypatch.setattr(fused_head, "SHARD_CHUNKS", 2)  # 24 rows: chunks of 12, or 6 with entropy
    seen = []
    plan_targets = fused_head.plan_targets
    monkeypatch.setattr(fused_head, "plan_targets", lambda *a, **k: seen.append(k["chunk_rows"]) or plan_targets(*a, **k))
    hidden, weight, t = _inputs()
    _compare(t, hidden, weight, entropy, 1e-5)
    assert seen == [6 if entropy else 12]
