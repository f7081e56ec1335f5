"""Each rank's memory, estimated from the config alone: what `train --check` prints and run.gpu_memory_gb checks.

    plan = memory_plan(cfg, world_size=16)   # [RankGroup]: ranks that hold the same parts, and those parts
    print(format_plan(plan, cfg))            # one comment line per group and part
    check_fits(cfg, plan)                    # ConfigError naming the largest part when a rank exceeds the GPU

Pure arithmetic on the config (each part's bytes: runner/memory_parts.py): no model, no megatron-core. Bytes
per rank of the trainer's weights, gradients (megatron's fp32 grad buffer), optimizer state (fp32 master weights
of bf16 parameters, Adam's two moments; sharded over DP x CP by optimizer.distributed), the activation bound of
one step (for MoE at balanced routing: an expectation, memory_parts.expert_skew), the head's workspace, the
weight-sync buckets, the sampler's lagged versions and the rollout engine. benchmarks/bench_memory_plan.py
compares it with torch's own allocator accounting on CPU (docs/benchmarks.md, "Memory plan").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ConfigError
from ..rollout.engine import engine_spec, runs_on_cuda
from ..rollout.placement import colocated_rank
from .memory_parts import (BYTES, Shape, activation_bytes, batch_bytes, expert_skew, head_workspace,
                           microbatch_tokens, pushed_bytes, stage_params, total_params)

GIB = 2**30
ADAM_STATES, SGD_STATES = 2, 1  # fp32 tensors per parameter: exp_avg and exp_avg_sq; megatron's SGD momentum
VLLM_GPU_UTIL = 0.9  # vLLM's own default gpu_memory_utilization: the share of its GPU it claims at start
GATHER_MIN = 1 << 20  # weight_stream._gather's smallest receive buffer
# The parts, in print order; "resident" ones are held throughout, "train" ones during the policy step only and
# "sync" ones while the weights stream into the engine (the push and the step never overlap): a rank's total
# is resident + max(train, sync).
PHASE = {"weights": "resident", "gradients": "resident", "optimizer state": "resident", "activations": "train",
         "head workspace": "resident", "rollout batch": "train", "weight-sync buckets": "sync",
         "batch broadcast": "sync", "lagged versions": "resident", "rollout engine": "resident",
         "engine update": "sync"}
FIX = {"weights": "raise parallelism.tp or parallelism.pp",
       "gradients": "raise parallelism.tp or parallelism.pp",
       "optimizer state": "set optimizer.distributed: true (sharded over dp x cp), or raise parallelism.tp/pp",
       "activations": "lower parallelism.max_tokens_per_microbatch or micro_batch_size, or raise tp (with "
                      "sequence_parallel) or cp",
       "head workspace": "use loss.head: fused",
       "rollout batch": "lower rollout.prompts_per_step or rollout.group_size (every rank holds the global batch)",
       "batch broadcast": "lower rollout.prompts_per_step or rollout.group_size (every rank holds the global batch)",
       "weight-sync buckets": "lower rollout.sync_bucket_mb",
       "lagged versions": "lower rollout.staleness, or use rollout.mode: async",
       "rollout engine": "lower rollout.vllm.gpu_memory_utilization (vLLM's share of the GPU it shares with rank 0)",
       "engine update": "sample with rollout.engine: vllm (its weights live in its own process)"}


def _in_flight(cfg, stage: int, microbatches: int) -> int:
    """Microbatches whose activations stage `stage` holds at once (1F1B; interleaved: warm-up + 1 chunks)."""
    p = cfg.parallelism
    if p.vp is None:
        return min(microbatches, p.pp - stage)
    chunks = min(microbatches * p.vp, (p.pp - stage - 1) * 2 + (p.vp - 1) * p.pp + 1)
    return math.ceil(chunks / p.vp)  # each chunk holds 1/vp of the stage's layers


@dataclass(frozen=True)
class RankGroup:
    ranks: list[int]
    stage: int
    parts: dict  # part name -> bytes (PHASE order)

    @property
    def total(self) -> int:
        by = {ph: sum(v for k, v in self.parts.items() if PHASE[k] == ph) for ph in ("resident", "train", "sync")}
        return by["resident"] + max(by["train"], by["sync"])


def _rank_parts(cfg, s: Shape, *, world: int, rank: int, dp: int, device: str,
                pushed: list[int], nnodes: int = 1) -> tuple[int, tuple]:
    p, o, r = cfg.parallelism, cfg.optimizer, cfg.rollout
    per_stage = world // p.pp
    stage, inner = divmod(rank, per_stage)  # megatron's order: tp innermost, then cp, dp; pp outermost
    tpr, j = inner % p.tp, inner // p.tp  # tp rank, index over dp x cp
    b = BYTES[cfg.model.dtype]
    dense, expert = stage_params(s, tp=p.tp, pp=p.pp, ep=p.ep, stage=stage)
    n = dense + expert
    state = (ADAM_STATES if o.name == "adam" else SGD_STATES) + (b < 4)  # + fp32 master weights of bf16
    shards = (dp * p.cp, dp * p.cp // p.ep) if o.distributed else (1, 1)
    parts = {"weights": n * b, "gradients": n * 4,  # grad_reduce_in_fp32: an fp32 buffer, never sharded
             "optimizer state": 4 * state * (dense // shards[0] + expert // shards[1])}
    mbs = math.ceil(r.batch_size // dp / p.micro_batch_size)
    last = stage == p.pp - 1
    parts["activations"] = activation_bytes(cfg, s, in_flight=_in_flight(cfg, stage, mbs), last=last, device=device)
    parts["head workspace"] = head_workspace(cfg, s, tp_rank=tpr, device=device) if last else 0
    # the step's batch and this rank's DP shard of it (runner/loop._step); during the sampling the new batch and
    # its pickled bytes (broadcast_object_list)
    parts["rollout batch"] = batch_bytes(cfg, s) + batch_bytes(cfg, s) // dp
    parts["batch broadcast"] = 2 * batch_bytes(cfg, s)
    sent = dense * (j == 0) + expert * (j < p.ep)  # the copy this rank sends (DP = CP = 0; expert DP = 0)
    bucket = int(r.sync_bucket_mb * 2**20)
    spec = engine_spec(r.engine)
    own = spec.overlaps and rank == 0  # an engine in its own process: rank 0 packs into its shared bucket file
    if r.sync == "stream":  # each buffer holds what fills it, a bucket at most (weight_stream.stream_buckets):
        # the sender's bucket; rank 0 receives the other senders' (into the engine's shared file on CPU)
        received = min(bucket, max(pushed[1:], default=0)) * (rank == 0) * (not own or device == "cuda")
        sync = min(bucket, pushed[rank]) * (not own) + received
        if sent and tpr == 0 and p.tp > 1:  # the TP gather's buffer: one row block of the largest shard per peer
            shard = max(s.vocab * s.hidden, s.hidden * (s.heads + 2 * s.groups) * s.head_dim,
                        s.hidden * s.ffn * (2 if s.gated else 1)) // p.tp * b
            sync += max(GATHER_MIN, min(bucket // p.tp, shard) * (p.tp - 1))
        keep = r.staleness + 1 if r.mode == "sync" and r.staleness > 0 else 0
        parts["lagged versions"] = keep * sent * b  # the live version's copy and `staleness` older ones
    else:  # disk: every rank gathers the whole model in fp32
        sync = total_params(s) * 4
    parts["weight-sync buckets"] = sync
    full = total_params(s)
    if rank == 0 and not spec.overlaps:  # in-process engines: rank 0 holds the whole model
        parts["rollout engine"] = full * BYTES[r.precision]
        parts["engine update"] = full * b + full * BYTES[r.precision]  # staging + the new copy
    elif own and device == "cpu" and r.sync == "stream":  # the shared bucket file, mapped by rank 0 too: sparse,
        parts["rollout engine"] = min(bucket, max(pushed))  # so memory where a bucket was written only
    elif spec.overlaps and cfg.run.gpu_memory_gb is not None and r.placement == "local":
        # vLLM's share of the GPUs it shares with trainer ranks (rollout/placement.py: replica k on node k % nnodes,
        # GPU engine_gpus[k] of it, where local rank g trains on GPU g; a GPU past them is the engines' own)
        here = sum(colocated_rank(cfg, k, world=world, nnodes=nnodes) == rank for k in range(r.engines))
        if here:
            util = r.vllm.get("gpu_memory_utilization", VLLM_GPU_UTIL)
            parts["rollout engine"] = int(here * util * cfg.run.gpu_memory_gb * GIB)
    return stage, tuple(parts.items())


def plan_device(cfg) -> str:
    """"cuda" where the run is on CUDA GPUs (rollout.engine.runs_on_cuda: a Transformer Engine recipe, or CUDA
    here), else "cpu"."""
    return "cuda" if runs_on_cuda(cfg.model) else "cpu"


def memory_plan(cfg, world_size: int, device: str | None = None, nnodes: int = 1) -> list[RankGroup]:
    """Every rank's parts; ranks with identical parts grouped, in rank order. nnodes: the nodes the world runs on
    (where the local engine replicas sit: rollout/placement.py)."""
    p = cfg.parallelism
    dp = world_size // (p.tp * p.pp * p.cp)
    s, device = Shape.of(cfg.model), device or plan_device(cfg)
    groups: dict[tuple, RankGroup] = {}
    pushed = [pushed_bytes(cfg, s, world=world_size, rank=q) for q in range(world_size)]
    for rank in range(world_size):
        stage, parts = _rank_parts(cfg, s, world=world_size, rank=rank, dp=dp, device=device, pushed=pushed,
                                   nnodes=nnodes)
        g = groups.setdefault((stage, parts), RankGroup([], stage, dict(parts)))
        g.ranks.append(rank)
    return list(groups.values())


def _ranks(ranks: list[int]) -> str:
    spans, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            spans.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(spans)


def gib(n: float) -> str:
    return f"{n / GIB:.3g} GiB" if n >= GIB / 10 else f"{n / 2**20:.3g} MiB"


def format_plan(plan: list[RankGroup], cfg) -> str:
    """Comment lines (the YAML --check prints stays valid): per group of ranks, each part and the total."""
    out = [f"# memory per rank (estimate; {', '.join(f'{k}: {v}' for k, v in _settings(cfg).items())}):"]
    for g in plan:
        parts = ", ".join(f"{k} {gib(v)}" for k, v in g.parts.items() if v)
        out.append(f"#   ranks {_ranks(g.ranks)} (pp stage {g.stage}): {gib(g.total)} = {parts}")
    skew = expert_skew(cfg, Shape.of(cfg.model))
    if skew > 1:
        out.append(f"#   (MoE: activations at balanced routing; the dropless dispatcher can give one rank's experts "
                   f"up to {skew:g}x their share of the routed tokens)")
    return "\n".join(out) + "\n"


def _settings(cfg) -> dict:
    o = cfg.optimizer
    return {"model": cfg.model.dtype, "optimizer": f"{o.name}{' distributed' if o.distributed else ''}",
            "head": cfg.loss.head, "tokens/microbatch": microbatch_tokens(cfg), "recompute": "none"}


def check_fits(cfg, plan: list[RankGroup]) -> None:
    """ConfigError in one line when the largest rank needs more than run.gpu_memory_gb."""
    limit = cfg.run.gpu_memory_gb
    if limit is None:
        return
    worst = max(plan, key=lambda g: g.total)
    if worst.total <= limit * GIB:
        return
    name, size = max(worst.parts.items(), key=lambda kv: kv[1])
    raise ConfigError(f"rank {worst.ranks[0]} needs {gib(worst.total)} > run.gpu_memory_gb={limit:g}: "
                      f"{name} {gib(size)} is the largest part; {FIX[name]}")
