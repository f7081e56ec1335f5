"""One RL policy update through megatron-core's own pipeline schedules.

    metrics = policy_step(chunks, optimizer, rollouts, loss_cfg, StepConfig(micro_batch_size=2))

Data flow, one function each: check_batch (refuse what cannot train, plan how pi_old is
obtained: given, a forward-only pass, or the training forward itself) -> prepare_inputs
(optional pi_old / pi_ref passes; with correction.m2po, one global token selection over the
whole batch, step.m2po) -> train (per minibatch, megatron's schedule runs `make_loss_func`'s
loss plugin and the optimizer steps) -> TrainRun.metrics (the microbatch Metrics reduced exactly
over DP x CP on the last stage and broadcast over the pipeline) and the routers' (step.moe).
Guards: non-finite advantages on trained targets are refused before any schedule runs, and an
optimizer step whose model output, loss or gradient is non-finite on any rank is skipped on
every rank (one MAX all-reduce decides, before any parameter changes).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, Optional

import torch
import torch.distributed as dist

from ..config import LossConfig
from ..losses import check_loss_config, required_inputs, valid_tokens
from ..losses.registry import missing_input_message
from .forward import check_megatron_config, compute_logprobs, forward_step_for, make_loss_func, run_schedule
from .groups import default_groups, rank, size
from .head import Head
from .guard import (NONFINITE_CHECKS, check_advantages, has_grad_scaler, nonfinite_this_step, warn_skipped,
                    watch_loss, zero_grads)
from .m2po import dp_shard_row_ids, step_selection
from .moe import RouterStats, moe_aux_loss_compensation
from .packing import Layout, microbatches, step_layout
from .pipeline import broadcast_object_from_last_stage, is_last_stage
from .reduce import all_reduce_in, reduce_metrics
from .rollouts import Rollouts, StepConfig
from .routing_replay import RoutingReplay


OldPlan = Literal["given", "pass", "from_training_forward", "unused"]


def plan_old_logprobs(loss_cfg: LossConfig, step_cfg: StepConfig, *, optimizer_steps: int,
                      have_old: bool) -> OldPlan:
    """Decide how pi_old is obtained. `required_inputs` already consults the anchor, TIS and KL.
    M2PO selects tokens by pi_old before the first microbatch runs, so it always needs the pass."""
    if "old_logprobs" not in required_inputs(loss_cfg):
        return "unused"  # e.g. cispo with anchor='rollout' and no TIS
    if have_old:
        return "given"
    if step_cfg.old_logprob_pass == "auto" and optimizer_steps == 1 and loss_cfg.correction.m2po is None:
        return "from_training_forward"  # one step per batch: pi_old == pi_theta, detached
    return "pass"


def policy_step(chunks, optimizer, batch: Rollouts, loss_cfg: LossConfig, step_cfg: StepConfig, *,
                vocab_size: Optional[int] = None, ref_chunks=None, calls: Optional[list] = None,
                row_ids: Optional[torch.Tensor] = None, pg_collection=None) -> dict[str, float]:
    """Run one full RL update (minibatches x epochs, each an optimizer step) on DP-local `batch`.

    Each micro_batch_size rows are packed into [1, T] bins of at most
    step_cfg.max_tokens_per_microbatch tokens (THD, split over CP), or padded into one [b, s]
    microbatch; either way the same rows share a microbatch in every layout. pi_old comes from
    `batch.old_logprobs`, the training forward, or a forward-only pass, as `plan_old_logprobs`
    decides. With KL on and no `batch.ref_logprobs`, the reference model's `ref_chunks` (same
    layout) are scored in a forward-only pass through the same schedule.

    Returns global metrics (identical on every rank): the loss metrics reduced exactly over
    microbatches and DP x CP ("policy/loss", "<loss>/ratio_mean", ...), "step/grad_norm" (mean
    over optimizer steps that computed one), "step/optimizer_steps" (taken), "step/skipped_steps"
    (overflow or non-finite), "step/skipped_nonfinite" (skipped because the model output, loss
    or gradient was non-finite on some rank; grads zeroed, optimizer state untouched, a warning
    from rank 0 names the first; with a loss scaler, gradient overflows are left to the
    optimizer and counted as overflow), "step/nonfinite_{logits,loss,grad}" (steps where each was),
    "step/old_logprob_pass" (1.0 if an extra forward pass computed pi_old),
    "step/forward_calls" (model forwards on this rank) and "step/microbatches" (per step, this rank).
    With loss.correction.m2po, the selection adds "correction/m2po_m2_before" / "_after" (mean
    (log rho)^2 over the valid / kept tokens) and "correction/m2po_kept_m2_max", exact over the
    global batch; the loss reports "correction/m2po_masked_frac". An MoE model adds
    "moe/aux_loss" and "moe/z_loss" (when the router computes them) and "moe/expert_tokens_max" /
    "_min", exact over DP, EP, TP, CP and PP (step.moe.RouterStats.reduce defines them).
    With batch.routed_experts on an MoE model, step.routing_replay adds "moe/route_mismatch" (and
    per MoE layer "moe/route_mismatch_l{j}"), "moe/replay_fallback_frac" and "moe/replay_fallbacks";
    loss.routing_replay='rollout' also routes every pass (pi_old, reference, training) the sampler's way;
    'off' on routers that cannot be measured (routing_replay.unusable) ignores the routes. Routes that
    disagree with the model raise routing_replay.BadRoutes on every rank, naming the global sample.
    row_ids: [n] int, each local row's global sequence index, unique over DP and the same in every
    layout (M2PO's tie-break); default: the Rollouts.dp_shard layout, with as many minibatches as
    minibatch_size makes.
    pg_collection: megatron-core's ProcessGroupCollection the model runs on (tp, pp, cp, tp_cp, dp,
    dp_cp); default: megatron's parallel_state groups (step.groups.default_groups).
    Raises ValueError on every rank, before any schedule, for a non-finite advantage on a
    trained target on any rank (`check_advantages`); non-finite old/rollout/ref logprobs are not
    an error: the loss drops those tokens and counts them in "policy/nonfinite_dropped".
    """
    pg = default_groups(pg_collection)
    check_megatron_config(chunks, head=Head.of(loss_cfg))
    check_loss_config(loss_cfg)
    shape = check_batch(chunks, batch, loss_cfg, step_cfg, ref_chunks=ref_chunks, pg=pg)
    calls = [] if calls is None else calls
    if row_ids is None:  # global sample indices: M2PO's tie-break, and a bad route's name
        row_ids = dp_shard_row_ids(shape.n, shape.mini_local, rank(pg.dp), size(pg.dp), batch.tokens.device)
    # MoE routing replay (R3) in every pass over the rollouts: pi_old, reference and training
    replay = RoutingReplay.of([*chunks, *(ref_chunks or [])], batch, loss_cfg.routing_replay, pg, row_ids=row_ids)
    if replay is None and batch.routed_experts is not None:  # routes the routers cannot take: ignored
        batch = batch.replace(routed_experts=None)
    with replay or contextlib.nullcontext():
        batch, keep, m2po_metrics = prepare_inputs(chunks, batch, loss_cfg, step_cfg, shape, vocab_size=vocab_size,
                                                   ref_chunks=ref_chunks, calls=calls, row_ids=row_ids, pg=pg)
        router_stats = RouterStats.of(chunks, pg)  # None for a dense model
        run = train(chunks, optimizer, batch, loss_cfg, step_cfg, shape, keep=keep, vocab_size=vocab_size,
                    calls=calls, router_stats=router_stats, pg=pg)
    return {**run.metrics(shape, pg), "step/forward_calls": float(len(calls)), **m2po_metrics,
            **(router_stats.reduce() if router_stats is not None else {}),
            **(replay.reduce() if replay is not None else {})}


@dataclass(frozen=True)
class StepShape:
    """What check_batch settles: rows per rank, rows per local minibatch, optimizer steps, how
    pi_old is obtained, and where the microbatches run."""

    n: int
    mini_local: int
    steps: int
    plan: OldPlan
    layout: Layout
    head: Head


def check_batch(chunks, batch: Rollouts, loss_cfg: LossConfig, step_cfg: StepConfig, *, ref_chunks, pg) -> StepShape:
    """Refuse, on every rank and before any schedule, a batch this step cannot train: off the
    model's device, uneven over DP, no rows, sizes that do not divide, a missing input, a non-finite
    advantage on a trained target. Collectives: a MAX over DP (rows), check_advantages'."""
    dp = size(pg.dp)
    n = batch.tokens.shape[0]
    param = next(chunks[0].parameters())
    if batch.tokens.device != param.device:
        raise ValueError(f"rollouts are on {batch.tokens.device} but the model is on {param.device}; move the "
                         "batch to the model's device (NCCL collectives need it there)")
    # Every DP rank must run the same schedules: a rank with more rows would wait in a collective.
    rows = all_reduce_in(torch.tensor([n, -n], device=param.device), dist.ReduceOp.MAX, pg.dp)
    if int(rows[0]) != -int(rows[1]):
        raise ValueError(f"data-parallel ranks hold different numbers of rows ({-int(rows[1])} to {int(rows[0])}; "
                         f"this rank {n}); shard the global batch evenly (Rollouts.dp_shard)")
    mini_local = n if step_cfg.minibatch_size is None else step_cfg.minibatch_size // dp
    if n == 0 or mini_local == 0:
        raise ValueError(f"policy_step got no rows to train on (n={n} per rank, minibatch_size="
                         f"{step_cfg.minibatch_size}, dp={dp})")
    if step_cfg.minibatch_size is not None and (step_cfg.minibatch_size % dp or (n * dp) % step_cfg.minibatch_size):
        raise ValueError(f"minibatch_size={step_cfg.minibatch_size} must divide the global batch "
                         f"({n} per rank x dp={dp}) and be a multiple of dp")
    if mini_local % step_cfg.micro_batch_size:
        raise ValueError(f"micro_batch_size={step_cfg.micro_batch_size} must divide the per-rank "
                         f"minibatch of {mini_local} sequences")
    steps = step_cfg.epochs * (n // mini_local)
    plan = plan_old_logprobs(loss_cfg, step_cfg, optimizer_steps=steps, have_old=batch.old_logprobs is not None)
    # Checked on every rank before the schedule starts: raised inside the last stage's loss,
    # a missing input would leave the other stages waiting in p2p until the timeout.
    for name in sorted(required_inputs(loss_cfg) - {"entropy"}):
        produced = (name == "old_logprobs" and plan in ("pass", "from_training_forward")
                    or name == "ref_logprobs" and ref_chunks is not None)
        if getattr(batch, name) is None and not produced:
            raise ValueError(f"rollouts.{name} is missing: {missing_input_message(loss_cfg, name)}")
    check_advantages(batch)
    return StepShape(n=n, mini_local=mini_local, steps=steps, plan=plan, layout=step_layout(chunks, step_cfg, pg),
                     head=Head.of(loss_cfg))


def prepare_inputs(chunks, batch: Rollouts, loss_cfg: LossConfig, step_cfg: StepConfig, shape: StepShape, *,
                   vocab_size, ref_chunks, calls: list, row_ids, pg) -> tuple[Rollouts, Optional[torch.Tensor], dict]:
    """The batch with pi_old and pi_ref filled in by forward-only passes where the plan needs them,
    and with correction.m2po the global keep mask [n, s] and its metrics (else None, {})."""
    score = partial(compute_logprobs, batch=batch, step_cfg=step_cfg, vocab_size=vocab_size, calls=calls,
                    head=shape.head, pg_collection=pg)
    if shape.plan == "pass":
        batch = batch.replace(old_logprobs=score(chunks))
    if "ref_logprobs" in required_inputs(loss_cfg) and batch.ref_logprobs is None:
        batch = batch.replace(ref_logprobs=score(ref_chunks))
    if loss_cfg.correction.m2po is None:
        return batch, None, {}
    # whole batch, every DP rank, before the first microbatch
    given = {k: getattr(batch, k) for k in ("old_logprobs", "rollout_logprobs", "ref_logprobs")}
    keep, metrics = step_selection(batch.old_logprobs, batch.rollout_logprobs,
                                   valid_tokens(loss_cfg, batch.loss_mask, **given), loss_cfg.correction.m2po,
                                   row_ids=row_ids, group=pg.dp)
    return batch, keep, metrics


@dataclass
class TrainRun:
    """What the optimizer steps of one policy step left on this rank."""

    per_microbatch: list = field(default_factory=list)  # the loss's Metrics, last stage only
    counts: list = field(default_factory=list)  # microbatches per optimizer step
    grad_norms: list = field(default_factory=list)
    skipped: int = 0  # by the optimizer (overflow)
    skipped_nonfinite: int = 0
    nonfinite: dict = field(default_factory=lambda: dict.fromkeys(NONFINITE_CHECKS, 0))

    def metrics(self, shape: StepShape, pg) -> dict[str, float]:
        """The loss metrics reduced over DP x CP on the last stage, broadcast over PP, and the step's."""
        metrics = None
        if is_last_stage(pg):
            metrics = reduce_metrics(self.per_microbatch, group=pg.dp_cp)
        metrics = broadcast_object_from_last_stage(metrics, pg)
        skipped = self.skipped + self.skipped_nonfinite
        return {**metrics,
                "step/grad_norm": sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else float("nan"),
                "step/optimizer_steps": float(shape.steps - skipped), "step/skipped_steps": float(skipped),
                "step/skipped_nonfinite": float(self.skipped_nonfinite),
                **{f"step/nonfinite_{k}": float(v) for k, v in self.nonfinite.items()},
                "step/old_logprob_pass": float(shape.plan == "pass"),
                "step/microbatches": sum(self.counts) / len(self.counts)}


def train(chunks, optimizer, batch: Rollouts, loss_cfg: LossConfig, step_cfg: StepConfig, shape: StepShape, *,
          keep: Optional[torch.Tensor], vocab_size, calls: list, router_stats: Optional[RouterStats], pg) -> TrainRun:
    """Per epoch and minibatch: microbatches, megatron's schedule with the loss plugin, then the
    optimizer step, or a skip on every rank when something was non-finite on any rank."""
    from megatron.core.utils import get_model_config

    seen: list = []
    loss_func = make_loss_func(loss_cfg, temperature=step_cfg.temperature, vocab_size=vocab_size, head=shape.head,
                               old_from_current=shape.plan == "from_training_forward", pg_collection=pg)
    forward_step = forward_step_for(watch_loss(loss_func, seen), calls, head=shape.head, moe=router_stats,
                                    pg_collection=pg)
    build = partial(microbatches, loss_cfg=loss_cfg, step_cfg=step_cfg, layout=shape.layout,
                    dp_group=pg.dp)
    scaler = has_grad_scaler(optimizer)
    run = TrainRun()
    for _ in range(step_cfg.epochs):
        for start in range(0, shape.n, shape.mini_local):
            part = slice(start, start + shape.mini_local)
            mbs = build(batch.rows(part), token_fields=None if keep is None else {"token_keep": keep[part]})
            run.counts.append(len(mbs))
            zero_grads(chunks, optimizer)
            seen.clear()
            with moe_aux_loss_compensation(get_model_config(chunks[0]), padding_mask=shape.layout.padding_mask), \
                    router_stats or contextlib.nullcontext():
                run.per_microbatch += run_schedule(chunks, forward_step, mbs, forward_only=False)
            # megatron's fp32 and bf16 optimizers step on a NaN gradient (the clip coefficient is NaN,
            # so nothing is clipped), so the decision is taken here, before optimizer.step() runs. A
            # loss scaler's overflows stay the optimizer's: skipping them here would never lower the scale.
            bad = nonfinite_this_step(seen, chunks, batch.tokens.device, check_grads=not scaler)
            if bad:
                run.skipped_nonfinite += 1
                for name in bad:
                    run.nonfinite[name] += 1
                warn_skipped(bad, len(run.counts), shape.steps)
                zero_grads(chunks, optimizer)
                continue
            ok, grad_norm, _ = optimizer.step()
            run.skipped += not ok  # a mixed-precision optimizer skips a step on overflow
            if grad_norm is not None:  # None when clip_grad=0 on the fp32 optimizer
                run.grad_norms.append(float(grad_norm))
    return run
