"""The bytes of each part of runner/memory_plan.py, from the config alone: parameters per rank and stage, the
rollout batch, one microbatch's activations, the head's workspace and the weights a rank pushes.

    s = Shape.of(cfg.model); dense, expert = stage_params(s, tp=2, pp=1, ep=1, stage=0)
    activation_bytes(cfg, s, in_flight=1, last=True, device="cpu")

Pure arithmetic: no model, no megatron-core. Each term names the tensors it counts (megatron-core 0.16's local
and Transformer Engine layers, runner/attention.py, the heads); benchmarks/bench_memory_plan.py checks the sums.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..fused_head import default_chunk_rows
from ..rollout.engine import engine_spec
from ..rollout.vllm_options import engine_length
from ..vocab_softmax import CHUNK_BYTES

BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class Shape:
    """The trainer model's widths, from model.hf_path's config.json or the synthetic GPT's keys."""

    vocab: int  # embedding rows (padded)
    vocab_real: int  # the vocabulary's own rows: what an HF-named weight push sends, what the head computes
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


def total_params(s: Shape) -> int:
    """The model's parameters, every layer and embedding counted once."""
    return sum(stage_params(s, tp=1, pp=1, ep=1, stage=0))


def row_tokens(cfg) -> int:
    """The longest trainer row, in targets (a row of n tokens trains n - 1): the synthetic task's sequence, or
    for prompt files the engine's longest row (prompt + completion, rollout/vllm_options.engine_length), at
    most the longest prompt + rollout.max_new_tokens where data.max_prompt_tokens bounds the prompts."""
    if cfg.data.prompts is None:
        return cfg.rollout.total_len - 1
    length = engine_length(cfg.rollout, cfg.model)[0]
    if cfg.data.max_prompt_tokens is not None:  # else the prompts may fill the engine's length (unread here)
        length = min(length, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)
    return length - 1


def pad_multiple(p) -> int:
    """Every row of a microbatch is padded to a multiple of this (step/packing.step_layout): 2 x cp under CP,
    times tp under sequence parallelism."""
    return (2 * p.cp if p.cp > 1 else 1) * (p.tp if p.sequence_parallel else 1)


def microbatch_tokens(cfg) -> int:
    """Tokens of one microbatch over its CP ranks, padding included (step/packing.py): micro_batch_size rows
    of row_tokens padded to pad_multiple (padded [b, s] microbatches), or a packed bin of at most
    max_tokens_per_microbatch real tokens from at most micro_batch_size rows, each padded likewise."""
    p, m = cfg.parallelism, pad_multiple(cfg.parallelism)
    rows = p.micro_batch_size * -(-row_tokens(cfg) // m) * m
    if p.max_tokens_per_microbatch is None:
        return rows
    return min(rows, p.max_tokens_per_microbatch + p.micro_batch_size * (m - 1))


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


def expert_skew(cfg, s: Shape) -> float:
    """How many times its balanced share (t x top-k) of the routed tokens one rank's experts can receive:
    megatron's alltoall dispatcher is dropless (no moe_expert_capacity_factor), so at worst every token of
    the ep ranks sends min(top-k, its local experts) copies to this rank. 0 for a dense model."""
    if not s.experts:
        return 0.0
    ep = cfg.parallelism.ep
    return ep * min(s.topk, s.experts // ep) / s.topk


def activation_bytes(cfg, s: Shape, *, in_flight: int, last: bool, device: str) -> int:
    """One rank's activations at their peak in a step: `in_flight` microbatches' saved tensors of this stage's
    layers, plus the larger of the head's tensors (last stage; they exist after the last layer's forward) and
    the reference attention's transient scores (during one layer's attention), never live at once. No
    activation recompute (the config has none). MoE: each rank's experts at their balanced share of the routed
    tokens, t x top-k; an expectation, not a bound: routing can send up to expert_skew times that."""
    p, b = cfg.parallelism, BYTES[cfg.model.dtype]
    keys = microbatch_tokens(cfg)  # K and V all-gathered over CP: the keys each query may see
    t = keys // p.cp  # this rank's tokens of one microbatch
    sp = t // p.tp if p.sequence_parallel else t  # the norms' and residual's rows under SP
    h, tp = s.hidden, p.tp
    q, kv = s.heads * s.head_dim // tp, s.groups * s.head_dim // tp
    rms = cfg.model.transformer_impl != "te" and s.norm == 1  # torch's rms_norm keeps x * rstd for its weight
    norm = (2 + rms) * sp * h  # a norm's input and output (the next linear's input), and x * rstd
    # the norm, QKV out, q/k after qk-norm (and its x * rstd) and RoPE, attention output (proj input)
    attn = norm + t * (q + 2 * kv) + t * (q + kv) * (s.qk_norm * (1 + rms) + s.rope) + t * q
    transient = 0
    if cfg.model.transformer_impl == "te":
        attn_fp32 = t * s.heads // tp * 4  # flash attention keeps the softmax's log-sum-exp only
    else:  # the reference attention (runner/attention.py)
        attn += 2 * keys * q  # K and V repeated to every head: repeat_interleave copies even without GQA
        # the blocks of rows that attend to each other: a packed bin is one [t, keys] block, padded rows (no CP)
        # are micro_batch_size blocks of [w, w]
        w = t // p.micro_batch_size
        blocks, sq, sk = (1, t, keys) if p.max_tokens_per_microbatch else (p.micro_batch_size, w, w)
        scores = blocks * s.heads // tp * sq * sk * 4  # fp32
        attn_fp32 = scores + sq * sk  # the softmax's probabilities; the bool mask masked_fill keeps
        transient = 2 * scores + sq * sk  # in its layer: the scaled scores, their masked copy, the allowed mask
    f = s.ffn // tp
    # fc1 out and the activation (fc2's input); gated, megatron's glu: fc1 out is 2f, SiLU out, x_linear +
    # glu_linear_offset (a copy, even at its default 0.0) and their product
    act = 5 if s.gated else 2
    mlp = norm + t * f * act
    if s.experts:  # the router's input and fp32 logits/probabilities; per routed token (the balanced share):
        # its dispatched copy (fc1's input), the expert's activations and those times the token's router
        # probability (megatron's per_token_scale), which fc2 keeps
        mlp = norm + t * s.topk * (h + f * (act + 1))
        attn_fp32 += 2 * t * s.experts * 4
    per_mb = (s.layers // p.pp) * ((attn + mlp) * b + attn_fp32)
    head = 0
    if last:
        v = s.vocab // tp
        head = (sp + t) * h * b  # final norm input; the output layer's (gathered) input
        if cfg.loss.head == "logits":  # fp32 logits and their gradient (DESIGN: 2x an fp32 logits shard)
            head += 2 * t * v * 4
        else:  # the backward's hidden and weight gradients; fused_grad holds an fp32 weight gradient
            head += t * h * b + v * h * (b if cfg.loss.head == "fused" else 4)
    return in_flight * per_mb + max(head, transient)


def head_workspace(cfg, s: Shape, *, tp_rank: int, device: str) -> int:
    """vocab_softmax's cached fp32 workspace on the last stage (grown, never shrunk): a chunk's rows x this TP
    rank's valid columns (vocab_softmax.plan_targets' n_valid: none past the real vocabulary), two blocks of
    them (entropy is a training metric); fused_grad holds the chunk's logits in the compute dtype first."""
    b, v = BYTES[cfg.model.dtype], s.vocab // cfg.parallelism.tp
    nv = max(0, min(v, s.vocab_real - tp_rank * v))
    t = microbatch_tokens(cfg) // cfg.parallelism.cp
    per_chunk = max(1, CHUNK_BYTES[device] // (4 * max(1, nv)))  # rows of CHUNK_BYTES
    if cfg.loss.head == "logits":  # token_logprobs: CHUNK_BYTES of rows, whatever the microbatch
        return 2 * per_chunk * nv * 4
    if cfg.loss.head == "fused":
        return 2 * default_chunk_rows(t, 8) * nv * 4
    rows = default_chunk_rows(t, b)
    return rows * nv * b + 2 * min(rows, per_chunk) * nv * 4


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
    return (dense * (j == 0) + expert * (j < p.ep)) * BYTES[cfg.model.dtype]
