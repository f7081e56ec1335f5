"""rollout.engines: N replicas of an engine behind the one protocol (engine.py): every weight push reaches
all of them, each step's prompts are split across them.

    pool = EnginePool([open_engine(start_0), open_engine(start_1)])
    pool.update_weights(buckets, manifest=..., bucket_bytes=n)   # each bucket to every replica, all or nothing
    out = pool.generate(prompts, sampling)                       # replica k samples its share, in parallel

A push begins an update on every replica, hands each bucket to each in turn (the stream is read once)
and finishes them all; a stream that fails partway aborts the update everywhere, so no replica is left
on a mix. generate() gives replica k a contiguous share of the prompts with their own seeds (sample j of
prompt i is keyed by seeds[i] + j wherever it runs), so the batch is the one a single engine makes, and
runs the shares on threads (each replica is its own process; the calls wait on pipes). A replica that
fails or dies fails the call with its own one-line error, naming it: the run stops there (RolloutFailed).
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from .engine import Completion, Sampling


def open_pool(open_one, n: int) -> "EnginePool":
    """n replicas, open_one(k) -> replica k, started one after another in the calling thread: a replica's
    process gets SIGKILL when the thread that started it ends (child.py's parent-death signal follows the
    thread), so no short-lived thread may start one. If one fails to start, the others are closed."""
    engines = []
    try:
        for k in range(n):
            engines.append(open_one(k))
    except Exception as err:
        for e in engines:
            e.close()
        raise RuntimeError(f"engine replica {len(engines)}: {err}") from err
    return EnginePool(engines)


class EnginePool:
    def __init__(self, engines: list):
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = list(engines)
        self.served = [0] * len(self.engines)  # prompts each replica has generated, for the metrics
        self.start_seconds = sum(getattr(e, "start_seconds", 0.0) for e in self.engines)
        self._threads = ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="cispo-engine")

    def update_weights(self, buckets: Iterable, *, manifest: dict, bucket_bytes: int) -> dict:
        t0, nbytes, count, at = time.perf_counter(), 0, 0, None
        try:
            for at, e in enumerate(self.engines):
                e.begin_update(manifest, bucket_bytes)
            at = None  # a failure of the stream itself names no replica
            for bucket in buckets:
                for at, e in enumerate(self.engines):
                    e.add_bucket(bucket, count)
                at = None
                nbytes, count = nbytes + bucket.data.numel(), count + 1
            for at, e in enumerate(self.engines):
                e.finish_update()
        except BaseException as err:
            for e in self.engines:  # the replicas not finished keep their previous weights
                try:
                    e.abort_update()
                except Exception:  # noqa: BLE001 - a dead replica: its own error is the one to report
                    pass
            if at is None or not isinstance(err, Exception):
                raise
            raise RuntimeError(f"engine replica {at}: {err}") from err
        return {"sync/seconds": time.perf_counter() - t0, "sync/bytes": float(nbytes), "sync/buckets": float(count)}

    def shares(self, n: int) -> list[range]:
        """Contiguous prompt ranges, one per replica, as even as n allows (the first get one more)."""
        k, extra = divmod(n, len(self.engines))
        out, at = [], 0
        for i in range(len(self.engines)):
            size = k + (i < extra)
            out.append(range(at, at + size))
            at += size
        return out

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        jobs = []
        for i, share in enumerate(self.shares(len(prompts))):
            if len(share):
                part = dataclasses.replace(sampling, seeds=[sampling.seeds[j] for j in share])
                jobs.append((i, share, self._threads.submit(self.engines[i].generate, [prompts[j] for j in share], part)))
        out: list = [None] * len(prompts)
        for i, share, job in jobs:
            try:
                got = job.result()
            except Exception as err:
                raise RuntimeError(f"engine replica {i}: {err}") from err
            self.served[i] += len(share)
            for j, completions in zip(share, got):
                out[j] = completions
        return out

    def info(self) -> dict:
        """rollout/engine<k>_prompts: the prompts each replica has served so far."""
        return {f"rollout/engine{i}_prompts": float(n) for i, n in enumerate(self.served)}

    def kill(self) -> None:
        for e in self.engines:
            e.kill()

    def close(self) -> None:
        for e in self.engines:
            e.close()
        self._threads.shutdown(wait=False)
