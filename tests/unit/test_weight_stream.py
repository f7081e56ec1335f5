"""The weight stream's pieces on one process: buckets and their blocks, the receiver's all-or-nothing
assembly, megatron's TP shard layouts named back into full tensors, and the bucket-size refusals.
The collective stream (TP gathers, PP forwarding) is tests/distributed/test_hf_layouts.py's."""
import pytest
import torch

from megatron_cispo.rollout.weight_receiver import Staging
from megatron_cispo.rollout.weight_stream import Region, _Packer, megatron_namer, tensor_buckets


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"emb": torch.randn(40, 8, generator=g), "norm": torch.randn(8, generator=g),
            "half": torch.randn(6, 8, generator=g).to(torch.bfloat16)}


def test_buckets_stay_within_their_size_and_assemble_to_the_tensors_bit_for_bit():
    t = _tensors()
    staging, sizes = Staging({k: v.shape for k, v in t.items()}), []
    for b in tensor_buckets(t, 256):  # emb (1280 bytes) goes in row blocks of at most 8 rows
        sizes.append(b.data.numel())
        assert sum(x.nbytes for x in b.blocks) == b.data.numel()
        staging.add(b.blocks, b.data)
    assert max(sizes) <= 256 and len(sizes) >= 6
    got = staging.complete()
    for k, v in t.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_a_bucket_larger_than_the_tensors_allocates_only_their_bytes_and_streams_them_unchanged():
    t = _tensors()
    total = sum(v.numel() * v.element_size() for v in t.values())  # 1280 + 32 + 96 bytes
    staging, buckets = Staging({k: v.shape for k, v in t.items()}), list(tensor_buckets(t, 256 << 20))
    assert len(buckets) == 1 and buckets[0].data.untyped_storage().nbytes() == total == 1408
    staging.add(buckets[0].blocks, buckets[0].data)
    got = staging.complete()
    for k, v in t.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_a_push_that_ends_short_or_overfills_or_strays_is_refused_naming_the_tensor():
    t = _tensors()
    manifest = {k: v.shape for k, v in t.items()}
    buckets = list(b for b in tensor_buckets(t, 256))
    short = Staging(manifest)
    for b in buckets[:-1]:
        short.add(b.blocks, b.data)
    with pytest.raises(ValueError, match=r"weight stream ended with (norm|half) (missing|at \d+/\d+ elements).*previous weights"):
        short.complete()
    twice = Staging(manifest)
    with pytest.raises(ValueError, match="more elements than its shape"):
        for b in buckets + buckets:
            twice.add(b.blocks, b.data)
    with pytest.raises(ValueError, match="block of emb, which the engine's model does not have"):
        Staging({"norm": (8,)}).add(buckets[0].blocks, buckets[0].data)
    with pytest.raises(ValueError, match=r"emb has shape \(40, 8\), the engine's model \(40, 9\)"):
        Staging({**manifest, "emb": (40, 9)}).add(buckets[0].blocks, buckets[0].data)


@pytest.mark.parametrize("dim,glu", [(-1, False), (0, False), (1, False), (0, True)], ids=["none", "rows", "cols", "glu"])
def test_megatron_tp_shards_name_back_into_the_full_tensor(dim, glu):
    """Each TP rank's shard, as megatron lays it out (a gated fc1 as [gate_r; up_r] on rank r), covers
    its part of the full tensor exactly: the blocks of both ranks assemble to it."""
    tp = 1 if dim < 0 else 2
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    if dim < 0:
        shards = [full]
    elif dim == 1:
        shards = list(full.chunk(tp, 1))
    elif glu:
        gate, up = full.chunk(2, 0)
        shards = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
    else:
        shards = list(full.chunk(tp, 0))
    staging = Staging({"w": tuple(full.shape)})
    for r, shard in enumerate(shards):
        packer = _Packer(4096, "cpu")
        for g in megatron_namer("w", tuple(full.shape), r, tp, dim, glu):
            packer.add(Region(g.name, g.shape, 0, 0, g.row, g.col), shard[g.start:g.stop])
        bucket = packer.take()
        staging.add(bucket.blocks, bucket.data)
    assert torch.equal(staging.complete()["w"], full)


def test_a_bucket_smaller_than_one_row_is_refused_in_one_line():
    from megatron_cispo.rollout.weight_stream import bucket_problem

    with pytest.raises(ValueError, match="smaller than one row of emb"):
        list(tensor_buckets(_tensors(), 16))

    class Arch:  # what hf_shapes reads of an architecture
        vocab_size, padded_vocab_size, hidden_size, head_dim, num_attention_heads, num_query_groups = 16, 16, 64, 32, 2, 2
        ffn_hidden_size, num_layers, tie_embeddings, qkv_bias, qk_norm, num_experts = 96, 1, True, True, False, None
    msg = bucket_problem(Arch(), 0.0001, tp=2)
    assert msg.startswith("rollout.sync_bucket_mb=0.0001 (104 bytes) is smaller than one row of ") and "raise it" in msg
    assert bucket_problem(Arch(), 1.0, tp=2) is None
