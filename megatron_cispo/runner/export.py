"""The trained model as a Hugging Face directory: collective over the world, rank 0 writes.

    export_chunks(chunks, arch, "runs/x/hf/step_10")   # every rank; returns once rank 0 is done

The weights are streamed (rollout/weight_stream.py: the dense ones from one sender per stage, each EP
rank's experts from its own) into hf/export.py's write_hf_stream. hf/ writes the files, this module moves
the weights: it sits above both, so hf imports nothing from the runner or the rollout code.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..base import files as durable
from ..hf.arch import HFArch
from ..hf.export import write_hf_stream


def export_chunks(chunks, arch: HFArch, out_dir, *, dtype: torch.dtype | None = None,
                  step: int | None = None, bucket_bytes: int = 256 * 2**20) -> Path:
    """Collective over the world: the model as a Hugging Face directory `out_dir`, written by rank 0;
    every rank returns after rank 0 is done. A failure on rank 0 raises checkpoint_save.SaveFailed with
    one line on every rank.

    The weights are streamed (rollout/weight_stream.py: one sender per stage for the dense weights, one
    per EP rank for its experts, buckets of `bucket_bytes`), and rank 0 writes each safetensors shard as it
    fills (write_hf_stream): no rank holds more than a shard and two buckets beyond the model."""
    import torch.distributed as dist

    from .checkpoint_save import SaveFailed, first_failure

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    error = _export_streamed(chunks, arch, out_dir, dtype, step, rank0, bucket_bytes)
    failed = first_failure(error)
    if failed is not None:
        raise SaveFailed(failed[1])
    return Path(out_dir)


def _failed(out_dir, e: BaseException) -> str:
    return f"Hugging Face export to {out_dir} not written: {durable.describe_error(e)}"


def _export_streamed(chunks, arch, out_dir, dtype, step, rank0: bool, bucket_bytes: int) -> str | None:
    """Collective: the weight stream, rank 0 writing shard by shard; rank 0's write failure as one line
    (after the rest of the stream is received: the other senders still send). A failed stream raises."""
    from ..rollout.weight_receiver import Staging
    from ..rollout.weight_stream import hf_namer, stream_buckets
    from ..hf.mapping import hf_shapes

    buckets = stream_buckets(chunks, namer=hf_namer(arch), bucket_bytes=bucket_bytes)
    if not rank0:
        for _ in buckets:
            pass
        return None
    staging, broken = Staging(hf_shapes(arch)), []

    def complete():
        while True:
            try:
                bucket = next(buckets)
            except StopIteration:
                break
            except durable.FAILURES as e:  # noqa: B014 - the stream itself failed: not a write failure
                broken.append(e)
                raise
            for name in staging.add(bucket.blocks, bucket.data):
                yield name, staging.pop(name)
        staging.complete()  # ValueError naming a tensor the stream never finished

    try:
        write_hf_stream(complete(), arch, out_dir, dtype=dtype, step=step)
    except durable.FAILURES as e:  # noqa: B014
        if broken:
            raise broken[0]
        for _ in buckets:
            pass
        return _failed(out_dir, e)
    return None
