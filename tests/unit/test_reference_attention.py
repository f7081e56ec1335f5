"""ReferenceCoreAttention on one process: hand-computed causal attention, GQA, packed THD through a
real GPTModel against each sequence alone, errors, device discipline and the spec rewrite.

The GPTModel tests run in this process over a 1-rank gloo group, without the CPU compatibility
layer (learned positions need none), except RoPE, which megatron builds on current_device().
"""
import contextlib
import math

import pytest
import torch

from megatron_cispo.runner.attention import ReferenceCoreAttention, with_reference_attention

V, HIDDEN, HEADS = 32, 16, 4


def _config(num_query_groups=HEADS, **kw):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=num_query_groups,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, init_method_std=0.3,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False, **kw)


def _attention(num_query_groups=HEADS, **kw):
    from megatron.core.transformer.enums import AttnMaskType

    return ReferenceCoreAttention(_config(num_query_groups), 1, AttnMaskType.causal, "self", **kw)


def _thd(cu, cu_padded=None):
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = (cu_padded if cu_padded is not None else cu).diff()
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                           cu_seqlens_kv_padded=cu_padded, max_seqlen_q=int(lens.max()),
                           max_seqlen_kv=int(lens.max()))


def _by_hand(q, k, v, scale):
    """q [s, b, np, hn], k/v [s, b, ng, hn] -> [s, b, np*hn]: one head at a time, explicit loops."""
    s, b, n_q, _ = q.shape
    per_group = n_q // k.shape[2]
    out = torch.zeros(s, b, n_q, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for h in range(n_q):
            g = h // per_group  # megatron's GQA layout: query heads of a group are adjacent
            for i in range(s):
                w = torch.softmax(torch.stack([q[i, bi, h] @ k[j, bi, g] * scale for j in range(i + 1)]), 0)
                out[i, bi, h] = sum(w[j] * v[j, bi, g] for j in range(i + 1))
    return out.reshape(s, b, -1)


@pytest.mark.parametrize("groups", [HEADS, 2], ids=["mha", "gqa"])
def test_sbhd_matches_hand_written_causal_softmax_values_and_grads(groups):
    g = torch.Generator().manual_seed(groups)
    s, b, hn = 5, 2, HIDDEN // HEADS
    q = torch.randn(s, b, HEADS, hn, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(s, b, groups, hn, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = _attention(groups)(q, k, v, None)
    assert out.shape == (s, b, HEADS * hn) and out.dtype == torch.float64
    ref = _by_hand(q, k, v, 1 / math.sqrt(hn))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_softmax_scale_argument_and_dtype_round_trip():
    q, k, v = (torch.randn(4, 1, HEADS, 4) for _ in range(3))
    out = _attention(softmax_scale=0.1)(q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _by_hand(q, k, v, 0.1).float(), rtol=0, atol=2e-2)


def test_thd_is_block_diagonal_over_padded_cu_seqlens_and_pad_rows_stay_finite():
    g = torch.Generator().manual_seed(3)
    cu, cu_padded = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32)
    q, k, v = (torch.randn(8, HEADS, 4, generator=g) for _ in range(3))
    attn = _attention()
    out = attn(q, k, v, None, packed_seq_params=_thd(cu, cu_padded))
    assert out.shape == (8, HEADS * 4) and torch.isfinite(out).all()
    for start, end in ((0, 4), (4, 8)):
        alone = attn(q[start:end, None], k[start:end, None], v[start:end, None], None)[:, 0]
        torch.testing.assert_close(out[start:end], alone, rtol=0, atol=1e-6)
    # without the padded boundaries, cu_seqlens_q itself is the block structure
    out = attn(q[:7], k[:7], v[:7], None, packed_seq_params=_thd(cu))
    torch.testing.assert_close(out[3:7], attn(q[3:7, None], k[3:7, None], v[3:7, None], None)[:, 0],
                               rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def parallel_state():
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_cispo.testing import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mpu.initialize_model_parallel()
    yield
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


def _gpt(position_embedding_type, seed=0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)
    return GPTModel(config=_config(2), transformer_layer_spec=with_reference_attention(get_gpt_layer_local_spec()),
                    vocab_size=V, max_sequence_length=16, position_embedding_type=position_embedding_type)


@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "rope"])
def test_packed_gpt_matches_each_sequence_alone_logits_and_grads(parallel_state, position_embedding_type):
    from megatron_cispo.runner.cpu_compat import CpuCompat

    lens, padded = [5, 8, 3], [6, 8, 4]  # the first and last need padding
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (1, sum(padded)), generator=g)
    positions = torch.cat([torch.arange(n) for n in padded])[None]
    real = torch.cat([torch.arange(s, s + n) for s, n in zip(cu_padded.tolist(), lens)])
    weights = torch.randn(sum(padded), V, generator=g)
    rope = position_embedding_type == "rope"
    with CpuCompat() if rope else contextlib.nullcontext():  # megatron's RoPE asks current_device()
        model = _gpt(position_embedding_type)
        logits = model(tokens, positions, None, packed_seq_params=_thd(cu, cu_padded))[0]  # [t, V]
        (logits[real] * weights[real]).sum().backward()
        packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        for start, n in zip(cu_padded.tolist(), lens):
            alone = model(tokens[:, start:start + n], torch.arange(n)[None], None)[0]
            torch.testing.assert_close(logits[start:start + n], alone, rtol=0, atol=1e-5)
            (alone * weights[start:start + n]).sum().backward()
        for name, p in model.named_parameters():
            scale = p.grad.abs().max().clamp(min=1.0)  # grads reach ~60 here: compare relative to that
            torch.testing.assert_close(packed_grads[name] / scale, p.grad / scale, rtol=0, atol=1e-5, msg=name)
        # whatever sits in the padding slots, the real tokens do not see it
        other = tokens.clone()
        pads = torch.ones(sum(padded), dtype=torch.bool)
        pads[real] = False
        other[0, pads] = (other[0, pads] + 7) % V
        again = model(other, positions, None, packed_seq_params=_thd(cu, cu_padded))[0]
        torch.testing.assert_close(again[real], logits[real], rtol=0, atol=0)


def test_never_builds_a_tensor_off_the_input_device():
    from megatron.core.packed_seq_params import PackedSeqParams

    attn = _attention(2)
    # meta inputs: shapes only; any tensor made on another device would fail to combine
    q, k = torch.empty(10, HEADS, 4, device="meta"), torch.empty(10, 2, 4, device="meta")
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device="meta")
    out = attn(q, k, k, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu))
    assert out.device.type == "meta" and out.shape == (10, HEADS * 4)
    out = attn(q[:, None], k[:, None], k[:, None], None)
    assert out.device.type == "meta" and out.shape == (10, 1, HEADS * 4)
    # CPU inputs while the default device is meta: a factory without device= would land on meta
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(10, HEADS, 4, generator=g), torch.randn(10, 2, 4, generator=g)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    want = attn(q, k, k, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu))
    with torch.device("meta"):
        got = attn(q, k, k, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu))
        sbhd = attn(q[:, None], k[:, None], k[:, None], None)
    assert got.device.type == sbhd.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(sbhd[:4, 0], want[:4], rtol=0, atol=0)


def test_attention_mask_is_applied_on_top_of_causal_in_sbhd():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(4, 1, HEADS, 4, generator=g) for _ in range(3))
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 0] = True  # megatron's convention: True = masked out; hide the first key from all
    mask[0, 0, 0, 0] = False  # ...except from itself
    attn = _attention()
    out = attn(q, k, v, mask)
    torch.testing.assert_close(out[1:], _by_hand(q[1:], k[1:], v[1:], 0.5).float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("case, message", [
    ("dropout", r"no attention dropout; got p=0.1 in training"),
    ("heads", r"4 query heads is not a multiple of 3 key/value groups"),
    ("thd_mask", r"THD attention takes its mask from cu_seqlens"),
    ("thd_no_cu", r"needs packed_seq_params.cu_seqlens_q"),
    ("cross", r"self-attention only: query has 4 tokens, key 6"),
    ("mask_type", r"causal only; got attn_mask_type=AttnMaskType.no_mask"),
    ("bias", r"does not take attention_bias"),
])
def test_unsupported_requests_are_refused_with_a_reason(case, message):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    q, k = torch.zeros(4, 1, HEADS, 4), torch.zeros(4, 1, HEADS, 4)
    attn, kw = _attention(), {}
    if case == "dropout":
        attn = _attention(attention_dropout=0.1)
        attn.eval()
        attn(q, k, k, None)  # dropout only matters in training
        attn.train()
    elif case == "heads":
        k = torch.zeros(4, 1, 3, 4)
    elif case == "thd_mask":
        q, k = q[:, 0], k[:, 0]
        kw = {"packed_seq_params": _thd(torch.tensor([0, 4], dtype=torch.int32))}
    elif case == "thd_no_cu":
        kw = {"packed_seq_params": PackedSeqParams(qkv_format="thd")}
    elif case == "cross":
        k = torch.zeros(6, 1, HEADS, 4)
    elif case == "mask_type":
        kw = {"attn_mask_type": AttnMaskType.no_mask}
    elif case == "bias":
        kw = {"attention_bias": torch.zeros(1)}
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool) if case == "thd_mask" else None
    with pytest.raises(ValueError, match=message):
        attn(q, k, k, mask, **kw)


def test_construction_refuses_what_it_cannot_compute():
    from megatron.core.transformer.enums import AttnMaskType

    with pytest.raises(ValueError, match=r"causal only; got attn_mask_type=AttnMaskType.no_mask"):
        ReferenceCoreAttention(_config(), 1, AttnMaskType.no_mask, "self")
    with pytest.raises(ValueError, match=r"no sliding window; got window_size=\(2, 0\)"):
        ReferenceCoreAttention(_config(window_size=(2, 0)), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match=r"context_parallel_size=2 but the CP group has 1 rank"):
        ReferenceCoreAttention(_config(context_parallel_size=2), 1, AttnMaskType.causal, "self")


@pytest.mark.parametrize("num_experts", [None, 4], ids=["dense", "moe"])
def test_spec_rewrite_swaps_core_attention_and_leaves_the_input_alone(num_experts):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(num_experts=num_experts)
    new = with_reference_attention(spec)
    assert new.submodules.self_attention.submodules.core_attention is ReferenceCoreAttention
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention
    assert get_gpt_layer_local_spec(num_experts=num_experts).submodules.self_attention.submodules \
        .core_attention is DotProductAttention  # megatron's cached spec is untouched
    assert new.submodules.mlp is spec.submodules.mlp
    block = with_reference_attention(TransformerBlockSubmodules(layer_specs=[spec, spec]))
    assert all(s.submodules.self_attention.submodules.core_attention is ReferenceCoreAttention
               for s in block.layer_specs)
    with pytest.raises(ValueError, match="expects a transformer layer ModuleSpec"):
        with_reference_attention(spec.submodules.self_attention)


def test_dynamic_cp_in_packed_seq_params_is_refused():
    from megatron.core.packed_seq_params import PackedSeqParams

    q = torch.zeros(4, 1, HEADS, 4)
    with pytest.raises(ValueError, match=r"no dynamic \(hybrid\) CP"):
        _attention()(q, q, q, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd", local_cp_size=1))
