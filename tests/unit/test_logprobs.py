"""token_logprobs on one process (no TP group): values, gradients, entropy, temperature,
ignored targets, vocab padding, validation messages, and caller-logits safety."""
import pytest
import torch

from megatron_cispo.logprobs import token_logprobs

N, V = 48, 1000


def _inputs(n=N, v=V, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g, dtype=torch.float64) * 3).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    return x, t


def _reference(x, t, temperature=1.0, valid=None, vocab=None):
    """fp64 autograd reference: (logprob, entropy, x64 leaf) over the first `vocab` columns."""
    x64 = x.detach().double().requires_grad_()
    z = x64[:, :vocab] / temperature
    logp = torch.log_softmax(z, -1)
    valid = torch.ones_like(t, dtype=torch.bool) if valid is None else valid
    lp = torch.where(valid, logp.gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1), 0.0)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent, x64


def _weights(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk_rows", [None, 1, 7])
def test_fp32_logprobs_entropy_and_grads_match_fp64_autograd(temperature, chunk_rows):
    x, t = _inputs()
    lp_r, ent_r, x64 = _reference(x, t, temperature)
    g1, g2 = _weights(N)
    (lp_r * g1 + ent_r * g2).sum().backward()
    xl = x.clone().requires_grad_()
    lp, ent = token_logprobs(xl, t, temperature=temperature, return_entropy=True, chunk_rows=chunk_rows)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (N,)
    (lp * g1.float() + ent * g2.float()).sum().backward()
    torch.testing.assert_close(lp.double(), lp_r, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_r, rtol=0, atol=1e-5)
    torch.testing.assert_close(xl.grad.double(), x64.grad, rtol=0, atol=1e-5)


def test_entropy_alone_is_differentiable():
    x, t = _inputs()
    _, ent_r, x64 = _reference(x, t)
    ent_r.sum().backward()
    xl = x.clone().requires_grad_()
    _, ent = token_logprobs(xl, t, return_entropy=True)
    ent.sum().backward()
    torch.testing.assert_close(xl.grad.double(), x64.grad, rtol=0, atol=1e-5)


def test_leading_shape_is_kept_for_seq_batch_logits():
    x, t = _inputs(n=24)
    lp = token_logprobs(x.view(6, 4, V), t.view(6, 4))
    assert lp.shape == (6, 4)
    torch.testing.assert_close(lp.reshape(-1).double(), _reference(x, t)[0], rtol=0, atol=1e-5)


def test_bf16_logits_give_fp32_logprobs_and_bf16_grad_rounded_once():
    x, t = _inputs(dtype=torch.bfloat16)
    lp_r, _, x64 = _reference(x, t)
    lp_r.sum().backward()
    xl = x.clone().requires_grad_()
    lp = token_logprobs(xl, t)
    lp.sum().backward()
    assert lp.dtype == torch.float32 and xl.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp.double(), lp_r, rtol=0, atol=1e-5)
    # within one bf16 ulp (2^-7 relative): fp32 and fp64 values can round to neighbouring bf16s
    torch.testing.assert_close(xl.grad, x64.grad.to(torch.bfloat16), rtol=2 ** -7, atol=1e-7)


def test_ignored_targets_by_index_and_mask_give_zero_logprob_and_zero_grad():
    x, t = _inputs()
    t[3] = -100
    t[4] = 123456  # out of range, but masked out, so never validated
    mask = torch.ones(N, dtype=torch.bool)
    mask[4] = False
    valid = (t != -100) & mask
    lp_r, _, x64 = _reference(x, t, valid=valid)
    lp_r.sum().backward()
    xl = x.clone().requires_grad_()
    lp = token_logprobs(xl, t, mask=mask)
    lp.sum().backward()
    assert lp[3] == 0 and lp[4] == 0
    assert torch.equal(xl.grad[3], torch.zeros(V)) and torch.equal(xl.grad[4], torch.zeros(V))
    torch.testing.assert_close(xl.grad.double(), x64.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(lp.double(), lp_r, rtol=0, atol=1e-5)


def test_padded_vocab_columns_are_excluded_and_get_zero_grad():
    x, t = _inputs()
    vocab = V - 5
    t = t % vocab
    x[:, vocab:] = 50.0  # padding junk that would dominate the softmax if it were included
    lp_r, ent_r, x64 = _reference(x, t, vocab=vocab)
    (lp_r + ent_r).sum().backward()
    xl = x.clone().requires_grad_()
    lp, ent = token_logprobs(xl, t, vocab_size=vocab, return_entropy=True)
    (lp + ent).sum().backward()
    torch.testing.assert_close(lp.double(), lp_r, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_r, rtol=0, atol=1e-5)
    assert torch.equal(xl.grad[:, vocab:], torch.zeros(N, 5))
    torch.testing.assert_close(xl.grad.double(), x64.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bad", [V, -1, 10 ** 6])
def test_target_outside_vocab_names_the_valid_range(bad):
    x, t = _inputs()
    t[7] = bad
    with pytest.raises(ValueError, match=rf"\[0, {V}\).*found {bad} at position \(7,\)"):
        token_logprobs(x, t)


def test_target_in_vocab_padding_is_rejected():
    x, t = _inputs()
    t[0] = V - 1
    with pytest.raises(ValueError, match=rf"\[0, {V - 3}\)"):
        token_logprobs(x, t, vocab_size=V - 3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=0.0), "temperature: expected a finite float > 0"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(vocab_size=V + 1), r"vocab_size: expected an int in \(0, 1000\]"),
    (dict(inplace_backward="yes"), "inplace_backward"),
    (dict(chunk_rows=0), "chunk_rows"),
    (dict(mask=torch.ones(N)), "mask: expected bool"),
])
def test_invalid_arguments_say_what_was_expected(kwargs, match):
    x, t = _inputs()
    with pytest.raises(ValueError, match=match):
        token_logprobs(x, t, **kwargs)


def test_invalid_shapes_and_dtypes_are_rejected():
    x, t = _inputs()
    with pytest.raises(ValueError, match=r"targets: expected integer ids of shape \(48,\)"):
        token_logprobs(x, t[:5])
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(x, t.float())
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        token_logprobs(x.double(), t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy", [False, True])
def test_caller_logits_unchanged_after_forward_and_backward(dtype, entropy):
    x, t = _inputs(dtype=dtype)
    w = x.clone().requires_grad_()
    logits = w * 1.0  # non-leaf, as a model's output is; the caller keeps a reference
    before = logits.detach().clone()
    out = token_logprobs(logits, t, return_entropy=entropy, temperature=0.9)
    (sum(o.sum() for o in out) if entropy else out.sum()).backward()
    assert torch.equal(logits.detach(), before)


class _GradPtr(torch.autograd.Function):
    """Identity that records where its incoming gradient lives."""
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        _GradPtr.seen.append(g.data_ptr())
        return g


def _grad_lands_in_logits(keep: str, **kwargs) -> bool:
    x, t = _inputs()
    w = x.requires_grad_()
    _GradPtr.seen.clear()
    logits = _GradPtr.apply(w)
    ptr = logits.data_ptr()
    held = {"ref": logits, "view": logits[:2], "detached": logits.detach(), "none": None}[keep]
    lp = token_logprobs(logits, t, **kwargs)
    del logits
    lp.sum().backward()
    del held
    return _GradPtr.seen[0] == ptr


def test_auto_inplace_only_when_autograd_holds_the_sole_reference():
    assert _grad_lands_in_logits("none")
    assert not _grad_lands_in_logits("ref")
    assert not _grad_lands_in_logits("view")
    assert not _grad_lands_in_logits("detached")
    assert not _grad_lands_in_logits("none", inplace_backward=False)
    assert _grad_lands_in_logits("ref", inplace_backward=True)  # the explicit, documented mode


def test_auto_inplace_gradient_is_still_correct():
    x, t = _inputs()
    lp_r, _, x64 = _reference(x, t, temperature=0.8)
    lp_r.sum().backward()
    w = x.clone().requires_grad_()
    logits = w * 1.0
    lp = token_logprobs(logits, t, temperature=0.8)
    del logits
    lp.sum().backward()
    torch.testing.assert_close(w.grad.double(), x64.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("entropy", [False, True])
def test_rows_with_zero_upstream_grad_are_skipped_and_get_exact_zeros(entropy):
    x, t = _inputs()
    x[5, 10] = float("nan")  # a skipped row is never read in backward
    xl = x.clone().requires_grad_()
    out = token_logprobs(xl, t, return_entropy=entropy, chunk_rows=4)
    lp = out[0] if entropy else out
    g = torch.ones(N)
    g[[0, 5, 6, 20]] = 0.0
    loss = (lp * g).nansum() + ((out[1] * g).nansum() if entropy else 0.0)
    loss.backward()
    for r in (0, 5, 6, 20):
        assert torch.equal(xl.grad[r], torch.zeros(V))
    keep = g.bool() & (torch.arange(N) != 5)
    lp_r, ent_r, x64 = _reference(x, t)
    ((lp_r + (ent_r if entropy else 0.0)) * keep).sum().backward()
    torch.testing.assert_close(xl.grad[keep].double(), x64.grad[keep], rtol=0, atol=1e-5)


def test_minus_inf_logits_keep_entropy_and_grads_finite():
    x, t = _inputs()
    x[:, :100] = float("-inf")  # e.g. banned tokens
    t = 100 + t % (V - 100)
    xl = x.clone().requires_grad_()
    lp, ent = token_logprobs(xl, t, return_entropy=True)
    (lp + ent).sum().backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(xl.grad).all()
    lp_r, ent_r, _ = _reference(x[:, 100:], t - 100)
    torch.testing.assert_close(ent.double(), ent_r, rtol=0, atol=1e-5)
    assert torch.equal(xl.grad[:, :100], torch.zeros(N, 100))


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `addr` (Linux /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_a_fresh_large_cpu_gradient_asks_for_huge_pages():
    """When the caller keeps its logits, backward allocates the gradient. At 2048 x 75968 bf16 the
    4 KiB first-touch page faults of that buffer were about half of backward's time; the buffer
    must carry MADV_HUGEPAGE (VmFlags "hg"), which the kernel honours in THP mode madvise/always."""
    from megatron_cispo.vocab_softmax import HUGE_MIN_BYTES, HUGE_PAGE

    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                pytest.skip("transparent huge pages are off on this kernel")
    except OSError:
        pytest.skip("no transparent huge pages (not Linux)")
    n, v = 1024, HUGE_MIN_BYTES // (1024 * 2)  # a bf16 gradient of exactly HUGE_MIN_BYTES
    x = torch.zeros(n, v, dtype=torch.bfloat16).requires_grad_()
    logits = x * 1.0  # the caller keeps this reference: no in-place gradient
    seen = []
    logits.register_hook(lambda g: seen.append((g.data_ptr(), g.nbytes, _vm_flags(g.data_ptr() + HUGE_PAGE))))
    token_logprobs(logits, torch.zeros(n, dtype=torch.long)).sum().backward()
    ptr, nbytes, flags = seen[0]
    assert ptr != logits.data_ptr() and nbytes == HUGE_MIN_BYTES
    assert "hg" in flags, flags
