"""The loss plugin for megatron-core's schedules: loss_func, forward_step, and a forward-only pass.

    forward_step = make_forward_step(loss_cfg, temperature=1.0)          # whole plugin
    get_forward_backward_func()(forward_step_func=forward_step, ...)     # megatron's schedule
    loss_func = make_loss_func(loss_cfg)   # or only the loss, in your own forward_step:
    return output_tensor, partial(loss_func, microbatch)                 # a step.microbatch.Microbatch

On the last stage loss_func computes token logprobs (step/head.py: logits or fused head), runs
the policy loss and returns (loss_scale * sum(weight * loss), tokens the model saw, Metrics):
with calculate_per_token_loss=True megatron sums the token counts over microbatches and DP x CP
and divides the gradient once, leaving sum(weight * loss) / the global denominator.
"""
from __future__ import annotations

import dataclasses
import warnings
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..config import LossConfig
from ..losses.token_grad import microbatch_loss
from .groups import default_groups, rank, size
from .hooks import check_megatron_config
from .head import GradLoss, Head, forward_with_head, head_logprobs, score_microbatch, unwrap
from .microbatch import Microbatch, as_microbatch
from .moe import no_aux_loss_without_tokens
from .packing import microbatches as build_microbatches
from .packing import step_layout
from .pipeline import broadcast_tensor_from_last_stage, is_last_stage
from .routing_replay import replay_routes
from .rollouts import Rollouts, StepConfig


def forward_step_for(loss_func, calls: Optional[list] = None, head: "Head | str" = "logits", moe=None,
                     pg_collection=None):
    """forward_step(data_iterator, model) that runs the model on a Microbatch (step.microbatch)
    and hands `loss_func(mb, output)` to the schedule; `calls` gets one entry per model forward.

    Passes packed_seq_params and the MoE padding_mask when the microbatch has them, and asks a
    Float16Module for its output in the model's dtype (fp32_output=False): the heads upcast chunk
    by chunk, so an fp32 copy of the logits is never needed. head (step.head.Head, or its kind): a
    fused head bypasses the output layer on the last stage (head.forward_with_head); the model returns
    the hidden states and the microbatch given to loss_func carries the FusedHead. An MoE model runs
    an all-padding bin without its aux loss (step.moe.no_aux_loss_without_tokens). moe: a
    step.moe.RouterStats, told which microbatch the routers' records belong to. pg_collection: the
    model's process groups (step/groups.py), for the routes' TP slice; default megatron's, as they are
    at each call (a forward_step built before megatron's parallel state is up still finds them)."""
    given = None if pg_collection is None else default_groups(pg_collection)  # checked here
    head = Head.coerce(head)

    def forward_step(data_iterator, model):
        pg = given if given is not None else default_groups()
        mb = as_microbatch(next(data_iterator))
        if calls is not None:
            calls.append(1)
        kwargs = {}
        if mb.packed_seq_params is not None:
            kwargs["packed_seq_params"] = mb.packed_seq_params
        if mb.padding_mask is not None:
            kwargs["padding_mask"] = mb.padding_mask
        if unwrap(model)[1]:
            kwargs["fp32_output"] = False
        if moe is not None:
            moe.start(mb.n_seqs, model)
        # replay_routes: the sampler's MoE routes for this forward (loss.routing_replay), taken back after
        with no_aux_loss_without_tokens(getattr(unwrap(model)[0], "config", None), mb.n_seqs), \
                replay_routes(model, mb, pg):
            output, fused = forward_with_head(model, head, mb.input_ids, mb.position_ids, None, **kwargs)
        if fused is not None:
            mb = dataclasses.replace(mb, fused=fused)
        return output, partial(loss_func, mb)
    return forward_step


def _segment_sum(seq_index: Tensor, n_seqs: int, cp_group):
    """SeqSum over the sequences of a microbatch: scatter-add by seq_index (-1 = padding), summed
    over the CP group (each CP rank holds part of every sequence). For detached tensors only."""
    slot = torch.where(seq_index < 0, n_seqs, seq_index).reshape(-1)

    def seq_sum(x: Tensor) -> Tensor:
        totals = torch.zeros(n_seqs + 1, dtype=x.dtype, device=x.device).index_add_(0, slot, x.reshape(-1))
        if cp_group is not None:
            dist.all_reduce(totals, group=cp_group)
        return totals[slot].reshape(x.shape)
    return seq_sum


def _say_once(message: str, pg) -> None:
    """A warning from one process of the last stage (TP, DP and CP rank 0), not once per rank."""
    if rank(pg.tp) == 0 and rank(pg.dp_cp) == 0:
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def make_loss_func(loss_cfg: LossConfig, *, temperature: float = 1.0, vocab_size: Optional[int] = None,
                   old_from_current: bool = False, entropy: bool = True, cp_group=None, pg_collection=None,
                   head: Optional[Head] = None):
    """loss_func(microbatch, output) -> (loss_sum, num_tokens int, Metrics), megatron's 3-tuple.

    microbatch: a step.microbatch.Microbatch, or a dict of its fields (targets, loss_mask,
    advantages [b, s] or a packed [1, T]; optional old/rollout/ref_logprobs and token_keep, M2PO's
    selection: False = no loss, still in the denominator; seq_index and n_seqs, required with
    agg_weight, else ValueError). output: logits [b, s, v/tp] as GPTModel returns them, or the
    hidden states of a fused head (forward_step_for).
    With agg_weight, agg_share, loss_scale and num_tokens (what policy_step adds) the loss is
    exact for any split: it returns loss_scale * sum(weight * loss) with num_tokens = the tokens the
    model (and an MoE router) saw, and megatron's division by the summed num_tokens leaves
    sum(weight * loss) / the global denominator. Without them, the microbatch is normalised on its
    own: (loss_sum, its denominator, Metrics).
    old_from_current: pi_old = this forward's detached logprobs (one optimizer step per batch).
    head: step.head.Head (default Head.of(loss_cfg)). Under fused_grad the head forms the gradient
    in its forward (step.head.score_microbatch) and the loss returned is value.detach() + z; a
    microbatch it cannot serve exactly runs the plain head (head/fused_grad_fallback = 1, said once).
    Needs calculate_per_token_loss=True. Collectives: the head's TP all-reduces, and one CP
    all-reduce per sequence-level quantity (sequence TIS) when cp > 1. pg_collection: the model's
    process groups (step/groups.py); default megatron's, as they are at each call (a loss_func built
    before megatron's parallel state is up still finds them); cp_group, if given, is the CP group instead.
    """
    given_pg = None if pg_collection is None else default_groups(pg_collection)  # checked here
    head = Head.of(loss_cfg) if head is None else head
    want_entropy = entropy or loss_cfg.entropy_coef != 0
    said: list = []

    def loss_func(mb: Microbatch, output: Tensor):
        pg = given_pg if given_pg is not None else default_groups()
        cp = pg.cp if cp_group is None else cp_group
        mb = as_microbatch(mb)
        if mb.agg_weight is not None and (mb.seq_index is None or mb.n_seqs is None):
            raise ValueError(f"a microbatch with agg_weight needs seq_index and n_seqs (sequence sums), got "
                             f"seq_index={'None' if mb.seq_index is None else 'a tensor'}, n_seqs={mb.n_seqs}; "
                             "build it with step.packing.microbatches, or leave out the normalisation fields")
        group = cp if mb.agg_weight is not None and size(cp) > 1 else None
        given = dict(advantages=mb.advantages, loss_mask=mb.loss_mask, old_logprobs=mb.old_logprobs,
                     rollout_logprobs=mb.rollout_logprobs, ref_logprobs=mb.ref_logprobs,
                     keep=mb.token_keep)  # M2PO's selection (step.m2po), made before the step

        def loss_of(lp, ent, seq_sum):
            g = dict(given, entropy=ent, old_logprobs=lp.detach() if old_from_current else mb.old_logprobs)
            return microbatch_loss(loss_cfg, lp, given=g, seq_sum=seq_sum, agg_weight=mb.agg_weight,
                                   agg_share=mb.agg_share, loss_scale=mb.loss_scale)

        seq_sum = None if mb.agg_weight is None else _segment_sum(mb.seq_index, mb.n_seqs, group)
        grad_loss = None
        if head.grad:  # what the head needs to form the gradient per chunk: a segment sum without collective
            local = None if mb.agg_weight is None else _segment_sum(mb.seq_index, mb.n_seqs, None)
            grad_loss = GradLoss(loss_cfg, given, lambda lp, ent: loss_of(lp, ent, local)[0], mb.agg_weight,
                                 mb.loss_scale, old_from_current, 1 if group is None else dist.get_world_size(group))
        scored = score_microbatch(mb, output, head, temperature=temperature, vocab_size=vocab_size,
                                  entropy=want_entropy, tp_group=pg.tp, loss=grad_loss)
        loss, denominator, m = loss_of(scored.lp, scored.ent, seq_sum)
        if head.grad:
            scored.report(m)
            if scored.fell_back is not None and not said:
                said.append(True)
                _say_once(f"loss.head=fused_grad falls back to '{'fused' if mb.fused is not None else 'logits'}': "
                          f"{scored.fell_back}", pg)
        if scored.z is not None:
            loss = loss.detach() + scored.z  # the value of the ordinary loss, the gradient of the op
        num_tokens = mb.num_tokens if denominator is None else denominator.round().to(torch.int)
        return loss, num_tokens, m

    return loss_func


def make_forward_step(loss_cfg: LossConfig, *, temperature: float = 1.0, vocab_size: Optional[int] = None,
                      old_from_current: bool = False, entropy: bool = True, calls: Optional[list] = None,
                      pg_collection=None):
    """forward_step(data_iterator, model) for megatron-core's schedules: the whole loss plugin.

    The iterator yields Microbatches (step.microbatch); loss_func is `make_loss_func`'s. The first
    call checks the model config (check_megatron_config: per-token loss and the loop's hooks).
    `calls`, if given, gets one entry per model forward (for tests and benchmarks). pg_collection:
    the model's process groups (step/groups.py; default megatron's, at each call).
    """
    head = Head.of(loss_cfg)
    loss_func = make_loss_func(loss_cfg, temperature=temperature, vocab_size=vocab_size, head=head,
                               old_from_current=old_from_current, entropy=entropy, pg_collection=pg_collection)
    step = forward_step_for(loss_func, calls, head=head, pg_collection=pg_collection)
    checked: list = []

    def forward_step(data_iterator, model):
        if not checked:  # an in-house loop may have skipped Megatron-LM's train() hooks
            check_megatron_config([model], head=head)
            checked.append(True)
        return step(data_iterator, model)
    return forward_step


def run_schedule(chunks, forward_step, microbatches: list, *, forward_only: bool):
    """megatron's forward/backward over `microbatches` (step.microbatch.Microbatch); returns what
    the loss functions reported, one entry per microbatch, on the last pipeline stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    its = [iter(microbatches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=its if len(chunks) > 1 else its[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(microbatches),
        seq_length=microbatches[0].seq_length, micro_batch_size=microbatches[0].input_ids.shape[0],
        forward_only=forward_only)


@torch.no_grad()
def compute_logprobs(chunks, batch: Rollouts, step_cfg: StepConfig, *, vocab_size: Optional[int] = None,
                     calls: Optional[list] = None, head: "Head | str" = "logits", pg_collection=None) -> Tensor:
    """Forward-only pass through the schedule, packed or padded as step_cfg says; [n, s] fp32
    logprobs of `batch`'s targets (0 on padding and untrained targets), on every PP and CP rank.
    head: step.head.Head, or its kind; fused_grad scores with the plain fused head here (a
    forward-only pass needs no gradient).
    Collectives: the schedule's, a MAX over DP (bin count), a SUM over CP, a broadcast over PP.
    pg_collection: the model's process groups (step/groups.py; default megatron's)."""
    pg = default_groups(pg_collection)
    head = Head.coerce(head).without_grad()
    temperature = step_cfg.temperature
    shape = (batch.tokens.shape[0], batch.tokens.shape[1] - 1)
    microbatches = build_microbatches(batch, None, step_cfg, step_layout(chunks, step_cfg, pg), pg.dp)
    def loss_func(mb, output):
        lp = head_logprobs(mb, output, temperature=temperature, vocab_size=vocab_size, entropy=False, tp_group=pg.tp)
        return lp.sum(), torch.zeros((), dtype=torch.int, device=lp.device), \
            {"logprobs": lp.detach(), "gather_index": mb.gather_index}

    forward_step = forward_step_for(loss_func, calls, head=head, pg_collection=pg)
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        reports = run_schedule(chunks, forward_step, microbatches, forward_only=True)
    finally:
        for c, mode in zip(chunks, modes):
            c.train(mode)
    device = microbatches[0].input_ids.device
    full = None
    if is_last_stage(pg):
        full = torch.zeros(shape[0] * shape[1], dtype=torch.float32, device=device)
        for r in reports:
            idx, lp = r["gather_index"].reshape(-1), r["logprobs"].reshape(-1)
            full[idx[idx >= 0]] = lp[idx >= 0]
        if size(pg.cp) > 1:  # each CP rank scored its own chunks of every sequence
            dist.all_reduce(full, group=pg.cp)
        full = full.view(shape)
    return broadcast_tensor_from_last_stage(full, shape, pg, device=device)
