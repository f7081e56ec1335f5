"""Each rank's memory, estimated from the config alone: what `train --check` prints and run.gpu_memory_gb checks.

    plan = memory_plan(cfg, world_size=16)   # [RankGroup]: ranks that hold the same parts, and those parts
    print(format_plan(plan, cfg))            # one comment line per group and part
    check_fits(cfg, plan)                    # ConfigError naming the largest part when a rank exceeds the GPU

Pure arithmetic on the config: no model, no megatron-core. Bytes per rank of the trainer's weights, gradients
(megatron's fp32 grad buffer), optimizer state (fp32 master weights of bf16 parameters, Adam's two moments;
sharded over DP x CP by optimizer.distributed), the activation bound of one step, the weight-sync buckets,
the sampler's lagged versions and the rollout engine. benchmarks/bench_memory_plan.py compares it with
torch's own allocator accounting on CPU (docs/benchmarks.md, "Memory plan").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ConfigError
from ..rollout.engine import engine_spec, runs_on_cuda
from ..fused_head import default_chunk_rows
from ..vocab_softmax import CHUNK_BYTES

GIB = 2**30
_BYTES = {"fp32": 4, "bf16": 2}
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


@dataclass(frozen=True)
class Shape:
    """The trainer model's widths, from model.hf_path's config.json or the synthetic GPT's keys."""

    vocab: int  # embedding rows (padded)
    vocab_real: int  # the vocabulary's own rows: what an HF-named weight push sends
    hidden: int
    layers: int
    heads: int
    groups: int  # key/value heads
    head_dim: int
    ffn: int  # dense MLP width, or each expert's
    experts: int  # 0: dense
    topk: int
    gated: bool  # SwiGLU: fc1 is 2 x ffn
    norm: int  # parameters per norm per hidden unit: 2 (LayerNorm) or 1 (RMSNorm)
    bias: bool  # linear biases (the synthetic dense GPT)
    qkv_bias: bool
    qk_norm: bool
    rope: bool  # else learned positions of seq_length rows
    tied: bool
    seq_length: int

    @classmethod
    def of(cls, m) -> "Shape":
        a = m.arch
        if a is not None:
            return cls(a.padded_vocab_size, a.vocab_size, a.hidden_size, a.num_layers, a.num_attention_heads,
                       a.num_query_groups, a.head_dim, a.ffn_hidden_size, a.num_experts or 0, a.moe_topk, True, 1,
                       False, a.qkv_bias, a.qk_norm, True, a.tie_embeddings, a.max_position_embeddings)
        moe = m.num_moe_experts is not None
        return cls(m.vocab_size, m.vocab_size, m.hidden_size, m.num_layers, m.num_attention_heads,
                   m.num_attention_heads, m.hidden_size // m.num_attention_heads, m.ffn_size, m.num_moe_experts or 0,
                   m.moe_router_topk, False, 2, not moe, not moe, False, False, False, m.seq_length)


def layer_params(s: Shape, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) parameters of one transformer layer on one rank (TP shards, ep-th of the experts)."""
    h, q, kv = s.hidden, s.heads * s.head_dim, 2 * s.groups * s.head_dim
    f1 = (2 if s.gated else 1) * s.ffn
    attn = s.norm * h + (h * (q + kv) + (q + kv) * s.qkv_bias) // tp + q * h // tp + h * s.bias
    attn += 2 * s.head_dim * s.qk_norm
    if not s.experts:
        return attn + s.norm * h + (h * f1 + f1 * s.bias + s.ffn * h) // tp + h * s.bias, 0
    return attn + s.norm * h + s.experts * h, s.experts // ep * (h * f1 + s.ffn * h) // tp


def stage_params(s: Shape, *, tp: int, pp: int, ep: int, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters on one rank of pipeline stage `stage`: its layers, the embedding (first
    stage), the final norm and output layer (last stage; a tied one is the embedding itself at pp 1)."""
    dense, expert = (n * (s.layers // pp) for n in layer_params(s, tp, ep))
    if stage == 0:
        dense += s.vocab * s.hidden // tp + (0 if s.rope else s.seq_length * s.hidden)
    if stage == pp - 1:
        dense += s.norm * s.hidden + (0 if s.tied and pp == 1 else s.vocab * s.hidden // tp)
    return dense, expert


def row_tokens(cfg) -> int:
    """The longest trainer row: the synthetic task's sequence, or the engine's length for prompt files."""
    if cfg.data.prompts is None:
        return cfg.rollout.total_len - 1
    length = min(cfg.model.seq_length, cfg.rollout.vllm.get("max_model_len", cfg.model.seq_length))
    if cfg.data.max_prompt_tokens is not None:  # else the prompts may fill the engine's length (unread here)
        length = min(length, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)
    return length


def batch_bytes(cfg, s: Shape) -> int:
    """The global rollout batch (rollout/sampler.Batch), which rank 0 broadcasts to every rank: per row of t
    targets (row_tokens), int64 tokens (t + 1), a bool loss mask, fp32 sampler logprobs, fp32 advantages (per
    target with rollout.credit=token), int64 length and policy version, fp32 reward, the synthetic task's bool
    correctness per answer token, and an MoE engine's int64 routes (t x layers x top-k). Kept sets
    (rollout.top_k, top_p) are not counted."""
    r = cfg.rollout
    t = row_tokens(cfg)
    row = 8 * (t + 1) + t * (1 + 4) + 4 * (t if r.credit == "token" else 1) + 8 + 8 + 4
    row += r.answer_len if cfg.data.prompts is None else 0
    row += 8 * t * s.layers * s.topk if s.experts and engine_spec(r.engine).routes else 0
    return r.batch_size * row


def activation_bytes(cfg, s: Shape, *, in_flight: int, last: bool, device: str) -> tuple[int, int]:
    """(activations, head workspace) of one rank: `in_flight` microbatches' saved tensors of this stage's
    layers, and on the last stage the head's. No activation recompute (the config has none)."""
    p, m, b = cfg.parallelism, cfg.model, _BYTES[cfg.model.dtype]
    rows = p.micro_batch_size * row_tokens(cfg)
    t = min(rows, p.max_tokens_per_microbatch or rows) // p.cp  # this rank's tokens of one microbatch
    tk = t * p.cp  # keys each query sees (K and V all-gathered over CP)
    sp = t // p.tp if p.sequence_parallel else t  # the norms' and residual's rows under SP
    h, tp = s.hidden, p.tp
    q, kv = s.heads * s.head_dim // tp, s.groups * s.head_dim // tp
    # norm inputs, QKV in/out, q/k after qk-norm and RoPE, attention output (proj input)
    attn = 2 * sp * h + t * (q + 2 * kv) + t * (q + kv) * (s.qk_norm + s.rope) + t * q
    if m.transformer_impl == "te":
        attn_fp32 = t * s.heads // tp * 4  # flash attention keeps the softmax's log-sum-exp only
    else:  # the reference attention (CPU): K, V repeated to every head, fp32 probabilities, two bool masks
        attn += 2 * tk * q * (s.groups != s.heads)
        attn_fp32 = s.heads // tp * t * tk * 4 + 2 * t * tk
    f = s.ffn // tp
    mlp = 2 * sp * h + t * f * (4 if s.gated else 2)  # norm in, fc1 in; fc1 out (+ SiLU out), fc2 in
    if s.experts:  # every token at top-k experts: dispatched in, expert MLP, expert out; fp32 router
        mlp = 2 * sp * h + t * s.topk * (2 * h + f * (4 if s.gated else 2))
        attn_fp32 += 2 * t * s.experts * 4
    per_mb = (s.layers // p.pp) * ((attn + mlp) * b + attn_fp32)
    head = workspace = 0
    if last:
        v = s.vocab // tp
        head = (sp + t) * h * b  # final norm input; the output layer's (gathered) input
        if cfg.loss.head == "logits":  # fp32 logits and their gradient (DESIGN: 2x an fp32 logits shard)
            head += 2 * t * v * 4
        else:  # the backward's hidden and weight gradients; fused_grad holds an fp32 weight gradient
            head += t * h * b + v * h * (b if cfg.loss.head == "fused" else 4)
        # vocab_softmax's cached fp32 workspace (grown, never shrunk): two blocks of a chunk's rows x v_local
        # (entropy is a training metric); fused_grad's holds the chunk's logits in the compute dtype first
        if cfg.loss.head == "logits":  # token_logprobs: CHUNK_BYTES of rows, whatever the microbatch
            workspace = 2 * max(4 * v, CHUNK_BYTES[device] // (4 * v) * v * 4)
        elif cfg.loss.head == "fused":
            workspace = 2 * default_chunk_rows(t, 8) * v * 4
        else:
            rows = default_chunk_rows(t, b)
            workspace = rows * v * b + 2 * min(rows, CHUNK_BYTES[device] // (4 * v)) * v * 4
    return in_flight * per_mb + head, workspace


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


def pushed_bytes(cfg, s: Shape, *, world: int, rank: int) -> int:
    """Bytes rank `rank` packs into weight-sync buckets per push (rollout/weight_stream.sent_bytes): on TP rank
    0, its TP group's shards of the copy it sends, gathered (DP = CP = 0: the dense weights; expert DP = 0: its
    experts), as the engine names them (HF names drop the vocabulary's padding rows and a tied output layer's copy)."""
    p = cfg.parallelism
    stage, inner = divmod(rank, world // p.pp)
    tpr, j = inner % p.tp, inner // p.tp
    if tpr:
        return 0
    dense, expert = stage_params(s, tp=1, pp=p.pp, ep=p.ep, stage=stage)
    last = stage == p.pp - 1
    if engine_spec(cfg.rollout.engine).names == "hf":
        dense -= (s.vocab - s.vocab_real) * s.hidden * ((stage == 0) + (last and not s.tied))
        dense -= s.vocab * s.hidden * (last and s.tied and p.pp > 1)
    return (dense * (j == 0) + expert * (j < p.ep)) * _BYTES[cfg.model.dtype]


def _rank_parts(cfg, s: Shape, *, world: int, rank: int, dp: int, device: str,
                pushed: list[int]) -> tuple[int, tuple]:
    p, o, r = cfg.parallelism, cfg.optimizer, cfg.rollout
    per_stage = world // p.pp
    stage, inner = divmod(rank, per_stage)  # megatron's order: tp innermost, then cp, dp; pp outermost
    tpr, j = inner % p.tp, inner // p.tp  # tp rank, index over dp x cp
    b = _BYTES[cfg.model.dtype]
    dense, expert = stage_params(s, tp=p.tp, pp=p.pp, ep=p.ep, stage=stage)
    n = dense + expert
    state = (ADAM_STATES if o.name == "adam" else SGD_STATES) + (b < 4)  # + fp32 master weights of bf16
    shards = (dp * p.cp, dp * p.cp // p.ep) if o.distributed else (1, 1)
    parts = {"weights": n * b, "gradients": n * 4,  # grad_reduce_in_fp32: an fp32 buffer, never sharded
             "optimizer state": 4 * state * (dense // shards[0] + expert // shards[1])}
    mbs = math.ceil(r.batch_size // dp / p.micro_batch_size)
    parts["activations"], parts["head workspace"] = activation_bytes(
        cfg, s, in_flight=_in_flight(cfg, stage, mbs), last=stage == p.pp - 1, device=device)
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
        parts["rollout engine"] = full * _BYTES[r.precision]
        parts["engine update"] = full * b + full * _BYTES[r.precision]  # staging + the new copy
    elif own and device == "cpu" and r.sync == "stream":  # the shared bucket file, mapped by rank 0 too: sparse,
        parts["rollout engine"] = min(bucket, max(pushed))  # so memory where a bucket was written only
    elif spec.overlaps and cfg.run.gpu_memory_gb is not None and r.placement == "local":
        # vLLM's share of the GPUs it shares with trainer ranks: rank 0's (engine_gpus null), else GPU g of rank
        # 0's node, where local rank g trains (one process per GPU; a GPU past the world is the engines' own)
        here = (r.engine_gpus or [0] * r.engines).count(rank)
        if here:
            util = r.vllm.get("gpu_memory_utilization", VLLM_GPU_UTIL)
            parts["rollout engine"] = int(here * util * cfg.run.gpu_memory_gb * GIB)
    return stage, tuple(parts.items())


def total_params(s: Shape) -> int:
    """The model's parameters, every layer and embedding counted once."""
    return sum(stage_params(s, tp=1, pp=1, ep=1, stage=0))


def plan_device(cfg) -> str:
    """"cuda" where the run is on CUDA GPUs (rollout.engine.runs_on_cuda: a Transformer Engine recipe, or CUDA
    here), else "cpu"."""
    return "cuda" if runs_on_cuda(cfg.model) else "cpu"


def memory_plan(cfg, world_size: int, device: str | None = None) -> list[RankGroup]:
    """Every rank's parts; ranks with identical parts grouped, in rank order."""
    p = cfg.parallelism
    dp = world_size // (p.tp * p.pp * p.cp)
    s, device = Shape.of(cfg.model), device or plan_device(cfg)
    groups: dict[tuple, RankGroup] = {}
    pushed = [pushed_bytes(cfg, s, world=world_size, rank=q) for q in range(world_size)]
    for rank in range(world_size):
        stage, parts = _rank_parts(cfg, s, world=world_size, rank=rank, dp=dp, device=device, pushed=pushed)
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
    return "\n".join(out) + "\n"


def _settings(cfg) -> dict:
    o, p = cfg.optimizer, cfg.parallelism
    return {"model": cfg.model.dtype, "optimizer": f"{o.name}{' distributed' if o.distributed else ''}",
            "head": cfg.loss.head, "tokens/microbatch": min(p.micro_batch_size * row_tokens(cfg),
                                                             p.max_tokens_per_microbatch or 10**18),
            "recompute": "none"}


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
