"""Preemption: on SIGTERM the runner finishes the current step, writes a checkpoint and stops.

    preempt.install()                 # before the step loop; the handler only sets a flag
    if preempt.agreed(env.device):    # after each step, on every rank: MAX of the flag
        ... save a checkpoint, then raise Preempted(message)
    preempt.uninstall()               # in the loop's finally

torchrun forwards SIGTERM to its workers and kills them 30 s later; a scheduler sends it to
every process. Ranks that see the signal at different moments still stop at the same step,
because they stop when any rank has seen it.
"""
from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

_requested = False
_previous = None


class Preempted(RuntimeError):
    """SIGTERM: the step finished, a checkpoint was written and the run stopped; raised alike on
    every rank after rank 0 printed where the checkpoint is."""


def _handler(signum, frame) -> None:
    global _requested
    _requested = True


def install() -> None:
    """Catch SIGTERM (main thread only; elsewhere signals cannot be caught and nothing changes)."""
    global _previous, _requested
    _requested = False
    if threading.current_thread() is threading.main_thread():
        _previous = signal.signal(signal.SIGTERM, _handler)


def uninstall() -> None:
    global _previous
    if _previous is not None:
        signal.signal(signal.SIGTERM, _previous)
        _previous = None


def requested() -> bool:
    """Whether this process has received SIGTERM since install()."""
    return _requested


def agreed(device: torch.device) -> bool:
    """Collective over the world (one MAX all-reduce of one int on `device`): whether any rank
    has received SIGTERM. Every rank gets the same answer, so all stop after the same step."""
    flag = torch.tensor([int(_requested)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def stop_message(label: str, step: int, path) -> str:
    return (f"[{label}] stopped by SIGTERM after step {step}: checkpoint written to {path}; to continue, run the "
            f"same command with run.resume=true")
