"""Where the rollout engine's replicas run, from the config and the job's shape: replica k on node k % nodes
(rollout.placement: local, beside that node's first rank: node_engines.py) on GPU rollout.engine_gpus[k] of
that node, or (placement: ray) on GPUs Ray was started with, apart from the trainer's. `train --check`
refuses here what cannot be placed, knowing the nodes (--nnodes) and their GPUs (run.gpus_per_node).

    problem = gpus_problem(cfg, world=16, nnodes=2)   # None, or one line: an engine on a GPU a node lacks, ...
    rank = colocated_rank(cfg, k, world=16, nnodes=2)  # the trainer rank whose GPU replica k shares, or None
"""
from __future__ import annotations

from typing import Optional

from .engine import engine_spec, runs_on_cuda


def replica_node(k: int, nodes: int) -> int:
    """The node of replica k: the replicas go round the nodes, so each node hosts as few as possible."""
    return k % nodes


def replica_gpus(rollout) -> list[Optional[int]]:
    """Each replica's GPU among its node's: rollout.engine_gpus, else None (the GPU its host process has)."""
    return list(rollout.engine_gpus) if rollout.engine_gpus is not None else [None] * rollout.engines


def shared_gpu_problem(rollout, nodes: int) -> Optional[str]:
    """One line when two replicas on the same node are given the same GPU, else None."""
    seen: dict[tuple[int, int], int] = {}
    for k, g in enumerate(replica_gpus(rollout)):
        where = (replica_node(k, nodes), g)
        if g is not None and where in seen:
            on = (f"of node {where[0]} (replica k runs on node k % {nodes})" if nodes > 1 else
                  "of their node (on several nodes, give --check their number: --nnodes)")
            return (f"rollout.engine_gpus={rollout.engine_gpus}: replicas {seen[where]} and {k} would share GPU {g} "
                    f"{on}; give each replica on a node its own GPU")
        seen[where] = k
    return None


def per_node(world: int, nnodes: int) -> int:
    """Trainer processes on each node (torchrun's --nproc-per-node); ValueError when nnodes does not divide world."""
    if nnodes < 1 or world % nnodes:
        raise ValueError(f"--nnodes {nnodes} must be >= 1 and divide the world size {world} (torchrun starts the same "
                         "number of processes on every node)")
    return world // nnodes


def colocated_rank(cfg, k: int, *, world: int, nnodes: int) -> Optional[int]:
    """The global rank whose GPU local replica k shares (local rank g trains on GPU g), or None: a GPU of its own."""
    p = per_node(world, nnodes)
    g = replica_gpus(cfg.rollout)[k]
    g = 0 if g is None else g
    return replica_node(k, nnodes) * p + g if g < p else None


def places_gpus(cfg) -> bool:
    """Whether the engines' GPUs are judged at all: on CUDA, for engines in their own processes."""
    return runs_on_cuda(cfg.model) and engine_spec(cfg.rollout.engine).replicas


def gpus_problem(cfg, *, world: int, nnodes: int) -> Optional[str]:
    """What cannot be placed, one line: two local replicas on one node given the same GPU; and on CUDA nodes of
    run.gpus_per_node GPUs, world // nnodes of them training: more trainer processes than GPUs, a replica on a
    GPU its node lacks, more Ray engines than the GPUs left over (without run.gpus_per_node, or on CPU, or for
    an engine inside the trainer's process, those are not judged: the start checks each node's own). ValueError
    when nnodes does not divide world."""
    r, gpus = cfg.rollout, cfg.run.gpus_per_node
    p = per_node(world, nnodes)
    shared = shared_gpu_problem(r, nnodes) if r.placement == "local" else None
    if shared or gpus is None or not places_gpus(cfg):
        return shared
    if p > gpus:
        return (f"{world} trainer processes on {nnodes} node(s) are {p} per node, more than run.gpus_per_node={gpus}: "
                "add nodes (--nnodes) or fix run.gpus_per_node")
    spare = f"{p} of each node's {gpus} GPUs train, {gpus - p} are left over for engines apart"
    if r.placement == "ray":
        tp = int(r.vllm.get("tensor_parallel_size", 1))
        if r.engines * tp > nnodes * (gpus - p):
            return (f"rollout.placement=ray: {r.engines} engines x tensor_parallel_size {tp} need {r.engines * tp} GPUs "
                    f"apart from the trainer, and {nnodes} node(s) have {nnodes * (gpus - p)} ({spare}): launch fewer "
                    "trainer processes per node, or fewer engines")
        return None
    for k, g in enumerate(replica_gpus(r)):
        if g is not None and g >= gpus:
            return (f"rollout.engine_gpus={r.engine_gpus}: replica {k} (on node {replica_node(k, nnodes)}) is given GPU "
                    f"{g}, which a node of run.gpus_per_node={gpus} does not have (0..{gpus - 1}; {spare})")
    return None
