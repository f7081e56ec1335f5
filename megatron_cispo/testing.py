"""Run a function on N local gloo processes and collect each rank's result.

    results = spawn(worker, world_size=4, args=(...))   # worker(*args) runs on every rank

Processes come from a forkserver that has already imported torch and megatron-core, so a
launch costs milliseconds, not an import per rank. A rank that raises fails the call at once
with that rank's traceback (the others are killed), so a broken rank never turns into a hang.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from typing import Any, Callable

from .runner.distributed import free_port  # noqa: F401 - tests import it from here


_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
            "megatron.core.pipeline_parallel", "megatron.core.optimizer",
            "megatron.core.distributed", "megatron_cispo.runner.distributed"]


class RankFailed(RuntimeError):
    """A worker rank raised, exited or timed out; the message carries its traceback."""


def _entry(fn, args, rank, world_size, port, env, out):
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **env})
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(*args)
        out.put(("ok", rank, pickle.dumps(result)))  # plain pickle: no shared-memory fds
    except BaseException:  # noqa: BLE001 - forwarded to the parent verbatim
        out.put(("err", rank, traceback.format_exc()))
    finally:
        from megatron_cispo.runner import distributed

        try:
            distributed.shutdown()
        except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
            pass


def spawn(fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = 300,
          env: dict[str, str] | None = None) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks; return the per-rank results in rank order."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, args, r, world_size, port, env or {}, out), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            try:
                kind, rank, payload = out.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RankFailed(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                     "before reporting a result")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise RankFailed(f"timed out after {timeout_s:.0f}s; ranks {missing} never reported")
                continue
            if kind == "err":
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]
