"""The reward worker process of rewards.RewardRunner (the pipe and the start-up: child.py). The worker
loads the spec, then answers (kind, value) per sample, kind "ok" (a finite float), "error" or
"non_number" (value: the cause, one line).

    python -c "from megatron_cispo.rollout.reward_worker import serve; serve()"   # started by RewardRunner
"""
from __future__ import annotations

import math
import numbers
import sys

from .child import attach, cause, recv, send
from .rewards import load_reward


def _as_number(v) -> float | None:
    if isinstance(v, numbers.Real) or (type(v).__module__ == "numpy" and getattr(v, "shape", None) == ()):
        try:
            f = float(v)
        except (TypeError, ValueError):
            return None
        return f if math.isfinite(f) else None
    return None


def serve() -> None:
    """The worker: load the spec, then answer (kind, value) for each sample until stdin closes."""
    attached = attach()
    if attached is None:
        return
    reply, (spec, path) = attached
    sys.path[:] = path  # the trainer's: a reward module it could import, this process can too
    try:
        fn = load_reward(spec)
    except ValueError as e:
        return send(reply, ("error", str(e)))
    send(reply, ("ready", None))
    while True:
        try:
            record, completion, ids, finish_reason = recv(0, None)
        except EOFError:
            return
        try:
            value = fn(record, completion, ids, finish_reason)
        except Exception as e:  # noqa: BLE001 - any failure of the user's code is counted, not fatal
            send(reply, ("error", f"raised {cause(e)}"))
            continue
        number = _as_number(value)
        send(reply, ("ok", number) if number is not None else
              ("non_number", f"returned {type(value).__name__} {repr(value)[:40]}, not a finite number"))
