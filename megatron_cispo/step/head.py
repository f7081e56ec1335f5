"""The output head, decided once per step (Head: loss.head and loss.head_fp32) and passed down: score a
microbatch from the model's logits, or fuse the output layer into the logprobs so that the
[tokens, vocab/tp] logits never exist ("fused"), or also form the loss's gradient in the same pass
("fused_grad": score_microbatch, fused_grad.py, with its per-microbatch fallback to "fused").
The fused heads take GPTModel.forward's output_processor (megatron-core 0.18+) and patch the
output layer's forward only where GPTModel lacks it.

    head = Head.of(loss_cfg)                                   # once, at the entry
    output, fused = forward_with_head(model, head, input_ids, position_ids, None)
    lp = score_output(output, fused, targets, temperature=1.0)
Used by the step's loss function and forward-only passes (score_microbatch, head_logprobs: a
Microbatch), and by the Megatron-LM drop-in's get_logprobs.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch
from torch import Tensor

from ..config import LossConfig
from ..fused_grad import fused_grad_logprobs
from ..logprobs import token_logprobs
from ..losses.token_grad import fused_grad_fallback, loss_coef_fn


HEADS = ("logits", "fused", "fused_grad")
FUSED_HEADS = ("fused", "fused_grad")  # the heads that bypass the output layer


@dataclass(frozen=True)
class Head:
    """The output head of a step, decided once (Head.of(loss_cfg)) and passed down. kind: "logits"
    scores the model's logits; "fused" bypasses the output layer and scores its input chunk by chunk;
    "fused_grad" is "fused" that also forms the loss's gradient in the forward (score_microbatch).
    fp32: a fused head's matmuls run in fp32 from bf16 parameters."""

    kind: Literal["logits", "fused", "fused_grad"] = "logits"
    fp32: bool = False

    def __post_init__(self):
        if self.kind not in HEADS:
            raise ValueError(f"head: expected one of {', '.join(HEADS)}, got {self.kind!r}")
        if self.fp32 and self.kind == "logits":
            raise ValueError("head fp32: only a fused head runs its own matmul (the logits head scores the "
                             "model's logits); use kind 'fused' or 'fused_grad', or fp32=False")

    @classmethod
    def of(cls, loss_cfg: LossConfig) -> "Head":
        return cls(loss_cfg.head, loss_cfg.head_fp32)

    @classmethod
    def coerce(cls, head: "Head | str") -> "Head":
        """A Head, or a kind given by name (a public entry's head="fused")."""
        return head if isinstance(head, Head) else cls(head)

    @property
    def fused(self) -> bool:
        return self.kind in FUSED_HEADS

    @property
    def grad(self) -> bool:
        return self.kind == "fused_grad"

    def without_grad(self) -> "Head":
        """The head of a pass that needs no gradient: fused_grad scores with the plain fused head."""
        return Head("fused", self.fp32) if self.grad else self


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


@dataclass(frozen=True)
class FusedHead:
    """The output layer a fused-head forward bypassed: its weight [v_local, h] (its own or the tied
    embedding's), whether its input is sequence-parallel, and the dtype of the head's matmuls (None:
    the inputs' own, which then agree)."""

    weight: Tensor
    sequence_parallel: bool
    dtype: Optional[torch.dtype] = None


def forward_with_head(model, head: "Head | str", *args, **kwargs) -> tuple[Tensor, Optional[FusedHead]]:
    """model(*args, **kwargs) under `head`, for the step and the Megatron-LM drop-in: a fused head on
    the last stage bypasses the output layer, so the model returns the hidden states [b, s(/tp), h] and
    the FusedHead to score them with, its dtype fp32 when head.fp32 or when the hidden states' dtype
    is not the weight's; otherwise (None) the output is the model's own (logits [b, s, v/tp] on the
    last stage)."""
    head = Head.coerce(head)
    layer = output_layer_of(model) if head.fused else None
    if layer is None:
        return model(*args, **kwargs), None
    captured: dict = {}
    if takes_output_processor(type(unwrap(model)[0])):
        output = model(*args, output_processor=hidden_states_processor(captured), **kwargs)
    else:
        with hidden_states_out(layer, captured):
            output = model(*args, **kwargs)
    if not captured:
        return output, None
    weight = captured["weight"]
    dtype = torch.float32 if head.fp32 or output.dtype != weight.dtype else None
    return output, FusedHead(weight, captured["sequence_parallel"], dtype)


def score_output(output: Tensor, fused: Optional[FusedHead], targets: Tensor, *, temperature: float,
                 vocab_size: Optional[int] = None, entropy: bool = False, mask: Optional[Tensor] = None,
                 keep=None, tp_group=None):
    """Token logprobs [b, s] fp32 (and entropy) of `targets` [b, s] from what forward_with_head
    returned: logits [b, s, v/tp] through token_logprobs (their buffer takes the gradient), or
    with `fused` the hidden states [b, s(/tp), h] through fused_token_logprobs in fused.dtype.
    mask: [b, s] bool; keep: a KeptSet over the [b, s] positions (sampling-mask replay)."""
    if fused is not None:
        from ..fused_head import fused_token_logprobs

        b, s = targets.shape
        if keep is not None and b > 1:  # the fused head's positions run [s, b]
            keep = keep.take(torch.arange(b * s, device=targets.device).view(b, s).t())
        out = fused_token_logprobs(
            output.transpose(0, 1), fused.weight, targets.t(), tp_group=tp_group,
            sequence_parallel=fused.sequence_parallel, temperature=temperature, return_entropy=entropy,
            vocab_size=vocab_size, mask=None if mask is None else mask.t(), head_dtype=fused.dtype, keep=keep)
        return tuple(t.t() for t in out) if entropy else out.t()
    # The logits are dead once the loss is formed (nothing here or in the schedule reads them
    # again), so their buffer takes the gradient: at b=1 no second [s, v/tp] shard is allocated.
    return token_logprobs(output, targets, tp_group=tp_group, temperature=temperature, vocab_size=vocab_size,
                          return_entropy=entropy, mask=mask, inplace_backward=True, keep=keep)


def head_logprobs(mb, output: Tensor, *, temperature: float, vocab_size: Optional[int], entropy: bool,
                  tp_group=None):
    """score_output for a step.microbatch.Microbatch: its targets, its untrained positions masked
    (so pad ids are never range-checked or scored), its kept sets, its fused head if any.
    tp_group: the output layer's TP group (None: megatron's)."""
    return score_output(output, mb.fused, mb.targets, temperature=temperature, vocab_size=vocab_size,
                        entropy=entropy, mask=mb.loss_mask != 0,  # Megatron's loss masks are often float
                        keep=mb.kept_set, tp_group=tp_group)


@dataclass(frozen=True)
class GradLoss:
    """What loss.head=fused_grad needs of a microbatch's loss to form its gradient chunk by chunk
    (losses.token_grad.loss_coef_fn): the loss config, the per-token inputs (advantages, loss_mask,
    old/rollout/ref_logprobs, keep), the policy step's weights (agg_weight [b, s] and loss_scale, or
    None), whole(lp, ent) -> the microbatch's loss without collectives, pi_old from this forward,
    and the CP size the microbatch's sequences are split over."""

    cfg: LossConfig
    given: dict
    whole: Callable
    agg_weight: Optional[Tensor] = None
    loss_scale: float = 1.0
    old_from_current: bool = False
    cp_size: int = 1


@dataclass(frozen=True)
class Scored:
    """A microbatch scored by its head: lp [b, s] fp32, ent [b, s] fp32 or None; under fused_grad, z
    (0-d, value 0, whose backward puts the loss's gradient into the hidden states and the output
    weight; lp and ent then carry no graph), or the reason this microbatch fell back (fell_back)."""

    lp: Tensor
    ent: Optional[Tensor]
    z: Optional[Tensor] = None
    fell_back: Optional[str] = None

    def report(self, metrics) -> None:
        """head/fused_grad_fallback: 1 for a microbatch that fell back, over microbatches (fused_grad only)."""
        one = torch.ones((), device=self.lp.device)
        metrics.sums["head/fused_grad_fallback"] = (one * (self.fell_back is not None), one)


def _fused_grad_problem(mb, loss: GradLoss) -> Optional[str]:
    """Why this microbatch cannot take its gradient from the fused_grad head, or None."""
    if mb.fused is None:
        return "no output layer was found to fuse (mb.fused is None): the logits head ran"
    return fused_grad_fallback(loss.cfg, loss.old_from_current, kept_set=mb.kept_set is not None,
                               cp_size=loss.cp_size)


def score_microbatch(mb, output: Tensor, head: Head, *, temperature: float, vocab_size: Optional[int],
                     entropy: bool, tp_group=None, loss: Optional[GradLoss] = None) -> Scored:
    """A step.microbatch.Microbatch scored by `head` (what forward_with_head returned as `output`).
    With head.grad and `loss`: fused_grad_logprobs over the hidden states [b, s(/tp), h], the loss's
    per-token coefficients chunk by chunk (losses.token_grad.loss_coef_fn), so the gradient is formed
    in the forward; where that is not exact for this microbatch (_fused_grad_problem), it is scored
    by the plain head and Scored.fell_back says why. Otherwise head_logprobs."""
    fell_back = None
    if head.grad and loss is not None:
        fell_back = _fused_grad_problem(mb, loss)
        if fell_back is None:
            coef_fn = loss_coef_fn(loss.cfg, tuple(mb.targets.shape), mb.targets.device, given=loss.given,
                                   whole=loss.whole, agg_weight=loss.agg_weight, loss_scale=loss.loss_scale,
                                   old_from_current=loss.old_from_current, entropy=entropy)
            lp, ent, z = fused_grad_logprobs(
                output.transpose(0, 1), mb.fused.weight, mb.targets.t(), coef_fn, tp_group=tp_group,
                sequence_parallel=mb.fused.sequence_parallel, temperature=temperature, return_entropy=entropy,
                vocab_size=vocab_size, mask=(mb.loss_mask != 0).t(), head_dtype=mb.fused.dtype)
            return Scored(lp.t(), None if ent is None else ent.t(), z)
    out = head_logprobs(mb, output, temperature=temperature, vocab_size=vocab_size, entropy=entropy,
                        tp_group=tp_group)
    lp, ent = out if entropy else (out, None)
    return Scored(lp, ent, None, fell_back)
