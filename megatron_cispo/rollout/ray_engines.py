"""rollout.placement: ray: each engine replica a Ray actor in an existing Ray cluster, behind the engine
protocol, so engine_pool.EnginePool drives it as it drives local child processes.

    pool = open_ray_pool(spec, lambda k: start_k, 2, address="auto", gpus_per_engine=0, on_death="stop")
    pool.update_weights(buckets, manifest=..., bucket_bytes=n)   # each bucket ray.put once, read by all actors at once
    out = pool.generate(prompts, sampling)                        # actor k samples its share

The replicas sit in one placement group of n bundles, bundle k holding replica k (bundles()). On a GPU
cluster a bundle is {GPU: the engine's GPUs, CPU: 1}: Ray places it only on GPUs its nodes were started
with, and launch/slurm_ray.sbatch starts Ray with the GPUs torchrun's trainer does not use, so no engine
lands on a trainer's GPU. On CPU a bundle is {CPU: 1}. An actor runs the engine exactly as local placement
does (vLLM in a child process of the actor, which dies with it). Every call is waited for at most the
engine's call timeout: a dead or hung actor is one ReplicaError line, never a hang. ray is imported only
when a pool opens; --check refuses placement: ray without ray or without a cluster (placement_problem).
"""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from .child import cause
from .engine import push_in_parts
from .engine_pool import EnginePool, host_copy

EXTRA = "pip install 'megatron_cispo[ray]'"
CPUS_PER_ENGINE = 1  # the actor's own CPU; vLLM's work runs in its child, on the bundle's GPUs (or CPU threads)
CONNECT_TIMEOUT_S = 5.0  # --check's probe of the head's port: a cluster answers at once or not at all
_ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")  # where `ray start --head` writes the address it serves


class ReplicaError(RuntimeError):
    """A Ray replica failed; the message is one line: which call, the cause."""


def ray_missing() -> Optional[str]:
    """None when ray is importable in this python (checked without importing it), else one line."""
    if importlib.util.find_spec("ray") is not None:
        return None
    return f"rollout.placement=ray needs Ray, which this python cannot import: {EXTRA} (RAY=1 bash launch/setup_env.sh)"


def resolve_address(address: str) -> Optional[str]:
    """rollout.ray_address as host:port: "auto" = $RAY_ADDRESS, else the cluster `ray start --head` started on
    this node (its address file); None when auto finds none. A "ray://" address (Ray Client) is refused."""
    if address.startswith("ray://"):
        raise ValueError(f"rollout.ray_address={address!r}: Ray Client addresses are not supported (the actors read "
                         "the weights from the object store the trainer writes): give the head's host:port")
    if address != "auto":
        return address
    found = os.environ.get("RAY_ADDRESS") or (_ADDRESS_FILE.read_text().strip() if _ADDRESS_FILE.is_file() else "")
    return found or None


def placement_problem(rollout) -> Optional[str]:
    """rollout.placement=ray's refusals at --check, one line: ray not installed, no Ray cluster at the address
    (a TCP connect to the head's port, without importing ray). None for local placement or when all is well."""
    if rollout.placement != "ray":
        return None
    missing = ray_missing()
    if missing:
        return missing
    try:
        address = resolve_address(rollout.ray_address)
    except ValueError as e:
        return str(e)
    if address is None:
        return ("rollout.placement=ray: no Ray cluster found for rollout.ray_address=auto ($RAY_ADDRESS is unset and "
                f"no `ray start --head` ran on this node); start one or set rollout.ray_address=HOST:PORT")
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        return (f"rollout.placement=ray: no Ray cluster answers at {address} (rollout.ray_address="
                f"{rollout.ray_address}): {cause(e)}; start its head there (ray start --head) or fix the address")
    return None


def bundles(n: int, gpus_per_engine: int) -> list[dict]:
    """The placement group's bundles, one per replica: {"GPU": gpus_per_engine, "CPU": 1} on GPU (the
    engine's tensor_parallel_size; one bundle is one node, so a replica's GPUs share it), {"CPU": 1} on CPU."""
    if n < 1 or gpus_per_engine < 0:
        raise ValueError(f"bundles: n >= 1 replicas and gpus_per_engine >= 0, got {n} and {gpus_per_engine}")
    one = {"CPU": float(CPUS_PER_ENGINE)}
    if gpus_per_engine:
        one["GPU"] = float(gpus_per_engine)
    return [dict(one) for _ in range(n)]


def _line(err: BaseException) -> str:
    """Ray's multi-line errors as one line: the last line that names an error, else the first, without the
    list of common causes Ray appends to an actor's death."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    named = [ln for ln in lines if "Error" in ln and not ln.startswith(("Traceback", "File "))]
    text = (named or lines or [""])[-1].split(" Some common causes")[0]
    return f"{type(err).__name__}: {text}"[:300]


class EngineHost:
    """The actor: one engine, opened from its spec in the actor's process. Each call answers
    ("ok", value) or ("error", one line, whether the engine is still alive)."""

    def __init__(self, spec, start):
        t0 = time.perf_counter()
        self.engine = spec.open(start)
        self.start_seconds = time.perf_counter() - t0

    def started(self) -> float:
        return self.start_seconds

    def call(self, method: str, *args):
        try:
            return "ok", getattr(self.engine, method)(*args)
        except Exception as e:  # noqa: BLE001 - answered as a line; the trainer decides
            alive = getattr(self.engine, "alive", None)
            return "error", cause(e), bool(alive()) if alive is not None else True

    def close(self) -> None:
        self.engine.close()


class RayEngine:
    """Replica k: an EngineHost actor in bundle k of `pg`. The engine protocol, every call waited for at
    most its timeout; the actor's death or a timeout kills it and raises ReplicaError (alive() false)."""

    def __init__(self, ray, pg, k: int, spec, start, bundle: dict):
        """Starts the actor and returns at once: wait_started() waits for its engine (several start together)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray, self.k = ray, k
        self.call_timeout_s, self.start_timeout_s = start.call_timeout_s, start.start_timeout_s
        self._alive, self.start_seconds = True, 0.0
        host = ray.remote(EngineHost).options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k))
        self.actor = host.remote(spec, start)
        self._started = self.actor.started.remote()

    def wait_started(self) -> "RayEngine":
        """Wait until the engine in the actor has started (its start timeout at most); ReplicaError if not."""
        self.start_seconds = self._wait(self._started, "starting", self.start_timeout_s, plain=True)
        return self

    def alive(self) -> bool:
        return self.actor is not None and self._alive

    def _wait(self, ref, what: str, timeout_s: float, plain: bool = False):
        ray = self._ray
        try:
            got = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.kill()
            raise ReplicaError(f"Ray replica {self.k}: {what} took more than {timeout_s:.0f} s; killed it") from None
        except ray.exceptions.RayError as e:
            self.kill()
            raise ReplicaError(f"Ray replica {self.k}: its actor died while {what}: {_line(e)}") from None
        if plain:
            return got
        if got[0] == "error":
            self._alive = got[2]
            raise ReplicaError(f"Ray replica {self.k}: {what} failed: {got[1]}")
        return got[1]

    def _call(self, method: str, what: str, *args):
        if self.actor is None:
            raise ReplicaError(f"Ray replica {self.k}: {what} on a closed replica (it failed earlier or was closed)")
        return self._wait(self.actor.call.remote(method, *args), what, self.call_timeout_s)

    def begin_update(self, manifest: dict, bucket_bytes: int) -> None:
        self._call("begin_update", "starting a weight update", manifest, bucket_bytes)

    def add_bucket(self, bucket, index: int = 0):
        """bucket: an ObjectRef (the pool's ray.put, resolved in the actor) or a bucket."""
        return self._call("add_bucket", f"receiving weight bucket {index}", bucket, index)

    def finish_update(self) -> None:
        self._call("finish_update", "loading the streamed weights")

    def abort_update(self) -> None:
        if self.actor is not None:
            self._call("abort_update", "aborting a weight update")

    def update_weights(self, buckets, *, manifest: dict, bucket_bytes: int) -> dict:
        """The protocol's one-call push (the pool uses the parts): every bucket, all or nothing."""
        return push_in_parts(self, buckets, manifest=manifest, bucket_bytes=bucket_bytes,
                             stage=lambda bucket: self._ray.put(host_copy(bucket)))

    def generate(self, prompts, sampling):
        return self._call("generate", f"generating {len(prompts)} prompts x {sampling.n}", prompts, sampling)

    def kill(self) -> None:
        """End the actor (and its engine's process) from any thread; a call waiting on it raises."""
        actor, self._alive = self.actor, False
        if actor is not None:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def close(self) -> None:
        actor, self.actor = self.actor, None
        if actor is None:
            return
        try:
            self._ray.get(actor.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - a dead or stuck actor is killed below either way
            pass
        self._ray.kill(actor, no_restart=True)
        self._alive = False


def open_ray_pool(spec, start_of: Callable[[int], object], n: int, *, address: str, gpus_per_engine: int,
                  on_death: str = "stop", timeout_s: float = 900.0):
    """Connect to the Ray cluster at `address` (rollout.ray_address), reserve n bundles (bundles()) and start
    replica k as an actor on start_of(k) in bundle k, all at once (unlike local replicas, which start one
    after another); an EnginePool over them whose buckets go to the object store once each (ray.put) and
    whose close removes the placement group and disconnects (when this call connected)."""
    missing = ray_missing()
    if missing:
        raise RuntimeError(missing)
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    resolved = resolve_address(address)
    if resolved is None:
        raise RuntimeError(f"rollout.placement=ray: no Ray cluster found for rollout.ray_address={address}")
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    owned = not ray.is_initialized()  # a process already connected (its own driver) stays connected at close
    try:
        ray.init(address=resolved, ignore_reinit_error=True, log_to_driver=False, logging_level="WARNING")
    except Exception as e:  # noqa: BLE001 - ConnectionError, a version mismatch, ...: one line naming the address
        raise RuntimeError(f"rollout.placement=ray: cannot join the Ray cluster at {resolved}: {_line(e)}") from None
    finally:
        if main:  # ray.init makes SIGTERM a bare sys.exit; the run's own handler (runner/preempt.py) checkpoints
            signal.signal(signal.SIGTERM, sigterm)
    want = bundles(n, gpus_per_engine)
    pg = placement_group(want, strategy="PACK")

    def after_close() -> None:
        remove_placement_group(pg)
        if owned:
            ray.shutdown()  # this driver's connection; the cluster runs on

    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        said = (f"rollout.placement=ray: the Ray cluster at {resolved} could not place {n} engine bundles {want[0]} "
                f"within {timeout_s:.0f} s; it has {ray.cluster_resources()}")
        after_close()
        raise RuntimeError(said) from None

    def stage(bucket):
        return ray.put(host_copy(bucket))  # once per bucket, every actor reads the same object

    def open_one(k: int) -> RayEngine:  # a restart: bundle k is free again once the dead actor is gone
        return RayEngine(ray, pg, k, spec, start_of(k), want[k]).wait_started()

    engines = [RayEngine(ray, pg, k, spec, start_of(k), want[k]) for k in range(n)]  # they start at once
    for e in engines:
        try:
            e.wait_started()
        except Exception as err:
            for other in engines:
                other.close()
            after_close()
            raise RuntimeError(f"engine replica {e.k}: {err}") from err
    return EnginePool(engines, reopen=open_one, on_death=on_death, stage=stage, after_close=after_close)
