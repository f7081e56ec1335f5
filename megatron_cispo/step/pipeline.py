"""Last-pipeline-stage logic: which rank holds the logits, and sharing its results.

Only the last PP stage computes logits and losses. Forward-only results (old/ref logprobs)
and reduced metrics are broadcast from it over the PP group so every rank holds them.
`pg`: the step's process groups (step/groups.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .groups import is_last_stage, last_rank, size

__all__ = ["broadcast_object_from_last_stage", "broadcast_tensor_from_last_stage", "is_last_stage"]


def broadcast_tensor_from_last_stage(value: Tensor | None, shape, pg, dtype=torch.float32, device=None) -> Tensor:
    """Last stage passes `value`; other stages pass None and receive a tensor of `shape`."""
    if size(pg.pp) == 1:
        return value
    if value is None:
        value = torch.empty(shape, dtype=dtype, device=device)
    value = value.contiguous()
    dist.broadcast(value, src=last_rank(pg), group=pg.pp)
    return value


def broadcast_object_from_last_stage(obj, pg):
    """Broadcast a small picklable object (e.g. the reduced metrics dict) over the PP group."""
    if size(pg.pp) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=last_rank(pg), group=pg.pp)
    return box[0]
