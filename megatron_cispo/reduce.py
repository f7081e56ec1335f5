"""Exact reductions of loss metrics over microbatches and data-parallel ranks.

A microbatch report is {"sum": {k: [sum, count]}, "min": {k: v}, "max": {k: v},
"total": {k: v}}. `reduce_reports` sums, mins and maxes the reports of every microbatch
locally, then over the DP group with one SUM, one MIN and one MAX all-reduce, and forms each
mean once, after the global sum. Means are never averaged.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

KINDS = ("sum", "min", "max", "total")


def make_report(out) -> dict[str, dict[str, Tensor]]:
    """Report of one microbatch from a PolicyLossOutput's reducible metric parts (all detached)."""
    return {
        "sum": {k: torch.stack([s.detach().float(), c.detach().float()]) for k, (s, c) in out.metrics_sum.items()},
        "min": {k: v.detach().float().reshape(()) for k, v in out.metrics_min.items()},
        "max": {k: v.detach().float().reshape(()) for k, v in out.metrics_max.items()},
        "total": {k: v.detach().float().reshape(()) for k, v in out.metrics_total.items()},
    }


def merge_reports(reports: list[dict]) -> dict[str, dict[str, Tensor]]:
    """Combine microbatch reports on one rank (no communication)."""
    merged: dict[str, dict[str, Tensor]] = {k: {} for k in KINDS}
    ops = {"sum": torch.add, "total": torch.add, "min": torch.minimum, "max": torch.maximum}
    for rep in reports:
        for kind in KINDS:
            for k, v in rep.get(kind, {}).items():
                cur = merged[kind].get(k)
                merged[kind][k] = v.clone() if cur is None else ops[kind](cur, v)
    return merged


def _all_reduce(t: Tensor, op, group) -> Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def reduce_reports(reports: list[dict], group=None) -> dict[str, float]:
    """Global metrics from this rank's microbatch reports, reduced over `group` (the DP group).

    Every rank of `group` must hold the same metric keys (same loss config), even with no
    microbatches. Collectives: one SUM, one MIN, one MAX all-reduce on small packed tensors.
    """
    m = merge_reports(reports)
    sum_keys, total_keys = sorted(m["sum"]), sorted(m["total"])
    min_keys, max_keys = sorted(m["min"]), sorted(m["max"])
    packed = torch.cat([torch.stack([m["sum"][k] for k in sum_keys]).reshape(-1) if sum_keys else torch.zeros(0),
                        torch.stack([m["total"][k] for k in total_keys]) if total_keys else torch.zeros(0)])
    packed = _all_reduce(packed.double(), dist.ReduceOp.SUM, group)
    mins = _all_reduce(torch.stack([m["min"][k] for k in min_keys]) if min_keys else torch.zeros(0),
                       dist.ReduceOp.MIN, group)
    maxs = _all_reduce(torch.stack([m["max"][k] for k in max_keys]) if max_keys else torch.zeros(0),
                       dist.ReduceOp.MAX, group)
    out: dict[str, float] = {}
    pairs = packed[: 2 * len(sum_keys)].reshape(-1, 2)
    for k, (s, c) in zip(sum_keys, pairs.tolist()):
        out[k] = s / c if c > 0 else 0.0
    for k, v in zip(total_keys, packed[2 * len(sum_keys):].tolist()):
        out[k] = v
    for k, v in zip(min_keys, mins.tolist()):
        out[k] = v
    for k, v in zip(max_keys, maxs.tolist()):
        out[k] = v
    return out
