"""The output head: score a microbatch from the model's logits, or fuse the output layer into the
logprobs so that the [tokens, vocab/tp] logits never exist (loss.head = "logits" | "fused"), or also
the loss's gradient in the same pass ("fused_grad": head_fused_grad, fused_grad.py).
The fused head takes GPTModel.forward's output_processor (megatron-core 0.18+) and patches the
output layer's forward only where GPTModel lacks it.

    output, fused = forward_with_head(model, "fused", input_ids, position_ids, None)  # or "logits"
    lp = score_output(output, fused, targets, temperature=1.0)
Used by the step's loss function and forward-only passes (head_logprobs: a Microbatch), and by
the Megatron-LM drop-in's get_logprobs.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..fused_grad import fused_grad_logprobs
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


@functools.lru_cache(maxsize=None)
def takes_output_processor(model_type: type) -> bool:
    """Whether model_type.forward hands its decoder's hidden states to an `output_processor`
    instead of its output layer: GPTModel from megatron-core 0.18 (PR #4686). Probed once per
    class; without it the fused head patches the output layer's forward."""
    forward = getattr(model_type, "forward", None)
    try:
        return forward is not None and "output_processor" in inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a builtin or C forward: no signature to read
        return False


def _record(captured: dict, layer, weight) -> None:
    """The weight the output layer would have used (its own, or the tied embedding GPTModel
    passes) and whether its input is sequence-parallel."""
    captured["weight"] = layer.weight if weight is None else weight
    captured["sequence_parallel"] = bool(getattr(layer, "sequence_parallel", False))


def hidden_states_processor(captured: dict):
    """GPTModel's output_processor for the fused head: returns the hidden states [b, s(/tp), h]
    in place of the logits (the layout GPTModel gives its logits; a view, not a copy), after
    MuP's logit multiplier: a scalar, so it scales the fused head's logits by the same factor."""
    def output_processor(*, hidden_states, output_layer, output_weight, scale_logits, **_):
        _record(captured, output_layer, output_weight)
        return scale_logits(hidden_states).transpose(0, 1)
    return output_processor


@contextlib.contextmanager
def hidden_states_out(layer, captured: dict):
    """For one forward of a GPTModel without output_processor (megatron-core < 0.18), the output
    layer hands back its input hidden states [s(/tp), b, h]."""
    def forward(hidden, weight=None, runtime_gather_output=None):
        _record(captured, layer, weight)
        return hidden, None
    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward


FUSED_HEADS = ("fused", "fused_grad")  # the heads that bypass the output layer


@dataclass(frozen=True)
class FusedHead:
    """The output layer a fused-head forward bypassed: its weight [v_local, h] (its own or the tied
    embedding's) and whether its input is sequence-parallel."""

    weight: Tensor
    sequence_parallel: bool


def forward_with_head(model, head: str, *args, **kwargs) -> tuple[Tensor, Optional[FusedHead]]:
    """model(*args, **kwargs) and the head decision, made once for the step and the Megatron-LM
    drop-in: head="fused" or "fused_grad" on the last stage bypasses the output layer, so the model returns the
    hidden states [b, s(/tp), h] and the FusedHead to score them with; otherwise (None) the
    output is the model's own (logits [b, s, v/tp] on the last stage)."""
    layer = output_layer_of(model) if head in FUSED_HEADS else None
    if layer is None:
        return model(*args, **kwargs), None
    captured: dict = {}
    if takes_output_processor(type(unwrap(model)[0])):
        output = model(*args, output_processor=hidden_states_processor(captured), **kwargs)
    else:
        with hidden_states_out(layer, captured):
            output = model(*args, **kwargs)
    return output, (FusedHead(captured["weight"], captured["sequence_parallel"]) if captured else None)


def _head_dtype(output: Tensor, fused: FusedHead, head_fp32: bool):
    """fp32 when asked (head_fp32) or when the hidden states' dtype is not the weight's, else None."""
    return torch.float32 if head_fp32 or output.dtype != fused.weight.dtype else None


def score_output(output: Tensor, fused: Optional[FusedHead], targets: Tensor, *, temperature: float,
                 vocab_size: Optional[int] = None, entropy: bool = False, mask: Optional[Tensor] = None,
                 head_fp32: bool = False, keep=None, tp_group=None):
    """Token logprobs [b, s] fp32 (and entropy) of `targets` [b, s] from what forward_with_head
    returned: logits [b, s, v/tp] through token_logprobs (their buffer takes the gradient), or
    with `fused` the hidden states [b, s(/tp), h] through fused_token_logprobs, in fp32 when
    head_fp32 or when the hidden states' dtype is not the weight's. mask: [b, s] bool; keep: a
    KeptSet over the [b, s] positions (sampling-mask replay)."""
    if fused is not None:
        from ..fused_head import fused_token_logprobs

        b, s = targets.shape
        if keep is not None and b > 1:  # the fused head's positions run [s, b]
            keep = keep.take(torch.arange(b * s, device=targets.device).view(b, s).t())
        out = fused_token_logprobs(
            output.transpose(0, 1), fused.weight, targets.t(), tp_group=tp_group,
            sequence_parallel=fused.sequence_parallel, temperature=temperature, return_entropy=entropy,
            vocab_size=vocab_size, mask=None if mask is None else mask.t(),
            head_dtype=_head_dtype(output, fused, head_fp32), keep=keep)
        return tuple(t.t() for t in out) if entropy else out.t()
    # The logits are dead once the loss is formed (nothing here or in the schedule reads them
    # again), so their buffer takes the gradient: at b=1 no second [s, v/tp] shard is allocated.
    return token_logprobs(output, targets, tp_group=tp_group, temperature=temperature, vocab_size=vocab_size,
                          return_entropy=entropy, mask=mask, inplace_backward=True, keep=keep)


def head_logprobs(mb, output: Tensor, *, temperature: float, vocab_size: Optional[int], entropy: bool,
                  head_fp32: bool = False, tp_group=None):
    """score_output for a step.microbatch.Microbatch: its targets, its untrained positions masked
    (so pad ids are never range-checked or scored), its kept sets, its fused head if any.
    tp_group: the output layer's TP group (None: megatron's)."""
    return score_output(output, mb.fused, mb.targets, temperature=temperature, vocab_size=vocab_size,
                        entropy=entropy, mask=mb.loss_mask != 0,  # Megatron's loss masks are often float
                        head_fp32=head_fp32, keep=mb.kept_set, tp_group=tp_group)


def head_fused_grad(mb, output: Tensor, coef_fn, *, temperature: float, vocab_size: Optional[int], entropy: bool,
                    head_fp32: bool = False, tp_group=None):
    """loss.head=fused_grad on a Microbatch scored by a fused head (mb.fused): fused_grad_logprobs
    with coef_fn (losses.token_grad.chunk_coef_fn) over the hidden states [b, s(/tp), h]. Returns
    (lp [b, s] fp32, ent [b, s] fp32 or None, both without graph; z, 0-d with value 0, whose
    backward puts the loss's gradient into the hidden states and the output weight)."""
    lp, ent, z = fused_grad_logprobs(
        output.transpose(0, 1), mb.fused.weight, mb.targets.t(), coef_fn, tp_group=tp_group,
        sequence_parallel=mb.fused.sequence_parallel, temperature=temperature, return_entropy=entropy,
        vocab_size=vocab_size, mask=(mb.loss_mask != 0).t(), head_dtype=_head_dtype(output, mb.fused, head_fp32))
    return lp.t(), (None if ent is None else ent.t()), z
