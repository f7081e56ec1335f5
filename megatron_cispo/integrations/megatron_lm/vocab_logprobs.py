"""Vocab-parallel replacement for Megatron-LM's `megatron.rl.rl_utils.get_logprobs`, every recorded ref.

Same signature and outputs, but the model is run with runtime_gather_output=False, so the last
stage keeps its [b, s, v/tp] logit shard, and `token_logprobs` forms the logprobs with two small
TP all-reduces instead of materialising [b, s, v] per rank. With --cispo-head fused the output
layer is bypassed and `fused_token_logprobs` scores the hidden states chunk by chunk, so the
logits never exist; the head is chosen and scored as in policy_step (step.head.forward_with_head,
score_output). What Megatron-LM's own get_logprobs does around the model call (the unpacked
PackedSeqParams, the context-parallel split on main) is read off it (api.logprobs_features) and
done alike. install() puts it in place.
"""
from __future__ import annotations

import importlib
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn.functional as F
from torch import Tensor

from ...logprobs import IGNORE_INDEX
from ...step.head import Head, forward_with_head, score_output, unwrap
from .api import RL_UTILS, MegatronLMVersionError, known_refs, logprobs_features, original
from .settings import logprob_temperature, loss_config

# Values of the keywords a ref's single-sequence THD PackedSeqParams gets beyond api.THD_KEYWORDS,
# from the sequence length: 0.17-0.19 pass total_tokens; main omits it (it would turn on a
# packing kernel's seq_idx) and passes pad_between_seqs=False.
THD_EXTRA = {"total_tokens": lambda s: s, "pad_between_seqs": lambda s: False}


def megatron_features(rl) -> dict:
    """api.logprobs_features of the loaded Megatron-LM's own get_logprobs (none: 0.16's)."""
    theirs = original(rl, "get_logprobs")
    return logprobs_features(None if theirs is get_logprobs else theirs)


def single_sequence_params(rl, tokens: Tensor, extra: list[str]):
    """The unpacked batch as one THD sequence per row, as Megatron-LM 0.17+'s get_logprobs builds it."""
    unknown = sorted(set(extra) - set(THD_EXTRA))
    if unknown:
        raise MegatronLMVersionError(f"megatron_cispo does not know this Megatron-LM's RL API: {RL_UTILS}.get_logprobs "
                                     f"builds PackedSeqParams with {', '.join(unknown)}, which none of the refs it "
                                     f"knows does ({known_refs()})")
    s = tokens.shape[1]
    cu_seqlens = torch.tensor([0, s], dtype=torch.int32, device=tokens.device)
    return rl.PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=s,
                              max_seqlen_kv=s, **{k: THD_EXTRA[k](s) for k in extra})


def _set_config(rl, model, name: str, value) -> None:
    # main sets it on every distinct config of the model (layers may have their own); before, on model.config
    setter = getattr(rl, "set_model_config_attribute", None)
    if setter is None:
        setattr(model.config, name, value)
    else:
        setter(model, name, value)


def get_logprobs(model, tokens, position_ids, no_grad=False, sequence_packing=False, packed_seq_params=None):
    """Logprobs of tokens[:, 1:] on the last pipeline stage, [b, s-1]; other stages' output as is.

    tokens, position_ids: [b, s] int. The logprobs come back in the logits' dtype, as in
    Megatron-LM: its old-logprob pass asserts that dtype, and rounding current and old logprobs
    alike keeps the first step's ratio exactly 1. The math inside is fp32 (bf16 rounding of the
    result: docs/integration.md, section 2). fp32_output= goes to the model only through a
    Float16Module (bf16/fp16 runs): an fp32 run's DDP(GPTModel) forward has no such parameter.
    Unpacked, the model gets the PackedSeqParams the loaded Megatron-LM's get_logprobs would build
    (None up to 0.16, one THD sequence per row from 0.17). Where that get_logprobs splits context
    parallelism itself (main), each CP rank runs its share of the tokens (Megatron-LM's own
    partition) and the logprobs are all-gathered, differentiably, to the full [b, s-1].
    Collectives: the model's own; token_logprobs does 2 all-reduces over the model's TP group;
    with the CP split, one all-gather over the CP group.
    """
    rl = importlib.import_module(RL_UTILS)  # Megatron's helpers, looked up at call time
    args = rl.get_args()
    features = megatron_features(rl)
    if packed_seq_params is None:
        if sequence_packing:
            packed_seq_params = rl.get_default_packed_seq_params(
                seq_length=tokens.shape[1],
                max_sequences_per_bin=args.rl_sequence_packing_max_sequences_per_bin,
                device=tokens.device,
            )
        elif features["unpacked_thd"] is not None:
            packed_seq_params = single_sequence_params(rl, tokens, features["unpacked_thd"])
    pg_collection = rl.get_attr_wrapped_model(model, "pg_collection")
    cp_group = getattr(pg_collection, "cp", None) if features["context_parallel"] else None
    split = cp_group is not None and dist.get_world_size(cp_group) > 1
    inputs, labels = (tokens, position_ids, packed_seq_params), None
    if split:
        *inputs, labels, scatter = rl._scatter_for_context_parallel(tokens, position_ids, packed_seq_params, cp_group)
    # Megatron-LM turns flash-decode off for training forwards; keep that behaviour.
    flash_decode = model.config.flash_decode
    _set_config(rl, model, "flash_decode", False)
    head = Head.of(loss_config())
    # Megatron-LM's value (no fp32 upcast of the [b, s, v/tp] shard in a bf16/fp16 run), but only
    # where a Float16Module takes it: GPTModel.forward has no **kwargs.
    precision = {"fp32_output": not (args.fp16 or args.bf16)} if unwrap(model)[1] else {}
    try:
        with torch.no_grad() if no_grad else nullcontext():
            output, fused = forward_with_head(model, head, inputs[0], inputs[1], None,
                                              packed_seq_params=inputs[2], runtime_gather_output=False,
                                              **precision)
    finally:
        _set_config(rl, model, "flash_decode", flash_decode)

    if not rl.is_pp_last_stage(pg_collection.pp):
        return output
    # Score the whole (contiguous) output against targets shifted left and padded with
    # IGNORE_INDEX, then drop the last column: slicing output[:, :-1] instead would make
    # token_logprobs copy the [b, s, v/tp] shard in forward and backward, and rule out the
    # in-place gradient. Split: Megatron-LM's local labels (its last position's is a dummy).
    targets = labels if split else F.pad(tokens[:, 1:], (0, 1), value=IGNORE_INDEX)
    with torch.no_grad() if no_grad else nullcontext():
        # fused: output is the hidden states [b, s(/tp), h]; logits: their buffer takes the gradient
        # (the loop keeps only the logprobs), so no second [b, s, v/tp] shard at b=1.
        logprobs: Tensor = score_output(output, fused, targets, temperature=logprob_temperature(),
                                        tp_group=pg_collection.tp)
        if split:  # back to [b, s] in token order; the all-gather's backward sums the ranks' gradients
            parts = torch.distributed.nn.functional.all_gather(logprobs.contiguous(), group=scatter.cp_group)
            logprobs = torch.cat(parts, dim=1).index_select(1, scatter.inverse_gather_perm)
        return logprobs[:, :-1].to(output.dtype if fused is None else fused.weight.dtype).contiguous()
