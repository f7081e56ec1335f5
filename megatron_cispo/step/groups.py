"""The process groups the step runs over: megatron-core's ProcessGroupCollection, passed in.

    pg = default_groups(pg_collection)   # at each public entry: the caller's collection, else megatron's
    size(pg.dp), rank(pg.tp), is_last_stage(pg), last_rank(pg)

policy_step, compute_logprobs, make_loss_func, make_forward_step and step_layout take
`pg_collection=` (what megatron-core's models and the Megatron-LM drop-in carry from 0.19 on) and
hand it to every helper. Without one, `default_groups` builds it from megatron's parallel_state
globals (once per policy_step, compute_logprobs or step_layout call; at each call of the loss_func or
forward_step that make_loss_func and forward_step_for return, so one built before megatron's
parallel state is up still finds it): this is the only module under step/ that reads them. A group
of None is a single rank (megatron's parallel state not initialised: a plain single-process call).
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import torch.distributed as dist

# the groups the step uses: TP, PP, CP, TP x CP (the MoE metrics), DP, DP x CP (the loss and its metrics)
NEEDED = ("tp", "pp", "cp", "tp_cp", "dp", "dp_cp")


def default_groups(pg_collection=None):
    """`pg_collection` if given (it must carry every group in NEEDED), else megatron-core's
    ProcessGroupCollection of its parallel_state globals, else (parallel state not initialised)
    single-rank groups."""
    if pg_collection is not None:
        missing = [name for name in NEEDED if not hasattr(pg_collection, name)]
        if missing:
            raise ValueError(f"pg_collection lacks the process groups {missing}; the step needs {list(NEEDED)} "
                             "(ProcessGroupCollection.use_mpu_process_groups(required_pgs=...) builds them)")
        return pg_collection
    # No import when megatron.core.parallel_state was never imported: then it is not initialised.
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is None or not mpu.model_parallel_is_initialized():
        return SimpleNamespace(**dict.fromkeys(NEEDED))  # every group of one rank
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=list(NEEDED))


def size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def is_last_stage(pg) -> bool:
    """This rank is on the last pipeline stage (the one that holds the logits and the loss)."""
    return rank(pg.pp) == size(pg.pp) - 1


def last_rank(pg) -> int:
    """The global rank of this rank's last pipeline stage (a broadcast's source)."""
    return dist.get_process_group_ranks(pg.pp)[-1]
