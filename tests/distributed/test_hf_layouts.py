"""Layout independence with a real architecture: three CISPO steps from the same Hugging Face model.

qwen2 (tied embeddings, qkv bias) and qwen3_moe (qk-norm, 4 experts top-2) are loaded by
runner.model.build_model from model.hf_path and trained three steps (rollout anchor, SGD, fixed
synthetic rollouts: a sampler a little behind the trainer) on one process and on tp=2 with sequence
parallelism, pp=2 and (MoE) ep=2. Every step's metrics match the single process within 2e-4 and
the export, hf.mapping.to_hf of the gathered state, within 1e-5. The dense model's weight stream
(rollout/weight_stream.py, buckets of 4 KiB: TP gathered a row block at a time, the second stage's
sender forwarding to rank 0), assembled on rank 0, is that export bit for bit; so is the same stream
in buckets of 256 MiB, where no rank allocates a bucket larger than the model's bytes (a sender's holds
what it sends, rank 0's receive buffer the largest other sender's).
"""
import pytest
import torch

from megatron_cispo.testing import spawn


FAMILIES = ("qwen2", "qwen3_moe")
STEPS = 3
N, S = 8, 15
LENGTHS = [16, 5, 9, 12, 3, 14, 7, 11]
METRIC_TOL, EXPORT_TOL = 2e-4, 1e-5
PER_RANK = {"step/forward_calls", "step/microbatches"}
BUCKET = 4096  # bytes
LARGE = 256 << 20  # rollout.sync_bucket_mb's default, far above these models' bytes


def make_rollouts(vocab: int, step: int):
    """Step `step`'s global batch: prompt tokens 0..2 (3 for odd rows), loss on the response, per-row
    advantages, and an offset the sampler's logprobs carry against the trainer's."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, vocab, (N, S + 1), generator=g)
    lengths = torch.tensor(LENGTHS)
    prompt = 2 + torch.arange(N)[:, None] % 2
    pos = torch.arange(S)[None]
    loss_mask = (pos >= prompt) & (pos < lengths[:, None] - 1)
    return tokens, lengths, loss_mask, torch.randn(N, generator=g), -0.2 * torch.rand(N, S, generator=g)


def worker(layout: dict, paths: dict, families):
    """Per family: (each step's metrics, the exported HF tensors after the last step)."""
    from megatron.core import parallel_state as mpu

    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.hf.mapping import to_hf
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.base.weights import gather_full_state
    from megatron_cispo.step import Rollouts, StepConfig, compute_logprobs, policy_step

    tp, pp, ep = (layout.get(k, 1) for k in ("tp", "pp", "ep"))
    distributed.init_distributed(tp=tp, pp=pp, ep=ep)
    dp_rank, dp = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    step_cfg = StepConfig(micro_batch_size=2)
    loss_cfg = from_dict(LossConfig, {"cispo": {"anchor": "rollout"}})
    out = {}
    for family in families:
        cfg = ModelConfig(hf_path=paths[family])
        chunks = build_model(cfg, tp=tp, pp=pp, ep=ep, sequence_parallel=layout.get("sp", False))
        opt = build_optimizer(chunks, lr=0.1, optimizer="sgd", clip_grad=1e6)  # computes the norm, never clips
        metrics = []
        for step in range(STEPS):
            tokens, lengths, loss_mask, adv, offset = make_rollouts(cfg.vocab_size, step)
            full = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=adv, lengths=lengths,
                            rollout_logprobs=offset * loss_mask)
            shard = full.dp_shard(dp_rank=dp_rank, dp=dp, minibatches=1)
            sampled = compute_logprobs(chunks, shard, step_cfg, vocab_size=cfg.vocab_size) + shard.rollout_logprobs
            batch = Rollouts(tokens=shard.tokens, loss_mask=shard.loss_mask, advantages=shard.advantages,
                             lengths=shard.lengths, rollout_logprobs=sampled)
            metrics.append(policy_step(chunks, opt, batch, loss_cfg, step_cfg, vocab_size=cfg.vocab_size))
        out[family] = (metrics, to_hf(gather_full_state(chunks), cfg.arch), *_streamed(chunks, cfg.arch))
    return out


def _streamed(chunks, arch):
    """(the weight stream assembled into HF tensors: rank 0 only, each bucket's size, the stream in LARGE
    buckets assembled (rank 0), the bytes of every bucket buffer this rank allocated in it, its sent_bytes):
    dense models only."""
    import torch.distributed as dist

    from megatron_cispo.hf.mapping import hf_shapes
    from megatron_cispo.rollout import weight_stream
    from megatron_cispo.rollout.weight_receiver import Staging
    from megatron_cispo.rollout.weight_stream import hf_namer, sent_bytes, stream_buckets
    if arch.num_experts:
        return None, [], None, [], 0
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    staging, sizes = Staging(hf_shapes(arch)), []
    for bucket in stream_buckets(chunks, namer=hf_namer(arch), bucket_bytes=BUCKET):
        sizes.append(bucket.data.numel())
        staging.add(bucket.blocks, bucket.data)
    large, held, init = Staging(hf_shapes(arch)), [], weight_stream._Packer.__init__

    def packer(self, *a, **k):  # every sender's bucket buffer, yielded on rank 0 or not
        init(self, *a, **k)
        held.append(self.data.untyped_storage().nbytes())
    weight_stream._Packer.__init__ = packer
    try:
        for bucket in stream_buckets(chunks, namer=hf_namer(arch), bucket_bytes=LARGE):
            held.append(bucket.data.untyped_storage().nbytes())  # rank 0's own bucket or its receive buffer
            large.add(bucket.blocks, bucket.data)
    finally:
        weight_stream._Packer.__init__ = init
    return ((staging.complete() if rank0 else None), sizes, (large.complete() if rank0 else None), held,
            sent_bytes(chunks, hf_namer(arch)))


@pytest.fixture(scope="module")
def reference(hf_models):
    return spawn(worker, 1, ({}, hf_models, FAMILIES))[0]


@pytest.mark.parametrize("layout,families", [
    ({"tp": 2, "sp": True}, FAMILIES), ({"pp": 2}, FAMILIES), ({"ep": 2}, ("qwen3_moe",)),
], ids=["tp2_sp", "pp2", "moe_ep2"])
def test_three_cispo_steps_match_single_process(hf_models, reference, layout, families):
    from safetensors.torch import load_file

    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("ep", 1)
    results = spawn(worker, world, (layout, hf_models, families))
    for family in families:
        ref_metrics, ref_export = reference[family][:2]
        assert ref_metrics[-1]["step/optimizer_steps"] == 1.0 and ref_metrics[-1]["step/grad_norm"] > 0
        loaded = load_file(f"{hf_models[family]}/model.safetensors")
        moved = max((ref_export[k] - loaded[k]).abs().max().item() for k in loaded)
        assert moved > 100 * EXPORT_TOL, f"{family}: three steps moved no weight by more than {moved:.3g}"
        for rank, res in enumerate(results):
            metrics, export, streamed, sizes, large, held, sent = res[family]
            if family != "qwen3_moe":  # no buffer above what fills it: a sender's sent bytes, the model's at most
                model = sum(t.numel() * t.element_size() for t in export.values())
                assert max(held, default=0) <= min(model, LARGE) and (sent == 0) == (held == []), (rank, held, sent)
                assert set(held) <= {sent} | {r[family][6] for r in results}, (rank, held)
            if family != "qwen3_moe" and rank == 0:  # the stream is the export, exactly, whatever the bucket
                assert len(sizes) >= 10 and max(sizes) <= BUCKET, sizes
                assert set(streamed) == set(export) == set(large)
                for name, t in export.items():
                    assert torch.equal(streamed[name], t), f"stream {family} {name}"
                    assert torch.equal(large[name], t), f"stream in {LARGE}-byte buckets {family} {name}"
            elif family != "qwen3_moe":
                assert streamed is None and large is None and sizes == [], (rank, sizes)  # only rank 0 receives
            for step, (got, want) in enumerate(zip(metrics, ref_metrics)):
                assert set(got) == set(want), f"{family} step {step}"
                for key, value in want.items():
                    if key not in PER_RANK:
                        assert got[key] == pytest.approx(value, rel=METRIC_TOL, abs=METRIC_TOL), \
                            f"{family} rank {rank} step {step} {key}: {got[key]} vs {value}"
            assert set(export) == set(ref_export), family
            for name, want in ref_export.items():
                torch.testing.assert_close(export[name], want, rtol=0, atol=EXPORT_TOL, msg=f"{family} {name}")
