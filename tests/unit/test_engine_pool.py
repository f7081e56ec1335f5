"""rollout.engines: N (rollout/engine_pool.py) on fake replicas, and rollout.placement: ray's pure parts
(rollout/ray_engines.py: the placement group's bundles, the --check refusals), without vLLM or a Ray cluster.

A replica that dies: rollout.on_engine_death=stop fails the call in one line naming it; restart replaces it
(reopen(k)), pushes it the last complete push's buckets again, staged once, and retries its share, so the
batch is the one a healthy pool makes; a dead replica in a push is replaced after the push with that push;
a replica that refuses a call but lives, or a retry that fails again, stops the run. Each bucket is
staged once (Ray: one ray.put) however many replicas read it. A push reaches the replicas at once (slow
fakes: every replica loads bucket i together, on the pool's threads, and bucket i+1 is read after), and a
replica or stream failing in it aborts every replica once none is mid-call. tests/e2e/test_vllm_cli.py
kills a real replica's process mid-run with both settings, tests/e2e/test_ray_engines.py runs two Ray actors.
"""
import socket
import threading
import time
from typing import NamedTuple, Optional

import pytest
import torch

from megatron_cispo.rollout.engine import Completion, Sampling
from megatron_cispo.rollout.engine_pool import EnginePool, open_pool
from megatron_cispo.rollout.weight_stream import Bucket


class Fake:
    """A replica: its weights are the sum of the bytes pushed; a completion is (weights, prompt, seed)."""

    def __init__(self, k: int):
        self.k, self.weights, self.pending, self.dead, self.closed = k, None, None, False, False
        self.die_in: set = set()  # method names that kill it when called
        self.refuse: set = set()  # method names that raise while it stays alive

    def alive(self) -> bool:
        return not self.dead

    def _enter(self, name: str) -> None:
        if self.dead:
            raise RuntimeError(f"replica {self.k} is dead")
        if name in self.die_in:
            self.dead = True
            raise RuntimeError(f"process died while {name}")
        if name in self.refuse:
            raise ValueError(f"{name} refused")

    def begin_update(self, manifest, bucket_bytes):
        self._enter("begin_update")
        self.pending = 0

    def add_bucket(self, bucket, index=0):
        self._enter("add_bucket")
        self.pending += int(bucket.data.sum())

    def finish_update(self):
        self._enter("finish_update")
        self.weights, self.pending = self.pending, None

    def abort_update(self):
        self.pending = None

    def generate(self, prompts, sampling):
        self._enter("generate")
        return [[Completion([self.weights, p[0], s], [0.0] * 3, "length")] for p, s in zip(prompts, sampling.seeds)]

    def kill(self):
        self.dead = True

    def close(self):
        self.closed = True


SLOW_S = 0.2  # how long a Slow replica takes to load one bucket


class Event(NamedTuple):
    who: Optional[int]  # the replica, or None: the stream handing out a bucket
    what: object  # the bucket's index, or "abort"
    thread: str
    start: float
    end: float


class Slow(Fake):
    """A replica whose add_bucket takes SLOW_S and dies in bucket `dies_at`; its loads and aborts go to `log`."""

    def __init__(self, k: int, log: list, dies_at=None):
        super().__init__(k)
        self.log, self.dies_at = log, dies_at

    def add_bucket(self, bucket, index=0):
        start = time.perf_counter()
        time.sleep(SLOW_S)
        try:
            if index == self.dies_at:
                self.die_in.add("add_bucket")
            super().add_bucket(bucket, index)
        finally:
            self.log.append(Event(self.k, index, threading.current_thread().name, start, time.perf_counter()))

    def abort_update(self):
        now = time.perf_counter()
        self.log.append(Event(self.k, "abort", threading.current_thread().name, now, now))
        super().abort_update()


def _buckets(values):
    return [Bucket([], torch.tensor([v], dtype=torch.uint8)) for v in values]


def _pool(n=2, on_death="stop", stage=None, make=Fake):
    opened = []

    def open_one(k):
        opened.append(make(k))
        return opened[-1]

    return open_pool(open_one, n, on_death=on_death, stage=stage), opened


SAMPLING = Sampling(n=1, max_new_tokens=3, seeds=[10, 20, 30, 40])
PROMPTS = [[1], [2], [3], [4]]
HEALTHY = [[Completion([9, p[0], s], [0.0] * 3, "length")] for p, s in zip(PROMPTS, SAMPLING.seeds)]


def test_stop_fails_the_call_in_one_line_naming_the_dead_replica():
    pool, opened = _pool()
    pool.update_weights(_buckets([4, 5]), manifest={}, bucket_bytes=1)
    opened[1].die_in.add("generate")
    with pytest.raises(RuntimeError) as e:
        pool.generate(PROMPTS, SAMPLING)
    assert str(e.value) == "engine replica 1: process died while generate"
    assert len(opened) == 2  # nothing restarted


def test_restart_gives_a_dead_replica_s_share_to_the_others_and_the_fresh_one_joins_at_the_next_push(capsys):
    staged = []
    pool, opened = _pool(on_death="restart", stage=lambda b: staged.append(b) or b)
    pool.update_weights(_buckets([1, 2]), manifest={}, bucket_bytes=1)
    pool.update_weights(_buckets([4, 5]), manifest={}, bucket_bytes=1)  # the current weights: 9
    assert len(staged) == 4 and pool._last is None  # once per bucket, not per replica; nothing kept with 2 replicas
    opened[1].die_in.add("generate")
    assert pool.generate(PROMPTS, SAMPLING) == HEALTHY  # replica 0 made replica 1's samples too: the same ones
    assert len(opened) == 3 and opened[1].closed and pool.engines[1] is opened[2] and opened[2].weights is None
    assert pool.info() == {"rollout/engine0_prompts": 4.0, "rollout/engine1_prompts": 0.0,
                           "rollout/engine_restarts": 1.0}
    assert pool.generate(PROMPTS, SAMPLING) == HEALTHY and pool.served == [8, 0]  # not on any weights yet
    pool.update_weights(_buckets([4, 5]), manifest={}, bucket_bytes=1)
    assert opened[2].weights == 9 and pool.generate(PROMPTS, SAMPLING) == HEALTHY and pool.served == [10, 2]
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("engine replica 1 died in generating 2 prompts (process died")
    assert said[0].endswith("restarting it: it rejoins at the next weight push, the other replicas taking its "
                            "prompts until then (rollout.on_engine_death: restart)")


def test_restart_after_a_death_in_a_push_lets_the_others_sample_until_the_next_push():
    pool, opened = _pool(on_death="restart")
    pool.update_weights(_buckets([1, 2]), manifest={}, bucket_bytes=1)
    opened[0].die_in.add("add_bucket")
    pool.update_weights(_buckets([4, 5]), manifest={}, bucket_bytes=1)
    assert [e.weights for e in pool.engines] == [None, 9] and pool.engines[0] is opened[2]
    assert pool.generate(PROMPTS, SAMPLING) == HEALTHY and pool.served == [0, 4]
    pool.update_weights(_buckets([4, 5]), manifest={}, bucket_bytes=1)
    assert [e.weights for e in pool.engines] == [9, 9]


def test_a_pool_of_one_restarts_on_a_host_copy_of_the_last_push_since_the_stream_reuses_its_memory(capsys):
    pool, opened = _pool(n=1, on_death="restart")
    shared = torch.tensor([4], dtype=torch.uint8)
    pool.update_weights([Bucket([], shared)], manifest={}, bucket_bytes=1)
    shared.fill_(100)  # the stream's next bucket overwrites the same bytes
    opened[0].die_in.add("generate")
    assert [c[0].token_ids[0] for c in pool.generate(PROMPTS, SAMPLING)] == [4] * 4
    assert opened[1].weights == 4 and pool.served == [4] and pool.restarts == [1]
    assert "restarting it: on the current weights" in capsys.readouterr().err


class DiesSecond(Fake):
    """A replica that serves its first generation and dies in its second (a retry it was handed)."""

    def generate(self, prompts, sampling):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            self.die_in.add("generate")
        return super().generate(prompts, sampling)


@pytest.mark.parametrize("n, what, says", [
    (2, "refuse", "engine replica 1: generate refused"),  # alive: a fresh replica would refuse it too
    (2, "twice", "engine replica 0: its retry of 2 prompts after replica 1 died failed too: process died"),
    (1, "twice", "engine replica 0: its retry of 4 prompts after replica 0 died failed too: process died"),
    (2, "all", "engine replica 0: every replica died generating (process died while generate); none holds"),
])
def test_restart_still_stops_on_a_live_refusal_a_second_death_or_all_dead(n, what, says):
    pool, opened = _pool(n=n, on_death="restart", make=lambda k: DiesSecond(k) if k == 0 and n == 2 else Fake(k))
    pool.update_weights(_buckets([4, 5]), manifest={}, bucket_bytes=1)
    if what == "refuse":
        opened[1].refuse.add("generate")
    elif what == "all":
        for e in opened:
            e.die_in.add("generate")
    else:  # replica n - 1 dies; its stand-in (replica 0, or a pool of one's fresh replica) dies in the retry
        opened[-1].die_in.add("generate")
        if n == 1:
            pool._reopen = lambda k: (opened.append(Fake(k)), opened[-1].die_in.add("generate"), opened[-1])[-1]
    with pytest.raises(RuntimeError) as e:
        pool.generate(PROMPTS, SAMPLING)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_every_replica_dead_in_one_push_stops_the_push_in_one_line():
    pool, opened = _pool(on_death="restart")
    for e in opened:
        e.die_in.add("add_bucket")
    with pytest.raises(RuntimeError, match=r"^engine replica 0: every replica died in a weight push \(process died"):
        pool.update_weights(_buckets([4]), manifest={}, bucket_bytes=1)


def _read(values, log):
    """A stream of `values` that logs when it hands out each bucket."""
    for i, bucket in enumerate(_buckets(values)):
        now = time.perf_counter()
        log.append(Event(None, i, threading.current_thread().name, now, now))
        yield bucket


def test_a_push_hands_each_bucket_to_every_replica_at_once_and_reads_the_next_once_all_have_loaded_it():
    log = []
    pool, opened = _pool(make=lambda k: Slow(k, log))
    t0 = time.perf_counter()
    pool.update_weights(_read([1, 2, 3], log), manifest={}, bucket_bytes=1)
    took = time.perf_counter() - t0
    assert [r.weights for r in opened] == [6, 6]
    assert took < 5 * SLOW_S, f"2 replicas x 3 buckets took {took:.2f} s: one after another takes {6 * SLOW_S:.1f} s"
    for i in range(3):
        (read,) = [ev for ev in log if ev.who is None and ev.what == i]
        loads = [ev for ev in log if ev.who is not None and ev.what == i]
        assert read.thread == "MainThread" and sorted(ev.who for ev in loads) == [0, 1]
        assert max(ev.start for ev in loads) < min(ev.end for ev in loads), f"bucket {i}: the replicas took turns"
        assert len({ev.thread for ev in loads}) == 2 and all(ev.thread.startswith("cispo-engine") for ev in loads)
        if i:  # bucket i is read once every replica has loaded bucket i - 1
            assert read.start >= max(ev.end for ev in log if ev.who is not None and ev.what == i - 1)


@pytest.mark.parametrize("k", [0, 1])
def test_a_replica_failing_in_a_concurrent_push_aborts_every_replica_once_none_is_mid_call_and_is_named(k):
    log = []
    pool, opened = _pool(make=lambda j: Slow(j, log))
    pool.update_weights(_buckets([4, 5]), manifest={}, bucket_bytes=1)  # the previous weights: 9
    log.clear()
    opened[k].refuse.add("add_bucket")  # alive: the run stops, whatever on_engine_death says
    with pytest.raises(RuntimeError) as e:
        pool.update_weights(_buckets([1, 2, 3]), manifest={}, bucket_bytes=1)
    assert str(e.value) == f"engine replica {k}: add_bucket refused"
    assert [r.weights for r in opened] == [9, 9] and [r.pending for r in opened] == [None, None]
    loads, aborts = [ev for ev in log if ev.what != "abort"], [ev for ev in log if ev.what == "abort"]
    assert sorted((ev.who, ev.what) for ev in loads) == [(0, 0), (1, 0)]  # bucket 0 reached both, no bucket after
    assert sorted(ev.who for ev in aborts) == [0, 1]
    assert min(ev.start for ev in aborts) >= max(ev.end for ev in loads)  # aborted once neither was mid-call


def test_a_stream_failing_partway_aborts_every_replica_and_raises_its_own_error():
    pool, opened = _pool()
    pool.update_weights(_buckets([4, 5]), manifest={}, bucket_bytes=1)

    def broken():
        yield from _buckets([1])
        raise OSError("the stream broke")

    with pytest.raises(OSError, match="^the stream broke$"):
        pool.update_weights(broken(), manifest={}, bucket_bytes=1)
    assert [r.weights for r in opened] == [9, 9] and [r.pending for r in opened] == [None, None]


def test_restart_replaces_a_replica_dead_mid_push_after_the_push_in_the_calling_thread():
    log, openers = [], []
    pool, opened = _pool(on_death="restart", make=lambda k: openers.append(threading.current_thread()) or Slow(k, log))
    opened[1].dies_at = 1
    pool.update_weights(_buckets([1, 2, 3]), manifest={}, bucket_bytes=1)
    assert len(opened) == 3 and opened[1].dead and pool.engines[1] is opened[2]
    assert [r.weights for r in pool.engines] == [6, None] and pool.restarts == [0, 1]
    assert all(t is threading.main_thread() for t in openers)  # no pool thread starts a replica
    assert [ev.what for ev in log if ev.who == 0] == [0, 1, 2]  # replica 0 went on without it
    assert pool.generate(PROMPTS, SAMPLING) == [[Completion([6, p[0], s], [0.0] * 3, "length")]
                                                for p, s in zip(PROMPTS, SAMPLING.seeds)]
    assert pool.served == [4, 0]  # the fresh replica 1 waits for the next push


def test_a_pool_refuses_an_unknown_death_policy_and_restart_without_reopen():
    with pytest.raises(ValueError, match="on_death must be 'stop' or 'restart', got 'retry'"):
        EnginePool([Fake(0)], on_death="retry")
    with pytest.raises(ValueError, match="needs reopen"):
        EnginePool([Fake(0)], on_death="restart")


def test_close_closes_every_replica_then_runs_after_close_once():
    calls = []
    pool = EnginePool([Fake(0), Fake(1)], after_close=lambda: calls.append(all(e.closed for e in pool.engines)))
    pool.close()
    pool.close()
    assert calls == [True]


# -- rollout.placement: ray, without a cluster ---------------------------------------------------------------
def test_bundles_are_one_per_replica_gpus_from_the_engine_cpu_only_without_gpus():
    from megatron_cispo.rollout.ray_engines import bundles

    assert bundles(2, 0) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert bundles(3, 2) == [{"CPU": 1.0, "GPU": 2.0}] * 3
    with pytest.raises(ValueError, match="n >= 1 replicas and gpus_per_engine >= 0, got 0 and 1"):
        bundles(0, 1)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def test_placement_ray_is_refused_at_check_in_one_line_without_ray_or_without_a_cluster(monkeypatch, tmp_path):
    import importlib.util

    from megatron_cispo.rollout import ray_engines
    from megatron_cispo.runner.data import RolloutConfig

    ray = lambda address="auto": RolloutConfig(engine="vllm", placement="ray", ray_address=address)  # noqa: E731
    assert ray_engines.placement_problem(RolloutConfig(engine="vllm")) is None
    port = _closed_port()
    if importlib.util.find_spec("ray") is not None:
        said = ray_engines.placement_problem(ray(f"127.0.0.1:{port}"))
        assert said.startswith(f"rollout.placement=ray: no Ray cluster answers at 127.0.0.1:{port} ")
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        monkeypatch.setattr(ray_engines, "_ADDRESS_FILE", tmp_path / "none")
        assert "no Ray cluster found for rollout.ray_address=auto" in ray_engines.placement_problem(ray())
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        assert f"no Ray cluster answers at 127.0.0.1:{port}" in ray_engines.placement_problem(ray())
        assert "Ray Client addresses are not supported" in ray_engines.placement_problem(ray("ray://h:10001"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    said = ray_engines.placement_problem(ray(f"127.0.0.1:{port}"))
    assert said == ("rollout.placement=ray needs Ray, which this python cannot import: pip install "
                    "'megatron_cispo[ray]' (RAY=1 bash launch/setup_env.sh)")


@pytest.mark.parametrize("kw,says", [
    (dict(placement="ray", sync="disk"), "rollout.placement='ray' pushes the weights to each replica in buckets: it "
                                         "needs rollout.sync: stream, got 'disk'"),
    (dict(on_engine_death="restart", sync="disk"), "rollout.on_engine_death='restart' pushes the weights"),
])
def test_ray_placement_and_restart_need_the_streamed_push(kw, says):
    from megatron_cispo.runner.data import RolloutConfig

    with pytest.raises(ValueError) as e:
        RolloutConfig(engine="vllm", **kw)
    assert str(e.value).startswith(says)
