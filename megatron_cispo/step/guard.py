"""The non-finite guard of the policy step: refuse non-finite advantages before any schedule, and
skip an optimizer step on every rank when the model output, the loss or a gradient is non-finite.

    check_advantages(batch)                               # before the pi_old pass and schedules
    loss_func = watch_loss(loss_func, seen)               # records [output finite, loss finite]
    bad = nonfinite_this_step(seen, chunks, device)       # one MAX all-reduce, before optimizer.step()
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .reduce import all_reduce_in
from .rollouts import Rollouts

# What a skipped step checks, in data-flow order: the first one flagged is the one named.
# "logits" is the model output the loss reads (the hidden states under loss.head=fused).
NONFINITE_CHECKS = ("logits", "loss", "grad")


def _world_max(t):
    """MAX all-reduce over the whole job, in place: every rank then takes the same branch."""
    return all_reduce_in(t, dist.ReduceOp.MAX, dist.group.WORLD)


def check_advantages(batch: Rollouts) -> None:
    """Raise the same ValueError on every rank when any rank's batch has a non-finite advantage
    on a trained target. Collectives: one MAX all-reduce over the world; on failure, one
    all_gather_object to name the rank, row and target."""
    bad = batch.nonfinite_advantages()
    flag = _world_max(bad.any().reshape(1).to(batch.tokens.device, torch.float32))
    if not flag.item():
        return
    here = batch.describe_nonfinite(bad) if bool(bad.any()) else None
    found = [here]
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, here)
    rank, what = next((r, w) for r, w in enumerate(found) if w is not None)
    raise ValueError(f"rollouts.{what} on rank {rank} (a row of that rank's DP-local batch): advantages must be "
                     f"finite wherever loss_mask trains a target. Fix the advantage computation (a NaN often "
                     f"comes from normalising a group whose rewards have zero std) or mask the row out")


def watch_loss(loss_func, seen: list):
    """loss_func that also records, per microbatch, [model output finite, loss finite] as a
    detached bool [2] tensor on the output's device (no host sync)."""
    def watched(mb: dict, output):
        loss, num_tokens, metrics = loss_func(mb, output)
        with torch.no_grad():  # a sum is non-finite iff an element is (or it overflows fp32, which
            # usable logits never do); unlike isfinite().all() it makes no copy of the logits
            seen.append(torch.stack([torch.isfinite(output.sum(dtype=torch.float32)),
                                     torch.isfinite(loss.detach()).to(output.device)]))
        return loss, num_tokens, metrics
    return watched


def _grads_finite(chunks, device) -> torch.Tensor:
    """bool [1]: every local gradient is finite. Reads megatron DDP's flat grad buffers (one
    reduction each), else each parameter's main_grad or grad."""
    grads = []
    for chunk in chunks:
        buffers = getattr(chunk, "buffers", None)  # DDP's list; nn.Module.buffers is a method
        if isinstance(buffers, list):
            grads += [b.grad_data for b in buffers + list(getattr(chunk, "expert_parallel_buffers", []))]
            continue
        for param in chunk.parameters():
            g = getattr(param, "main_grad", None)
            grads.append(param.grad if g is None else g)
    sums = [g.sum(dtype=torch.float32).to(device) for g in grads if g is not None]
    return torch.isfinite(torch.stack(sums)).all().reshape(1) if sums else torch.ones(1, dtype=torch.bool,
                                                                                      device=device)


def has_grad_scaler(optimizer) -> bool:
    """megatron's mixed-precision optimizer with a loss scaler (fp16, or an explicit loss_scale)
    finds inf/NaN gradients itself, skips the step and lowers a dynamic scale."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(getattr(o, "grad_scaler", None) is not None for o in parts)


def nonfinite_this_step(seen: list, chunks, device, *, check_grads: bool = True) -> list[str]:
    """NONFINITE_CHECKS names that were non-finite on any rank in this optimizer step's schedule
    (`seen`: `watch_loss`'s records, on the last stage) or its gradients. Collective: one MAX
    all-reduce over the world, so every rank gets the same answer before any parameter changes."""
    out = torch.stack(seen).to(device).all(0) if seen else torch.ones(2, dtype=torch.bool, device=device)
    grads = _grads_finite(chunks, device) if check_grads else torch.ones(1, dtype=torch.bool, device=device)
    flags = _world_max((~torch.cat([out, grads])).float())
    return [name for name, f in zip(NONFINITE_CHECKS, flags.tolist()) if f]


def zero_grads(chunks, optimizer) -> None:
    for c in chunks:
        c.zero_grad_buffer()
    optimizer.zero_grad()


def warn_skipped(bad: list[str], step: int, steps: int) -> None:
    """Rank 0 only: every rank skipped, for the same reason."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(f"policy_step skipped optimizer step {step} of {steps} on every rank: non-finite "
                      f"{bad[0]} (all non-finite: {', '.join(bad)}); gradients zeroed, parameters and "
                      f"optimizer state unchanged", RuntimeWarning, stacklevel=3)
