"""The reward worker process of rewards.RewardRunner and the pipe between them: each message is an
8-byte little-endian length and a pickle. The worker loads the spec, then answers (kind, value) per
sample, kind "ok" (a finite float), "error" or "non_number" (value: the cause, one line).

    python -c "from megatron_cispo.rollout.reward_worker import serve; serve()"   # started by RewardRunner
"""
from __future__ import annotations

import math
import numbers
import os
import pickle
import select
import sys
import time


def cause(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]


def _as_number(v) -> float | None:
    if isinstance(v, numbers.Real) or (type(v).__module__ == "numpy" and getattr(v, "shape", None) == ()):
        try:
            f = float(v)
        except (TypeError, ValueError):
            return None
        return f if math.isfinite(f) else None
    return None


def send(f, obj) -> None:
    data = pickle.dumps(obj)
    f.write(len(data).to_bytes(8, "little") + data)
    f.flush()


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    buf = b""
    while len(buf) < n:
        if deadline is not None and not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise TimeoutError
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def recv(fd: int, deadline: float | None):
    return pickle.loads(_read_exact(fd, int.from_bytes(_read_exact(fd, 8, deadline), "little"), deadline))


def serve() -> None:
    """The worker: load the spec, then answer (kind, value) for each sample until stdin closes."""
    import ctypes
    import signal

    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the reward's prints go to stderr; fd 1's old pipe carries only the replies
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from .rewards import load_reward  # here: rewards imports this module

    spec, path, parent = recv(0, None)
    try:  # die with the trainer, even when it is killed; and if it already died, do not start
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        return
    sys.path[:] = path
    try:
        fn = load_reward(spec)
    except ValueError as e:
        return send(reply, ("error", str(e)))
    send(reply, ("ready", None))
    while True:
        try:
            record, completion, ids = recv(0, None)
        except EOFError:
            return
        try:
            value = fn(record, completion, ids)
        except Exception as e:  # noqa: BLE001 - any failure of the user's code is counted, not fatal
            send(reply, ("error", f"raised {cause(e)}"))
            continue
        number = _as_number(value)
        send(reply, ("ok", number) if number is not None else
              ("non_number", f"returned {type(value).__name__} {repr(value)[:40]}, not a finite number"))
