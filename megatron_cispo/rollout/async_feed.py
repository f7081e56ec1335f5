"""rollout.mode=async on rank 0: a thread that generates the batches of the next steps while the trainer
trains this one, with the weights the engine holds when each generation starts.

    feed = AsyncFeed(generate, finish, staleness=k, policy="wait", first=start_step, last=run_steps, version=v)
    feed.weights(v + 1, load)          # main thread, after each optimizer step: load() between generations
    item, version, dropped, info = feed.take(step, timeout_s)   # main thread: the batch for `step`
    feed.close(kill)

generate(index, version) runs on the thread with the engine to itself (a lock the main thread takes for
each weight push); finish(raw) (the reward) runs after the engine is let go, so a push can land while
a batch is scored. Batch `index` is the index-th one generated (from `first`), trained at step `index`
unless batches were dropped. The lag of a batch is the trainer's step less the version that made it:

- policy "wait": batch `index` starts only once index - version <= staleness, so none lags more;
  the engine waits for newer weights (rollout/engine_wait_frac) and nothing is dropped;
- policy "drop": the engine never waits for weights: it keeps staleness + 1 batches ahead (ready or
  being made), and take() passes over a batch that lags more than staleness (counted, not trained).

The engine's and the trainer's waits are measured between two take()s (one step of the trainer).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Optional


class AsyncFeed:
    def __init__(self, generate: Callable[[int, int], Any], finish: Callable[[Any], Any], *, staleness: int,
                 policy: str, first: int, last: Optional[int], version: int, start: bool = True):
        """first: the index of the first batch (the step a run starts or resumes at); last: no batch from
        this index on (run.steps; None: until closed); version: the policy version the engine holds;
        start=False: the thread starts at start() (when the callbacks need the feed itself first)."""
        if policy not in ("wait", "drop"):
            raise ValueError(f"policy must be 'wait' or 'drop', got {policy!r}")
        self._generate, self._finish = generate, finish
        self.staleness, self.policy, self.last, self.version = staleness, policy, last, version
        self._next = first
        self._ready: deque = deque()  # (version, item, error) in the order generated
        self._making = 0              # batches being generated or scored
        self._push_waiting = False    # the main thread wants the engine: start no generation
        self._stop, self._error = False, None
        self._cond = threading.Condition()
        self._engine = threading.Lock()  # one user of the engine at a time: a generation or a push
        self._busy = False               # the thread is inside generate or finish (close may kill it)
        self._engine_wait = self._trainer_wait = 0.0
        self._since = time.monotonic()
        self._idle_since: Optional[float] = None  # when the thread began waiting (None: at work)
        self._thread = threading.Thread(target=self._run, name="cispo-async-rollouts", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        self._thread.start()

    # -- the thread -----------------------------------------------------------------------------------
    def _may_start(self) -> bool:
        if self._push_waiting or self._error is not None:
            return False
        if self.policy == "wait":
            return self._next - self.version <= self.staleness and (self.last is None or self._next < self.last)
        return len(self._ready) + self._making < self.staleness + 1

    def _run(self) -> None:
        while True:
            with self._cond:
                self._idle_since = time.monotonic()
                while not (self._stop or self._may_start()):
                    self._cond.wait()
                self._engine_wait += time.monotonic() - self._idle_since
                self._idle_since = None
                if self._stop:
                    return
                index, self._next, self._making = self._next, self._next + 1, self._making + 1
            version, item, error = self.version, None, None
            self._busy = True
            try:
                with self._engine:
                    version = self.version  # a push may have landed since the check: only fresher
                    raw = self._generate(index, version)
                item = self._finish(raw)
            except BaseException as e:  # noqa: BLE001 - handed to the trainer by take()
                error = e
            finally:
                self._busy = False
            with self._cond:
                self._ready.append((version, item, error))
                self._making -= 1
                if error is not None:
                    self._error = error
                self._cond.notify_all()
            if error is not None:
                return

    # -- the main thread ------------------------------------------------------------------------------
    def weights(self, version: int, load: Callable[[], Any]) -> tuple[Any, float]:
        """Run load() (a weight push into the engine) between two generations, then make `version` the
        engine's; (load's value, seconds waited for the engine). When load raises, no more batches are
        generated and take() raises the same error once the ready ones are taken."""
        t0 = time.monotonic()
        with self._cond:
            self._push_waiting = True
        try:
            with self._engine:
                waited = time.monotonic() - t0
                try:
                    value = load()
                except BaseException as e:
                    with self._cond:
                        self._error = self._error or e
                    raise
                with self._cond:
                    self.version = version
                    self._trainer_wait += waited
        finally:
            with self._cond:
                self._push_waiting = False
                self._cond.notify_all()
        return value, waited

    def engine(self) -> threading.Lock:
        """The engine's lock, for the thread's own finish() to generate more (a refill) with it held."""
        return self._engine

    def exclusive(self, use: Callable[[], Any]) -> Any:
        """Run use() with the engine to itself, between two generations (an evaluation); its value."""
        return self.weights(self.version, use)[0]

    def take(self, step: int, timeout_s: float):
        """The oldest ready batch that `step` may train on: (item, its version, the items passed over
        for lagging more than staleness, the step's figures). Blocks until one is ready; raises the
        thread's error, or TimeoutError after timeout_s without a batch."""
        t0 = time.monotonic()
        dropped = []
        with self._cond:
            while True:
                while not self._ready:
                    if self._error is not None and not self._making:  # a failed push: nothing will come
                        raise self._error
                    left = t0 + timeout_s - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"no rollout batch within {timeout_s:.0f} s")
                    self._cond.wait(left)
                version, item, error = self._ready.popleft()
                self._cond.notify_all()
                if error is not None:
                    raise error
                if step - version <= self.staleness:
                    break
                dropped.append(item)  # only under "drop": "wait" never starts a batch that would lag more
            now = time.monotonic()
            self._trainer_wait += now - t0
            if self._idle_since is not None:  # waiting still: count it up to now, the rest next time
                self._engine_wait += now - self._idle_since
                self._idle_since = now
            period = max(now - self._since, 1e-9)
            info = {"rollout/trainer_wait_s": self._trainer_wait, "rollout/trainer_wait_frac": self._trainer_wait / period,
                    "rollout/engine_wait_frac": min(1.0, self._engine_wait / period),
                    "rollout/dropped_batches": float(len(dropped)), "rollout/ready_batches": float(len(self._ready))}
            self._engine_wait = self._trainer_wait = 0.0
            self._since = now
        return item, version, dropped, info

    def close(self, kill: Optional[Callable[[], None]] = None, timeout_s: float = 30.0) -> None:
        """Stop generating (idempotent). A generation under way is ended by kill() (the engine's process)
        after a second, so a run's end never waits for batches it will not train."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if not self._thread.is_alive():  # never started, or done
            return
        self._thread.join(1.0)
        if self._thread.is_alive() and self._busy and kill is not None:
            kill()
        self._thread.join(timeout_s)
