"""Vocab-parallel replacement for Megatron-LM's `megatron.rl.rl_utils.get_logprobs` (core_v0.16.x).

Same signature and outputs, but the model is run with runtime_gather_output=False, so the last
stage keeps its [b, s, v/tp] logit shard, and `token_logprobs` forms the logprobs with two small
TP all-reduces instead of materialising [b, s, v] per rank. With --cispo-head fused the output
layer is bypassed and `fused_token_logprobs` scores the hidden states chunk by chunk, so the
logits never exist; the head is chosen and scored as in policy_step (step.head.forward_with_head,
score_output). install() puts it in place.
"""
from __future__ import annotations

import importlib
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor

from ...logprobs import IGNORE_INDEX
from ...step.head import forward_with_head, score_output, unwrap
from .settings import logprob_temperature, loss_config

RL_UTILS = "megatron.rl.rl_utils"


def get_logprobs(model, tokens, position_ids, no_grad=False, sequence_packing=False, packed_seq_params=None):
    """Logprobs of tokens[:, 1:] on the last pipeline stage, [b, s-1]; other stages' output as is.

    tokens, position_ids: [b, s] int. The logprobs come back in the logits' dtype, as in
    Megatron-LM: its old-logprob pass asserts that dtype, and rounding current and old logprobs
    alike keeps the first step's ratio exactly 1. The math inside is fp32 (bf16 rounding of the
    result: docs/integration.md, section 2). fp32_output= goes to the model only through a
    Float16Module (bf16/fp16 runs): an fp32 run's DDP(GPTModel) forward has no such parameter.
    Collectives: the model's own; token_logprobs does 2 all-reduces over the model's TP group.
    """
    rl = importlib.import_module(RL_UTILS)  # Megatron's helpers, looked up at call time
    args = rl.get_args()
    if packed_seq_params is None and sequence_packing:
        packed_seq_params = rl.get_default_packed_seq_params(
            seq_length=tokens.shape[1],
            max_sequences_per_bin=args.rl_sequence_packing_max_sequences_per_bin,
            device=tokens.device,
        )
    # Megatron-LM turns flash-decode off for training forwards; keep that behaviour.
    flash_decode = model.config.flash_decode
    model.config.flash_decode = False
    head = loss_config()
    # Megatron-LM's value (no fp32 upcast of the [b, s, v/tp] shard in a bf16/fp16 run), but only
    # where a Float16Module takes it: GPTModel.forward has no **kwargs.
    precision = {"fp32_output": not (args.fp16 or args.bf16)} if unwrap(model)[1] else {}
    try:
        with torch.no_grad() if no_grad else nullcontext():
            output, fused = forward_with_head(model, head.head, tokens, position_ids, None,
                                              packed_seq_params=packed_seq_params, runtime_gather_output=False,
                                              **precision)
    finally:
        model.config.flash_decode = flash_decode

    pg_collection = rl.get_attr_wrapped_model(model, "pg_collection")
    if not rl.is_pp_last_stage(pg_collection.pp):
        return output
    # Score the whole (contiguous) output against targets shifted left and padded with
    # IGNORE_INDEX, then drop the last column: slicing output[:, :-1] instead would make
    # token_logprobs copy the [b, s, v/tp] shard in forward and backward, and rule out the
    # in-place gradient.
    targets = F.pad(tokens[:, 1:], (0, 1), value=IGNORE_INDEX)
    with torch.no_grad() if no_grad else nullcontext():
        # fused: output is the hidden states [b, s(/tp), h]; logits: their buffer takes the gradient
        # (the loop keeps only the logprobs), so no second [b, s, v/tp] shard at b=1.
        logprobs: Tensor = score_output(output, fused, targets, temperature=logprob_temperature(),
                                        head_fp32=head.head_fp32, tp_group=pg_collection.tp)
        return logprobs[:, :-1].to(output.dtype if fused is None else fused.weight.dtype).contiguous()
