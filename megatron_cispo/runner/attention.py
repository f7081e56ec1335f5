"""An exact, dense core attention for the local (CPU) layer spec: causal, packed THD and CP > 1.

megatron-core's local DotProductAttention refuses packed sequences and context parallelism; on
GPU Transformer Engine does both. `with_reference_attention(get_gpt_layer_local_spec())` swaps in
`ReferenceCoreAttention`, so tests and the demo can run THD and CP on CPU and compare layouts.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.utils import is_layer_window_attention

from ..step.packing import cp_indices


class _AllGatherSeq(torch.autograd.Function):
    """x [s, ...] on every CP rank -> [cp*s, ...] in rank order (one all_gather). Backward sums
    the gradient over the group and keeps this rank's slice: reduce_scatter, or all_reduce and a
    slice on gloo, which has no reduce_scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "gloo":
            grad = grad.clone()  # all_reduce works in place; autograd may still hold `grad`
            dist.all_reduce(grad, group=ctx.group)
            return grad.chunk(n)[rank].contiguous(), None
        out = grad.new_empty(grad.size(0) // n, *grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


def token_positions(cu_seqlens: torch.Tensor, t_local: int, cp: int, cp_rank: int):
    """(sequence index, position in the sequence) of CP rank `cp_rank`'s local tokens, both
    [t_local] int64 on cu_seqlens' device.

    cu_seqlens: [n+1] int, the GLOBAL padded cumulative lengths (0, L_0, L_0+L_1, ...). Each L_i
    is split into 2*cp chunks and rank r holds chunks r and 2cp-1-r of every sequence, sequence
    by sequence (TE's thd_get_partitioned_indices; megatron's get_batch_on_this_cp_rank is the
    one-sequence case). Tokens past cu_seqlens[-1] form one trailing sequence of their own."""
    total = cu_seqlens.new_full((1,), t_local * cp)
    cu = torch.cat([cu_seqlens, total]).long()
    cu_local = cu // cp
    k = torch.arange(t_local, device=cu.device)
    seq = torch.searchsorted(cu_local, k, right=True) - 1
    j = k - cu_local[seq]
    c = (cu[seq + 1] - cu[seq]) // (2 * cp)  # chunk length of each token's sequence
    pos = torch.where(j < c, cp_rank * c + j, (2 * cp - 1 - cp_rank) * c + j - c)
    return seq, pos


def thd_partitioned_indices(cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int,
                            cp_rank: int) -> torch.Tensor:
    """CPU-capable stand-in for TE's tex.thd_get_partitioned_indices (same arguments): the global
    indices [total_tokens / cp_size] int64 of the packed tokens CP rank `cp_rank` holds, in order.
    It is the policy step's own split (step.packing.cp_indices), so the CP tests that split their
    data with it also prove that the packer and this module's mask agree on the layout."""
    cu = cu_seqlens_padded.long().tolist()
    segments = [b - a for a, b in zip(cu, cu[1:])] + ([total_tokens - cu[-1]] if total_tokens > cu[-1] else [])
    return cp_indices(segments, cp_size, cp_rank, cu_seqlens_padded.device)


def _check_causal(attn_mask_type: AttnMaskType) -> None:
    # padding_causal is TE's name for causal over THD; the padded cu_seqlens make them one mask here
    if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
        raise ValueError(f"ReferenceCoreAttention is causal only; got attn_mask_type={attn_mask_type}")


class ReferenceCoreAttention(MegatronModule):
    """Drop-in for megatron's core_attention (DotProductAttention's constructor and forward).

    sbhd: query [s, b, np, hn], key/value [s, b, ng, hn] -> [s, b, np*hn].
    THD (packed_seq_params.qkv_format == "thd"; megatron squeezed b=1): query [t, np, hn],
    key/value [t, ng, hn] -> [t, np*hn], block-diagonal causal over cu_seqlens_q(_padded).
    Any float dtype in, the same dtype out; scores and softmax in fp32 (fp64 for fp64).
    CP > 1: one autograd all_gather of K and V each over the CP group, and the causal mask uses
    global positions (layout: `token_positions`). attention_mask: None, or for sbhd a bool mask
    [b|1, 1, sq, S_global] (True = masked out, keys in global order), ANDed with the causal mask.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        _check_causal(attn_mask_type)
        if config.softmax_type != "vanilla":
            raise ValueError("ReferenceCoreAttention supports softmax_type='vanilla', "
                             f"got {config.softmax_type!r}")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError("ReferenceCoreAttention has no sliding window; "
                             f"got window_size={config.window_size}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        # apply_query_key_layer_scaling divides and re-multiplies by layer_number around an fp32
        # softmax in DotProductAttention: a no-op here, where scores are always fp32.
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
            self.cp_group = pg_collection.cp
        else:
            self.cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        cp = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        if cp != config.context_parallel_size:
            raise ValueError(f"context_parallel_size={config.context_parallel_size} but the CP group has "
                             f"{cp} rank(s) (none: parallel_state not initialized and no pg_collection.cp)")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if self.training and self.dropout_p > 0:
            raise ValueError(f"ReferenceCoreAttention has no attention dropout; got p={self.dropout_p} "
                             "in training. Set attention_dropout=0.0 in the TransformerConfig.")
        if attention_bias is not None:
            raise ValueError("ReferenceCoreAttention does not take attention_bias")
        _check_causal(self.attn_mask_type if attn_mask_type is None else attn_mask_type)
        if query.size(0) != key.size(0):
            raise ValueError(f"self-attention only: query has {query.size(0)} tokens, key {key.size(0)}")
        if packed_seq_params is not None and (packed_seq_params.cp_group is not None
                                              or packed_seq_params.local_cp_size is not None):
            raise ValueError("ReferenceCoreAttention has no dynamic (hybrid) CP: leave "
                             "packed_seq_params.cp_group and local_cp_size as None")
        group = self.cp_group
        cp = 1 if group is None else dist.get_world_size(group)
        cp_rank = 0 if group is None else dist.get_rank(group)
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:
            if attention_mask is not None:
                raise ValueError("THD attention takes its mask from cu_seqlens; pass attention_mask=None")
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            if cu is None:
                raise ValueError("qkv_format='thd' needs packed_seq_params.cu_seqlens_q(_padded)")
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        else:
            cu = torch.zeros(1, dtype=torch.int64, device=query.device)  # one sequence per batch row
        if cp > 1:
            key, value = _AllGatherSeq.apply(key, group), _AllGatherSeq.apply(value, group)
        s = query.size(0)
        seq_q, pos_q = token_positions(cu, s, cp, cp_rank)
        seq_k, pos_k = (torch.cat(t) for t in zip(*(token_positions(cu, s, cp, r) for r in range(cp))))
        allowed = (seq_q[:, None] == seq_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])  # [sq, sk]
        if attention_mask is not None:  # megatron's convention: True = masked out; keys in global order
            allowed = allowed & ~attention_mask[..., pos_k]  # -> [b|1, np|1, sq, sk]
        out = self._attend(query, key, value, allowed)  # [s, b, np*hv]
        return out.squeeze(1) if thd else out

    def _attend(self, query, key, value, allowed):
        """query [sq, b, np, hn], key [sk, b, ng, hn], value [sk, b, ng, hv], allowed [.., sq, sk]
        bool -> [sq, b, np*hv] in query's dtype."""
        rep = query.size(2) // key.size(2)
        if rep * key.size(2) != query.size(2):
            raise ValueError(f"{query.size(2)} query heads is not a multiple of "
                             f"{key.size(2)} key/value groups")
        key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
        dtype = torch.promote_types(query.dtype, torch.float32)  # fp32 at least; fp64 stays fp64
        scores = torch.einsum("sbnh,tbnh->bnst", query.to(dtype), key.to(dtype)) * self.softmax_scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out = torch.einsum("bnst,tbnh->sbnh", probs, value.to(dtype))
        return out.reshape(out.size(0), out.size(1), -1).to(query.dtype)


def with_reference_attention(spec):
    """A copy of a GPT layer spec (a TransformerLayer ModuleSpec, or a TransformerBlockSubmodules
    of them) with ReferenceCoreAttention as self-attention's core_attention. `spec` itself is
    left untouched: megatron caches and shares specs."""
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=[with_reference_attention(s) for s in spec.layer_specs])
    attn = getattr(getattr(spec, "submodules", None), "self_attention", None)
    if not isinstance(attn, ModuleSpec) or not hasattr(attn.submodules, "core_attention"):
        raise ValueError("with_reference_attention expects a transformer layer ModuleSpec whose "
                         f"submodules.self_attention has a core_attention; got {spec!r:.200}")
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn.submodules, core_attention=ReferenceCoreAttention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))
