"""Exact reduction of Metrics over microbatches and a process group (the DP x CP group).

    metrics = reduce_metrics(per_microbatch_metrics, group=dp_cp_group)   # {key: float}

Microbatches are merged locally (Metrics.merge), then sums and totals go in one SUM all-reduce
(fp64) and mins and maxes in one MAX all-reduce (mins negated); each mean is formed once, after
the global sum. Buffers live on the metrics' own device, so NCCL gets CUDA tensors, and a
group holding no metric at all issues no collective.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..losses.metrics import Metrics


def all_reduce_in(t: Tensor, op, group) -> Tensor:
    """In-place all-reduce of `t` over `group`; nothing for no group, no process group, or one rank."""
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def reduced_parts(m: Metrics, group=None) -> tuple[Tensor, Tensor]:
    """(sums, extremes) all-reduced over `group`: sums = [s0, c0, s1, c1, ..., totals...] fp64 and
    extremes = [-mins..., maxs...] fp32, in sorted-key order. Collectives: SUM, then MAX."""
    device = m.device() or torch.device("cpu")
    sum_keys, total_keys = sorted(m.sums), sorted(m.totals)
    sums = torch.stack([v.reshape(()).to(device, torch.float64)
                        for k in sum_keys for v in m.sums[k]] +
                       [m.totals[k].reshape(()).to(device, torch.float64) for k in total_keys]) \
        if sum_keys or total_keys else torch.zeros(0, dtype=torch.float64, device=device)
    extremes = torch.stack([-m.mins[k].reshape(()).to(device, torch.float32) for k in sorted(m.mins)] +
                           [m.maxs[k].reshape(()).to(device, torch.float32) for k in sorted(m.maxs)]) \
        if m.mins or m.maxs else torch.zeros(0, dtype=torch.float32, device=device)
    if sums.numel():
        sums = all_reduce_in(sums, dist.ReduceOp.SUM, group)
    if extremes.numel():
        extremes = all_reduce_in(extremes, dist.ReduceOp.MAX, group)
    return sums, extremes


def reduce_metrics(metrics: Union[Metrics, Iterable[Metrics]], group=None) -> dict[str, float]:
    """Global metric values from this rank's Metrics (one, or one per microbatch), over `group`.

    Every rank of `group` must hold the same keys (same loss config), even with no microbatches.
    """
    m = metrics if isinstance(metrics, Metrics) else Metrics.merge(metrics)
    sums, extremes = reduced_parts(m, group)
    sums, extremes = sums.tolist(), extremes.tolist()
    out: dict[str, float] = {}
    sum_keys, total_keys = sorted(m.sums), sorted(m.totals)
    for i, k in enumerate(sum_keys):
        s, c = sums[2 * i], sums[2 * i + 1]
        out[k] = s / c if c > 0 else 0.0
    for k, v in zip(total_keys, sums[2 * len(sum_keys):]):
        out[k] = v
    mins = sorted(m.mins)
    for k, v in zip(mins, extremes[: len(mins)]):
        out[k] = -v
    for k, v in zip(sorted(m.maxs), extremes[len(mins):]):
        out[k] = v
    return out
