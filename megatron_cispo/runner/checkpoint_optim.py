"""The optimizer's side of a checkpoint (checkpoint.py): what its sharded state needs before a save or
a load, its state loaded with the config's settings kept, and the checks that a checkpoint's optimizer
can be read by this run's (the chained optimizers' count, plain or distributed).

    load_optimizer_state(optimizer, state["optimizer"])   # after dist_checkpointing.load
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import ConfigError


def zero_step(dist_opt) -> None:
    """Give a distributed optimizer that has not stepped yet the state tensors a load fills in place:
    without Apex or TE its state_dict() reads each parameter's Adam "step", absent before the first
    step. megatron's own _init_optimizer_states_with_dummy_values (a step on zero gradients), run at
    lr 0 so that weight decay cannot move the weights."""
    lrs = [g["lr"] for g in dist_opt.optimizer.param_groups]
    for g in dist_opt.optimizer.param_groups:
        g["lr"] = 0.0
    try:
        dist_opt._init_optimizer_states_with_dummy_values()
    finally:
        for g, lr in zip(dist_opt.optimizer.param_groups, lrs):
            g["lr"] = lr


def sgd_init_state(opt, config=None) -> None:
    """Zero momentum buffers for loading into: megatron-core 0.16.1 builds SGD with init_state_fn=None,
    which optimizer.sharded_state_dict(is_loading=True) calls."""
    for group in opt.param_groups:
        if group.get("momentum", 0):
            for p in group["params"]:
                opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p.data))


# Param-group settings the optimizer is built with from the config; load_state_dict would replace them
# by the checkpoint's (lr is set before every step, clip_grad lives in the optimizer's config).
_SETTINGS = ("weight_decay", "betas", "eps", "momentum")


def load_optimizer_state(optimizer, state: dict) -> None:
    """optimizer.load_state_dict(state), keeping the optimizer's own settings (weight decay, betas,
    eps, momentum): the state (moments, step counts) is the checkpoint's, the settings the config's."""
    settings = [{k: g[k] for k in _SETTINGS if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, kept in zip(optimizer.param_groups, settings):
        group.update(kept)
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        _own_steps(getattr(sub, "optimizer", sub))


def _own_steps(inner) -> None:
    """megatron-core's DistributedOptimizer.load_state_dict (without Apex or TE) gives every parameter's
    state one shared "step" tensor, which torch's Adam then increments in place once per parameter:
    after a resume the bias correction counted the parameters (step 2 -> 19 over 17 of them, seen
    here). Each parameter gets its own copy."""
    seen = set()
    for st in inner.state.values():
        step = st.get("step") if isinstance(st, dict) else None
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                st["step"] = step.clone()
            seen.add(id(step))


def is_distributed(optimizer) -> bool:
    """Whether `optimizer` is megatron's distributed optimizer (optimizer.distributed), chained or not."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(sub, DistributedOptimizer) for sub in getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_count(optimizer) -> int:
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


def check_optimizer_count(path: Path, info: dict, optimizer, *, ep_now: int) -> None:
    """megatron-core 0.16.1 puts expert parameters in an optimizer of their own only when ep > 1, and
    the chained optimizers' non-tensor state (param groups) cannot be mapped between one and two."""
    saved, now = info.get("optimizers", 1), optimizer_count(optimizer)
    if saved != now:
        ep = info.get("layout", {}).get("ep")
        raise ConfigError(f"run.resume: {path} was saved with {saved} chained optimizer(s) (ep={ep}) and this layout "
                          f"builds {now} (ep={ep_now}): megatron-core gives expert parameters their own "
                          f"optimizer only when ep > 1; resume with ep {'> 1' if saved > now else '= 1'}")


def check_optimizer_kind(path: Path, info: dict, optimizer) -> None:
    """The two optimizers' checkpoints do not read as each other (tried without this check: a plain
    one loaded by the distributed optimizer misses "optimizer.state.param.<name>", the other way round
    "pre_wd_mult"), so a resume that switches optimizer.distributed is refused naming both settings
    (checkpoints from before COMPLETE recorded it were written by the plain optimizer)."""
    saved, now = bool(info.get("distributed_optimizer", False)), is_distributed(optimizer)
    if saved != now:
        raise ConfigError(f"run.resume: {path} was saved with optimizer.distributed={str(saved).lower()} and this run "
                          f"has optimizer.distributed={str(now).lower()}: the two optimizers' states are not "
                          f"interchangeable; resume with optimizer.distributed={str(saved).lower()}, or start a "
                          "new run (another run.run_dir)")
