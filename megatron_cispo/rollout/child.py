"""The trainer's child processes (reward_worker, vllm_worker) and the pipe to them: each message is an
8-byte little-endian length and a pickle; the trainer writes the child's stdin and reads its stdout.

    proc = start("megatron_cispo.rollout.reward_worker", first)   # trainer: runs that module's serve()
    reply, first = attach()                                        # first thing in the child's serve()
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])  # the child imports this checkout, installed or not


def cause(e: BaseException) -> str:
    """An exception as one line for the other side of the pipe."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]


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
    """The next message on fd; TimeoutError past `deadline` (time.monotonic(); None: wait), EOFError
    when the other side closed the pipe."""
    return pickle.loads(_read_exact(fd, int.from_bytes(_read_exact(fd, 8, deadline), "little"), deadline))


def start(module: str, first_message, *, env: dict | None = None, stderr=None) -> subprocess.Popen:
    """Run `module`'s serve() in a new python (this one's executable) with the repo root first on its
    PYTHONPATH, in its own session (a terminal's Ctrl-C reaches only the trainer, which closes it), and
    send it `first_message`. env: its environment (default this one's); stderr: where its output goes."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-c", f"from {module} import serve; serve()"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
    send(proc.stdin, (first_message, os.getpid()))
    return proc


def attach():
    """The child's side of start(): (the reply file, the first message), or None when the trainer is
    already gone (the child should return). Afterwards fd 1 is stderr, so what the child's libraries
    print goes to its log and the old stdout pipe carries only replies; SIGINT is ignored; and the
    child is killed when the trainer dies, even by SIGKILL (PR_SET_PDEATHSIG)."""
    import ctypes

    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    first, parent = recv(0, None)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the death signal was armed: do not start
        return None
    return reply, first
