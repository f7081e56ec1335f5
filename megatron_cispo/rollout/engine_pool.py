"""rollout.engines: N replicas of an engine behind the one protocol (engine.py): every weight push reaches
all of them, each step's prompts are split across them.

    pool = open_pool(lambda k: open_engine(start_k), 2, on_death="restart")   # local child processes
    pool.update_weights(buckets, manifest=..., bucket_bytes=n)   # each bucket to every replica at once, all or nothing
    out = pool.generate(prompts, sampling)                       # replica k samples its share, in parallel

A push begins an update on every replica, hands each bucket to all of them at once and finishes them all,
each step on the pool's threads (one per replica; they only call replicas, never start one) and waiting
for every replica, so N replicas take about one's time. The stream is read once, in the calling thread,
bucket i+1 once every replica has loaded bucket i (its memory is reused); `stage` makes a bucket shareable
once for all of them (Ray's ray.put, ray_engines.py). A failing replica or stream aborts the update on
every replica, once none is mid-call, so none is left on a mix.
generate() gives replica k a contiguous share of the prompts with their own seeds (sample j of prompt i
is keyed by seeds[i] + j wherever it runs), so the batch is the one a single engine makes, and runs the
shares on the same threads (each replica is its own process; the calls wait on pipes or on Ray).

A replica that fails or dies (rollout.on_engine_death):
  stop    the call fails with the replica's own one-line error, naming it: the run stops there.
  restart a dead replica is replaced by a fresh one (opened in the calling thread). With other replicas,
          the fresh one joins at the next complete push and until then the others generate its share (the
          dead one's share of a generation is retried on them: the same samples, keyed by their seeds), so
          nothing is kept. A pool of one keeps the last complete push's staged buckets (a host copy of the
          weights, or Ray's object refs) and gives them to its fresh replica before retrying. A second failure
          of the same call, every replica dead at once, or a replica that refused a call but lives (a fresh
          one would refuse it too) stops the run.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Literal, Optional

from ..base.console import say
from .engine import Completion, Sampling

OnDeath = Literal["stop", "restart"]


def open_pool(open_one, n: int, **kw) -> "EnginePool":
    """n replicas, open_one(k) -> replica k, started one after another in the calling thread: a replica's
    process gets SIGKILL when the thread that started it ends (child.py's parent-death signal follows the
    thread), so no short-lived thread may start one. If one fails to start, the others are closed.
    kw: EnginePool's (on_death, stage, after_close); open_one also restarts a replica."""
    engines = []
    try:
        for k in range(n):
            engines.append(open_one(k))
    except Exception as err:
        for e in engines:
            e.close()
        if kw.get("after_close"):
            kw["after_close"]()
        raise RuntimeError(f"engine replica {len(engines)}: {err}") from err
    return EnginePool(engines, reopen=open_one, **kw)


def host_copy(bucket):
    """A bucket whose bytes outlive the stream (its data is reused for the next bucket): on the host."""
    return dataclasses.replace(bucket, data=bucket.data.detach().to("cpu", copy=True))


def _alive(engine) -> bool:
    """Whether a replica that raised can still serve (an engine without alive() is taken as dead)."""
    alive = getattr(engine, "alive", None)
    return bool(alive()) if alive is not None else False


class EnginePool:
    def __init__(self, engines: list, *, reopen: Optional[Callable[[int], object]] = None, on_death: OnDeath = "stop",
                 stage: Optional[Callable] = None, after_close: Optional[Callable[[], None]] = None):
        """reopen(k): a fresh replica k (on_death=restart). stage(bucket) -> what every replica's add_bucket
        gets (default: the bucket itself; a pool of one with restart: a host copy, kept until the next push).
        after_close: run once after the replicas are closed (Ray: the placement group removed)."""
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        if on_death not in ("stop", "restart"):
            raise ValueError(f"on_death must be 'stop' or 'restart', got {on_death!r}")
        if on_death == "restart" and reopen is None:
            raise ValueError("on_death='restart' needs reopen(k), which opens a fresh replica k")
        self.engines = list(engines)
        self.served = [0] * len(self.engines)  # prompts each replica has generated, for the metrics
        self.restarts = [0] * len(self.engines)  # fresh replicas started in place of dead ones
        self.start_seconds = sum(getattr(e, "start_seconds", 0.0) for e in self.engines)
        self.on_death, self._reopen, self._after_close = on_death, reopen, after_close
        self._keeps = on_death == "restart" and len(self.engines) == 1  # no other replica can stand in for it
        self._stage = stage or (host_copy if self._keeps else (lambda b: b))
        self._last: Optional[tuple] = None  # a pool of one, restart: (manifest, bucket_bytes, staged buckets)
        self._ready = [True] * len(self.engines)  # on the last complete push (a fresh replica: at the next one)
        self._threads = ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="cispo-engine")

    def update_weights(self, buckets: Iterable, *, manifest: dict, bucket_bytes: int) -> dict:
        t0, nbytes, count = time.perf_counter(), 0, 0
        dead: dict[int, Exception] = {}  # restart: replicas that died in this push, replaced after it
        keep = [] if self._keeps else None

        def each(call) -> None:
            """call(e) on every replica still in this push, at once; returns when all have answered (so none
            is mid-call when the update is aborted), raising the first replica's failure that stops it."""
            jobs = [(k, e, self._threads.submit(call, e)) for k, e in enumerate(self.engines) if k not in dead]
            failed = None  # (k, its error): the first replica, in order, whose failure stops the push
            for k, e, job in jobs:
                err = job.exception()  # waits for replica k
                if err is None:
                    continue
                if self.on_death == "restart" and not _alive(e):
                    dead[k] = err
                elif failed is None:
                    failed = (k, err)
            if failed is not None:
                raise RuntimeError(f"engine replica {failed[0]}: {failed[1]}") from failed[1]

        try:
            each(lambda e: e.begin_update(manifest, bucket_bytes))
            for bucket in buckets:
                item = self._stage(bucket)
                if keep is not None:
                    keep.append(item)
                each(lambda e: e.add_bucket(item, count))
                nbytes, count = nbytes + bucket.data.numel(), count + 1
            each(lambda e: e.finish_update())
        except BaseException:  # a replica's failure (named by each()) or the stream's own, raised as it is
            for e in self.engines:  # the replicas not finished keep their previous weights
                try:
                    e.abort_update()
                except Exception:  # noqa: BLE001 - a dead replica: its own error is the one to report
                    pass
            raise
        if len(dead) == len(self.engines) > 1:
            k, err = next(iter(dead.items()))
            raise RuntimeError(f"engine replica {k}: every replica died in a weight push ({err})") from err
        if keep is not None:
            self._last = (manifest, bucket_bytes, keep)
        self._ready = [k not in dead for k in range(len(self.engines))]
        for k, err in dead.items():  # a pool of one: the fresh replica gets this push, now complete
            self._restart(k, err, "a weight push")
        return {"sync/seconds": time.perf_counter() - t0, "sync/bytes": float(nbytes), "sync/buckets": float(count)}

    @staticmethod
    def split(indices: list[int], replicas: list[int]) -> list[tuple[int, list[int]]]:
        """(replica, its contiguous part of `indices`) for each replica, as even as they allow (the first get one
        more); replicas with nothing to do are left out."""
        k, extra = divmod(len(indices), len(replicas))
        out, at = [], 0
        for i, r in enumerate(replicas):
            size = k + (i < extra)
            if size:
                out.append((r, indices[at:at + size]))
            at += size
        return out

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        """Each replica on the current weights generates its share at once; with restart, the share of one
        that died is retried (module docstring)."""
        out: list = [None] * len(prompts)
        ready = [k for k, on in enumerate(self._ready) if on]
        if not ready:  # every replica died in the last push, which raised then: nothing to sample with
            raise RuntimeError("no engine replica holds the current weights")
        failed = self._run(self.split(list(range(len(prompts))), ready), prompts, sampling, out)
        if not failed:
            return out
        for k, share, err in failed:
            if self.on_death != "restart" or _alive(self.engines[k]):
                raise RuntimeError(f"engine replica {k}: {err}") from err
        lost = [j for _, share, _ in failed for j in share]
        for k, share, err in failed:
            self._restart(k, err, f"generating {len(share)} prompts")
        stand_in = [k for k, on in enumerate(self._ready) if on]  # the survivors, or a pool of one's fresh replica
        if not stand_in:
            raise RuntimeError(f"engine replica {failed[0][0]}: every replica died generating ({failed[0][2]}); none "
                               "holds the current weights to retry their prompts")
        again = self._run(self.split(lost, stand_in), prompts, sampling, out)
        if again:
            k, share, err = again[0]
            raise RuntimeError(f"engine replica {k}: its retry of {len(share)} prompts after replica "
                               f"{failed[0][0]} died failed too: {err}") from err
        return out

    def _run(self, parts: list[tuple[int, list[int]]], prompts, sampling: Sampling, out: list) -> list[tuple]:
        """Replica k generates prompts `share` for each (k, share) in parts, all at once; their completions go to
        out[j]. Returns the failures, [(k, share, error)], in replica order."""
        jobs = []
        for k, share in parts:
            part = dataclasses.replace(sampling, seeds=[sampling.seeds[j] for j in share])
            jobs.append((k, share, self._threads.submit(self.engines[k].generate, [prompts[j] for j in share], part)))
        failed = []
        for k, share, job in jobs:
            try:
                got = job.result()
            except Exception as err:  # noqa: BLE001 - judged by the caller, after every share has answered
                failed.append((k, share, err))
                continue
            self.served[k] += len(share)
            for j, completions in zip(share, got):
                out[j] = completions
        return failed

    def _restart(self, k: int, err: Exception, what: str) -> None:
        """rollout.on_engine_death=restart: replica k died in `what`; a fresh one in its place, on the last
        complete push in a pool of one, else waiting for the next push (not ready until then)."""
        joins = "on the current weights" if self._keeps else "it rejoins at the next weight push, the other replicas " \
            "taking its prompts until then"
        say(f"engine replica {k} died in {what} ({err}); restarting it: {joins} (rollout.on_engine_death: restart)")
        self._ready[k] = False
        try:
            self.engines[k].close()
        except Exception:  # noqa: BLE001 - it is dead; what matters is the fresh one
            pass
        try:
            fresh = self._reopen(k)
            self.engines[k] = fresh
            if self._last is not None:
                manifest, bucket_bytes, staged = self._last
                fresh.begin_update(manifest, bucket_bytes)
                for i, item in enumerate(staged):
                    fresh.add_bucket(item, i)
                fresh.finish_update()
                self._ready[k] = True
        except Exception as again:
            raise RuntimeError(f"engine replica {k}: died ({err}) and its restart failed: {again}") from again
        self.restarts[k] += 1

    def info(self) -> dict:
        """rollout/engine<k>_prompts: the prompts each replica has served so far; rollout/engine_restarts:
        the replicas restarted so far (rollout.on_engine_death: restart)."""
        out = {f"rollout/engine{i}_prompts": float(n) for i, n in enumerate(self.served)}
        out["rollout/engine_restarts"] = float(sum(self.restarts))
        return out

    def kill(self) -> None:
        for e in self.engines:
            e.kill()

    def close(self) -> None:
        for e in self.engines:
            e.close()
        self._threads.shutdown(wait=False)
        after, self._after_close = self._after_close, None
        if after is not None:
            after()
