"""Shared by the fused heads' TP tests (test_fused_head_tp.py, test_fused_grad_tp.py): the
collectives a call runs, and gradient errors relative to the whole gradient."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def counting_collectives():
    """Records every all-reduce (by op: 'SUM', 'MAX', ...) and fused_head's all-gather and
    reduce-scatter ('all_gather', 'reduce_scatter') into the list it yields; restores them on exit.
    Clear the list between the calls you want to tell apart."""
    import torch.distributed as dist

    from megatron_cispo import fused_head

    count: list = []
    real = (dist.all_reduce, fused_head._all_gather, fused_head._reduce_scatter)

    def recording(name, fn):
        def wrapper(*a, **k):
            count.append(name if name else str(k.get("op", dist.ReduceOp.SUM)).rsplit(".", 1)[-1])
            return fn(*a, **k)
        return wrapper

    dist.all_reduce = recording(None, real[0])
    fused_head._all_gather = recording("all_gather", real[1])
    fused_head._reduce_scatter = recording("reduce_scatter", real[2])
    try:
        yield count
    finally:
        dist.all_reduce, fused_head._all_gather, fused_head._reduce_scatter = real


def rel_to_whole(a, b, full) -> float:
    """max |a - b| over the whole gradient's largest entry (a TP shard of it may be all zeros)."""
    return ((a.float() - b.float()).abs().max() / full.float().abs().max()).item()
