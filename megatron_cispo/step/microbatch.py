"""The microbatch that megatron's schedule hands to forward_step and to the loss function.

    mb = Microbatch(targets=t, loss_mask=m, advantages=a)     # what make_loss_func's loss needs
    step.packing.microbatches(batch, ...) -> [Microbatch, ...]  # what policy_step builds

Shapes are this CP rank's [b, s] positions: padded rows (b rows of s), or one packed bin
(b = 1, T positions). forward_step runs the model on input_ids / position_ids (with
packed_seq_params and padding_mask when set) and fills in `fused` under the fused head.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Optional

from torch import Tensor

from ..config import config_field
from ..kept_set import KeptSet
from .head import FusedHead


@dataclass(frozen=True, kw_only=True)
class Microbatch:
    """One microbatch; every [b, s] tensor is on the model's device, positions row-major."""

    targets: Tensor = config_field(doc="[b, s] int: the token each position is scored on")
    loss_mask: Tensor = config_field(doc="[b, s] bool (or 0/1): trained targets")
    advantages: Tensor = config_field(doc="[b, s] float")
    rollout_logprobs: Optional[Tensor] = config_field(None, "[b, s] fp32, the sampler's")
    old_logprobs: Optional[Tensor] = config_field(None, "[b, s] fp32, pi_old's")
    ref_logprobs: Optional[Tensor] = config_field(None, "[b, s] fp32, the reference model's")
    token_keep: Optional[Tensor] = config_field(None, "[b, s] bool: M2PO's selection (step.m2po); False = no "
                                                      "loss, still in the denominator")
    routed_experts: Optional[Tensor] = config_field(None, "[b, s, moe_layers, top_k] int: the sampler's route of "
                                                          "each input position, -1 = none (routing replay)")
    kept_set: Optional[KeptSet] = config_field(None, "the sampler's kept set of each [b, s] position (replay)")
    input_ids: Optional[Tensor] = config_field(None, "[b, s] int: the model's input (forward_step needs it)")
    position_ids: Optional[Tensor] = config_field(None, "[b, s] int (forward_step needs it)")
    packed_seq_params: Any = config_field(None, "megatron's PackedSeqParams (THD) of a packed bin")
    padding_mask: Optional[Tensor] = config_field(None, "[b, s] bool, True = padding: given to an MoE router")
    seq_length: int = config_field(0, "the schedule's seq_length: the padded row, or the whole bin before CP")
    gather_index: Optional[Tensor] = config_field(None, "[b, s] int64: each position's row-major index into "
                                                        "the batch's [n, s] targets; -1 = padding")
    seq_index: Optional[Tensor] = config_field(None, "[b, s] int64: each position's sequence within the "
                                                     "microbatch; -1 = padding")
    n_seqs: Optional[int] = config_field(None, "sequences in the microbatch; 0 = an all-padding bin (an MoE "
                                              "model runs it without its aux loss), None = not given: the aux "
                                              "loss stays on. Needed, with seq_index, with agg_weight")
    num_tokens: Optional[Tensor] = config_field(None, "0-dim int: positions the model saw that are not padding")
    agg_weight: Optional[Tensor] = config_field(None, "[b, s] fp32: each token's weight in the global loss "
                                                      "(losses.token_weights on the whole batch)")
    agg_share: Optional[Tensor] = config_field(None, "[b, s] fp32: each token's share of the global denominator")
    loss_scale: Optional[float] = config_field(None, "N / D: model tokens over the loss's global denominator")
    fused: Optional[FusedHead] = config_field(None, "the output layer's weight, under the fused head")


def as_microbatch(mb) -> Microbatch:
    """`mb` itself, or a Microbatch built from a dict with the same keys: until 0.1 the
    microbatch was a dict, and in-house loops that build their own keep working. Keys that are
    not fields (a loop's own, such as attention_mask) are left out as before, with one warning
    per set of keys naming them, so that a misspelt field does not go unnoticed."""
    if isinstance(mb, Microbatch):
        return mb
    if not isinstance(mb, Mapping):
        raise TypeError(f"a microbatch must be a megatron_cispo.step.Microbatch (or a dict of its fields), "
                        f"got {type(mb).__name__}")
    known = {f.name for f in fields(Microbatch)}
    unknown = tuple(sorted(set(mb) - known))
    if unknown and unknown not in _WARNED:
        _WARNED.add(unknown)
        warnings.warn(f"microbatch dict: key(s) {list(unknown)} are not Microbatch fields and are not used; "
                      f"the fields are {sorted(known)}", stacklevel=3)
    return Microbatch(**{k: v for k, v in mb.items() if k in known})


_WARNED: set = set()  # the unknown-key sets already warned about in this process

