"""Last-pipeline-stage logic: which rank holds the logits, and sharing its results.

Only the last PP stage computes logits and losses. Forward-only results (old/ref logprobs)
and reduced metrics are broadcast from it over the PP group so every rank holds them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def is_last_stage() -> bool:
    from megatron.core import parallel_state as mpu

    return mpu.is_pipeline_last_stage(ignore_virtual=True)


def _pp():
    from megatron.core import parallel_state as mpu

    return (mpu.get_pipeline_model_parallel_group(), mpu.get_pipeline_model_parallel_last_rank(),
            mpu.get_pipeline_model_parallel_world_size())


def broadcast_tensor_from_last_stage(value: Tensor | None, shape, dtype=torch.float32, device=None) -> Tensor:
    """Last stage passes `value`; other stages pass None and receive a tensor of `shape`."""
    group, src, size = _pp()
    if size == 1:
        return value
    if value is None:
        value = torch.empty(shape, dtype=dtype, device=device)
    value = value.contiguous()
    dist.broadcast(value, src=src, group=group)
    return value


def broadcast_object_from_last_stage(obj):
    """Broadcast a small picklable object (e.g. the reduced metrics dict) over the PP group."""
    group, src, size = _pp()
    if size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
