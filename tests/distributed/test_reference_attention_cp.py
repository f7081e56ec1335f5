"""Context parallelism with ReferenceCoreAttention: a GPTModel on CP=2 gloo ranks against the same
model on one process, for packed THD and for sbhd, with learned positions and with RoPE.

Each rank's logits must equal the single-process logits of the tokens it holds, and the parameter
gradients summed over the CP group must equal the single-process gradients. The THD split is
written out by hand here, and must agree with `thd_partitioned_indices` and megatron's own split.
"""
import inspect

import pytest
import torch

from megatron_cispo.testing import spawn

V, CP = 32, 2
LENS, PADDED = [5, 8, 3], [8, 8, 4]  # THD: each padded to a multiple of 2*CP
B, S = 2, 8  # sbhd
CASES = [(fmt, pe) for fmt in ("thd", "sbhd") for pe in ("learned_absolute", "rope")]


def thd_partition(padded, cp, rank):
    """Global token indices rank `rank` holds in TE's thd_get_partitioned_indices layout: chunks
    r and 2cp-1-r of every sequence, sequence by sequence."""
    out, start = [], 0
    for n in padded:
        c = n // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            out += range(start + chunk * c, start + (chunk + 1) * c)
        start += n
    return torch.tensor(out)


def _inputs(fmt, cp, rank):
    """tokens, position_ids, packed_seq_params, the global index of every local token, loss weights."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.utils import get_batch_on_this_cp_rank

    g = torch.Generator().manual_seed(11)
    if fmt == "thd":
        t = sum(PADDED)
        tokens = torch.randint(0, V, (1, t), generator=g)
        positions = torch.cat([torch.arange(n) for n in PADDED])[None]
        cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
        cu_padded = torch.tensor([0, *torch.tensor(PADDED).cumsum(0).tolist()], dtype=torch.int32)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                              cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(PADDED), max_seqlen_kv=max(PADDED))
        index = thd_partition(PADDED, cp, rank)[None]
        weights = torch.randn(1, t, V, generator=g)
        return tokens[:, index[0]], positions[:, index[0]], psp, index, weights[:, index[0]]
    tokens = torch.randint(0, V, (B, S), generator=g)
    weights = torch.randn(B, S, V, generator=g)
    batch = {"tokens": tokens, "position_ids": torch.arange(S).expand(B, S), "index": torch.arange(S).expand(B, S),
             "weights": weights}
    # megatron's own split: chunks r and 2cp-1-r (0.18+ takes is_hybrid_cp, required)
    hybrid = {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters else {}
    batch = get_batch_on_this_cp_rank(batch, **hybrid)
    return batch["tokens"], batch["position_ids"], None, batch["index"], batch["weights"]


def cp_worker(cp):
    """Every case on this rank: local logits, their global token index, CP-summed gradients."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.attention import with_reference_attention
    from megatron_cispo.base.weights import init_layout_independent

    distributed.init_distributed(cp=cp)
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, context_parallel_size=cp,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    spec = with_reference_attention(get_gpt_layer_local_spec())
    results = {}
    for fmt, pe in CASES:
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=V, max_sequence_length=16,
                         position_embedding_type=pe)
        init_layout_independent(model, seed=3, std=0.3)  # the same weights on every layout
        tokens, positions, psp, index, weights = _inputs(fmt, cp, mpu.get_context_parallel_rank())
        logits = model(tokens, positions, None, packed_seq_params=psp)  # [b, s_local, V]
        (logits * weights).sum().backward()
        grads = {}
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad, group=mpu.get_context_parallel_group())
            grads[name] = p.grad
        results[fmt, pe] = {"logits": logits.detach(), "index": index, "grads": grads}
    return results


@pytest.fixture(scope="module")
def runs():
    reference = spawn(cp_worker, 1, (1,))[0]
    return reference, spawn(cp_worker, CP, (CP,))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_thd_partitioned_indices_is_the_te_layout(cp):
    from megatron_cispo.runner.attention import thd_partitioned_indices

    padded = [8, 16, 8]
    cu = torch.tensor([0, 8, 24, 32], dtype=torch.int32)
    parts = [thd_partitioned_indices(cu, 32, cp, r) for r in range(cp)]
    for r, got in enumerate(parts):
        assert got.tolist() == thd_partition(padded, cp, r).tolist()
    assert sorted(torch.cat(parts).tolist()) == list(range(32))


def test_one_sequence_split_is_megatrons_get_batch_on_this_cp_rank(runs):
    from megatron_cispo.runner.attention import thd_partitioned_indices

    for rank, r in enumerate(runs[1]):
        for row in r["sbhd", "learned_absolute"]["index"]:
            assert row.tolist() == thd_partitioned_indices(torch.tensor([0, S]), S, CP, rank).tolist()


@pytest.mark.parametrize("fmt, pe", CASES)
def test_cp2_matches_one_process_logits_and_grads(runs, fmt, pe):
    reference, ranks = runs
    ref = reference[fmt, pe]
    seen = torch.zeros_like(ref["index"], dtype=torch.bool)
    for r in ranks:
        got = r[fmt, pe]
        want = torch.gather(ref["logits"], 1, got["index"][..., None].expand(*got["index"].shape, V))
        torch.testing.assert_close(got["logits"], want, rtol=0, atol=1e-5)
        seen[:, got["index"][0]] = True
    assert seen.all()  # the ranks together hold every token
    for name, want in ref["grads"].items():
        scale = want.abs().max().clamp(min=1.0)  # grads reach tens here: compare relative to that
        for r in ranks:
            torch.testing.assert_close(r[fmt, pe]["grads"][name] / scale, want / scale, rtol=0, atol=1e-5,
                                       msg=f"{fmt}/{pe}: {name}")
