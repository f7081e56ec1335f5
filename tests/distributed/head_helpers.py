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


def run_tp_layouts(case, tps, vocabs, dtypes, native_vocabs) -> dict:
    """On each of 4 ranks: case(tp, group, tp_rank, single, vocab, sp, dtype, count) for every tp
    in tps (4: megatron's TP group, the default group None; 2: ranks {0,1} and {2,3}; 1: each rank
    alone), vocab, sp and dtype, keyed (tp, vocab, sp, dtype, "gloo"); then, for native_vocabs, fp32
    with sp once more through the reduce-scatter that NCCL runs ("native"), where this torch's
    gloo has it too. count is counting_collectives()'s list."""
    import torch.distributed as dist

    from megatron_cispo import fused_head
    from megatron_cispo.runner import distributed

    rank = distributed.init_distributed(tp=4).rank
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(4)]
    layouts = {4: (None, rank), 2: (pairs[rank // 2], rank % 2), 1: (singles[rank], 0)}
    real_rs_via_all_reduce = fused_head._reduce_scatter_via_all_reduce
    results = {}
    with counting_collectives() as count:
        for tp in tps:
            group, trank = layouts[tp]
            for vocab in vocabs:
                for sp in (False, True):
                    for name in dtypes:
                        results[(tp, vocab, sp, name, "gloo")] = case(
                            tp, group, trank, singles[rank], vocab, sp, name, count)
            fused_head._reduce_scatter_via_all_reduce = lambda g: False
            try:
                for vocab in native_vocabs:
                    results[(tp, vocab, True, "fp32", "native")] = case(
                        tp, group, trank, singles[rank], vocab, True, "fp32", count)
            finally:
                fused_head._reduce_scatter_via_all_reduce = real_rs_via_all_reduce
    return results


def select_cases(results, **want) -> list:
    """[((rank, key), result)] for every rank's result whose key matches want (tp=, vocab=, sp=,
    dtype=, path=); raises if none does, so a test over it cannot pass by checking nothing."""
    found = [((rank, key), r) for rank, res in enumerate(results) for key, r in res.items()
             if all(dict(zip(("tp", "vocab", "sp", "dtype", "path"), key))[k] == v for k, v in want.items())]
    assert found, f"no results for {want}"
    return found
