"""The output head: score a microbatch from the model's logits, or fuse the output layer into the
logprobs so that the [tokens, vocab/tp] logits never exist (loss.head = "logits" | "fused").

    with hidden_states_out(output_layer_of(model), captured):   # fused: the model returns hidden
        output = model(input_ids, position_ids, None)
    lp = head_logprobs(mb, output, temperature=1.0, vocab_size=None, entropy=False)
Used by the step's loss function and forward-only passes, and by the Megatron-LM drop-in.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from ..logprobs import token_logprobs


def unwrap(model):
    """(innermost module, whether a Float16Module wraps it) of a DDP / Float16Module chain."""
    float16 = False
    while hasattr(model, "module"):
        float16 = float16 or type(model).__name__ == "Float16Module"
        model = model.module
    return model, float16


def output_layer_of(model):
    """The output layer of a model chunk (its innermost GPTModel's), or None off the last stage."""
    return getattr(unwrap(model)[0], "output_layer", None)


@contextlib.contextmanager
def hidden_states_out(layer, captured: dict):
    """For one forward, the output layer hands back its input hidden states [s(/tp), b, h] and
    records the weight it would have used: its own, or the tied embedding GPTModel passes."""
    def forward(hidden, weight=None, runtime_gather_output=None):
        captured["weight"] = layer.weight if weight is None else weight
        captured["sequence_parallel"] = bool(getattr(layer, "sequence_parallel", False))
        return hidden, None
    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward


def head_logprobs(mb: dict, output: Tensor, *, temperature: float, vocab_size: Optional[int], entropy: bool,
                  head_fp32: bool = False):
    """Token logprobs [b, s] fp32 (and entropy) of microbatch `mb` from the model's output: logits
    [b, s, v/tp], or with "head_weight" in mb the hidden states [b, s(/tp), h] for the fused head.
    Untrained positions are masked, so pad ids are never range-checked or scored. With "kept_set"
    in mb (a KeptSet over its [b, s] positions) each position is scored over the sampler's kept set."""
    targets, mask = mb["targets"], mb["loss_mask"] != 0  # Megatron's loss masks are often float
    keep = mb.get("kept_set")
    if "head_weight" in mb:
        from ..fused_head import fused_token_logprobs

        b, s = targets.shape
        if keep is not None and b > 1:  # the fused head's positions run [s, b]
            keep = keep.take(torch.arange(b * s, device=targets.device).view(b, s).t())
        out = fused_token_logprobs(
            output.transpose(0, 1), mb["head_weight"], targets.t(), sequence_parallel=mb["head_sequence_parallel"],
            temperature=temperature, return_entropy=entropy, vocab_size=vocab_size, mask=mask.t(),
            head_dtype=torch.float32 if head_fp32 else None, keep=keep)
        return tuple(t.t() for t in out) if entropy else out.t()
    # The logits are dead once the loss is formed (nothing here or in the schedule reads them
    # again), so their buffer takes the gradient: at b=1 no second [s, v/tp] shard is allocated.
    return token_logprobs(output, targets, temperature=temperature, vocab_size=vocab_size,
                          return_entropy=entropy, mask=mask, inplace_backward=True, keep=keep)
