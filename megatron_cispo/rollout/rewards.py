"""The user's reward function, named by `data.reward: "module:function"` or "path/to/file.py:function",
called as fn(record, completion, token_ids) (or fn(record, completion)) and returning a number. A
function with a parameter named `finish_reason` is also given how the sample ended: "stop" (at an EOS
or stop token, the last of token_ids) or "length" (cut at rollout.max_new_tokens), None when unknown.
The completion is decoded without special tokens, so its text cannot show whether the sample ended.

    runner = RewardRunner("megatron_cispo.rollout.arith:exact_match", timeout_s=10.0, workers=1)
    result = runner.score(records, completions, token_ids, finish_reasons=reasons, budget_s=60)   # None where it failed
    runner.close()

The function runs in worker processes (reward_worker.py; `workers` of them score samples at the
same time, each started once and restarted after a timeout or a crash), not under SIGALRM in the
trainer: a timer cannot interrupt C code that holds the GIL, needs the main thread and would share
the process's signal state with runner/preempt.py
(and with rewards such as math-verify that set their own alarm); a process can always be killed,
so a timeout really stops waiting, and a crash or os._exit in the reward cannot end the run. The
cost: records, completions and results are pickled over a pipe (tens of microseconds a sample), the
module is imported twice (here, to check the spec, and in the worker), and each timeout restarts
the worker (its import time, outside the per-sample timeout, inside the call's budget). Not
thread-safe: one caller at a time.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .child import cause, recv, send, start

_MISSING = object()
_WORKER = "megatron_cispo.rollout.reward_worker"
START_TIMEOUT_S = 300.0  # the worker's import of the reward module (torch, sympy, ...) on a loaded machine


def load_reward(spec: str) -> Callable:
    """The function of `spec` as fn(record, completion, token_ids, finish_reason): a function without a
    finish_reason parameter, or of 2 arguments, is wrapped. A file path is resolved against the CWD.
    ValueError, one line, for a spec that cannot be used."""
    where = f"data.reward={spec!r}"
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"{where}: expected 'package.module:function' or 'path/to/file.py:function'")
    if target.endswith(".py") and not Path(target).is_file():
        raise ValueError(f"{where}: no such file {Path(target).absolute()}")
    try:
        module = _import(target)
    except ModuleNotFoundError as e:
        raise ValueError(f"{where}: module not found ({e}); is it installed or on PYTHONPATH?") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing: say so in one line
        raise ValueError(f"{where}: importing it raised {cause(e)}") from None
    fn = getattr(module, name, _MISSING)
    if fn is _MISSING:
        raise ValueError(f"{where}: {target} has no attribute {name!r}")
    if not callable(fn):
        raise ValueError(f"{where}: {name} has type {type(fn).__name__}, which is not callable")
    if _takes(fn, 3, finish_reason=None):
        return functools.wraps(fn)(lambda record, completion, token_ids, finish_reason:
                                   fn(record, completion, token_ids, finish_reason=finish_reason))
    if _takes(fn, 3):
        return functools.wraps(fn)(lambda record, completion, token_ids, finish_reason: fn(record, completion, token_ids))
    if _takes(fn, 2):
        return functools.wraps(fn)(lambda record, completion, token_ids, finish_reason: fn(record, completion))
    raise ValueError(f"{where}: {name}{inspect.signature(fn)} cannot be called as fn(record, completion, "
                     f"token_ids) or fn(record, completion)")


def _takes(fn, n: int, **named) -> bool:
    """Whether fn accepts n positional arguments and the `named` keywords by name (not through **kwargs);
    a builtin without a signature is assumed to take the positional ones, and no names."""
    try:
        sig = inspect.signature(fn)
    except ValueError:
        return not named
    if any(name not in sig.parameters or sig.parameters[name].kind in
           (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_KEYWORD) for name in named):
        return False
    try:
        sig.bind(*range(n), **named)
    except TypeError:
        return False
    return True


def _import(target: str):
    if not target.endswith(".py"):
        return importlib.import_module(target)
    path = Path(target).absolute()
    spec = importlib.util.spec_from_file_location(f"_megatron_cispo_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class RewardResult:
    rewards: list[float | None]  # None where the reward failed (masked out of the loss)
    errors: int                   # the function raised (or the worker died)
    timeouts: int                 # past timeout_s (the worker was killed)
    budget_cut: int               # not scored within the call's budget_s: stopped by it, or never started
    non_numbers: int              # it returned something other than a finite number (bool counts: 1.0 / 0.0)
    first_failure: str | None     # one line: the function, the sample and the cause


class RewardRunner:
    """Scores completions with the function of `spec`, each call limited to `timeout_s` seconds, on
    `workers` worker processes at once (data.reward_workers): samples go to whichever is free, so N
    workers score a step in about 1/N of one worker's time when the reward, not the pipe, is slow."""

    def __init__(self, spec: str, *, timeout_s: float, workers: int = 1):
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"reward timeout_s={timeout_s!r}: expected a finite number of seconds > 0")
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"reward workers={workers!r}: expected an integer >= 1")
        load_reward(spec)  # refuse a bad spec here, in one line, before the workers exist
        target, _, name = spec.rpartition(":")
        self.spec = f"{Path(target).absolute()}:{name}" if target.endswith(".py") else spec
        self.timeout_s = float(timeout_s)
        self._slots: list[_Worker] = []
        try:
            for _ in range(workers):
                self._slots.append(_Worker(self.spec, self.timeout_s))
            for slot in self._slots:  # all import the reward at once; each waits for its own
                slot.ready()
        except BaseException:
            self.close()
            raise

    def score(self, records: list[dict], completions: list[str], token_ids: list[list[int]], *,
              finish_reasons: list[str | None] | None = None, budget_s: float | None = None) -> RewardResult:
        """One reward per sample, each call limited to timeout_s and the whole call to budget_s seconds
        (None: no limit; the trainer's other ranks wait in a collective meanwhile). Samples not scored
        within the budget (stopped by it, or never started) are counted in budget_cut. finish_reasons:
        per sample "stop" or "length" (None: unknown), for a reward that takes finish_reason."""
        reasons = [None] * len(records) if finish_reasons is None else list(finish_reasons)
        if not len(records) == len(completions) == len(token_ids) == len(reasons):
            raise ValueError(f"score: {len(records)} records, {len(completions)} completions, {len(token_ids)} "
                             f"token lists and {len(reasons)} finish reasons; expected one of each per sample")
        if budget_s is not None and not (isinstance(budget_s, (int, float)) and 0 <= budget_s < math.inf):
            raise ValueError(f"score: budget_s={budget_s!r}: expected None or a finite number of seconds >= 0")
        end = math.inf if budget_s is None else time.monotonic() + budget_s
        spent = f"the step's reward budget of {budget_s:g} s was spent" if budget_s is not None else ""
        samples = list(zip(records, completions, [list(map(int, t)) for t in token_ids], reasons))
        outcomes: list[tuple[str, object]] = [("error", "not scored")] * len(samples)
        todo = iter(range(len(samples)))
        lock = threading.Lock()

        def drain(slot: _Worker) -> None:  # one thread per worker: the next sample not yet taken, until none
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                outcomes[i] = (("budget", f"not scored: {spent}") if time.monotonic() >= end
                               else slot.one(samples[i], end, spent))

        if len(self._slots) == 1 or len(samples) <= 1:
            drain(self._slots[0])
        else:
            threads = [threading.Thread(target=drain, args=(slot,), daemon=True) for slot in self._slots]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        res = RewardResult(rewards=[], errors=0, timeouts=0, budget_cut=0, non_numbers=0, first_failure=None)
        for i, (kind, detail) in enumerate(outcomes):
            if kind == "ok":
                res.rewards.append(detail)
                continue
            res.rewards.append(None)
            res.errors += kind == "error"
            res.timeouts += kind == "timeout"
            res.budget_cut += kind == "budget"
            res.non_numbers += kind == "non_number"
            if res.first_failure is None:
                res.first_failure = f"reward {self.spec} on sample {i} (record {repr(samples[i][0])[:80]}): {detail}"
        return res

    def close(self) -> None:
        """End the workers (they also end when this process does: PR_SET_PDEATHSIG)."""
        for slot in getattr(self, "_slots", []):
            slot.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        for slot in getattr(self, "_slots", []):
            if slot.proc is not None:
                slot.stop()


class _Worker:
    """One reward worker process: started at once, restarted after a timeout or a crash."""

    def __init__(self, spec: str, timeout_s: float):
        self.spec, self.timeout_s = spec, timeout_s
        self.proc: subprocess.Popen | None = None
        self.spawn()

    def spawn(self) -> None:
        """Start the worker process (it loads the spec; ready() waits for that)."""
        self.proc = start(_WORKER, (self.spec, list(sys.path)))

    def ready(self, end: float = math.inf) -> None:
        """Wait until the worker has loaded the spec: ValueError when it fails (or takes START_TIMEOUT_S),
        TimeoutError (the worker killed) when time.monotonic() passes `end` first."""
        limit = time.monotonic() + START_TIMEOUT_S
        try:
            kind, detail = recv(self.proc.stdout.fileno(), min(limit, end))
        except (TimeoutError, EOFError) as e:
            if isinstance(e, TimeoutError) and end < limit:
                self.stop()
                raise
            kind, detail = "error", f"the worker did not start within {START_TIMEOUT_S:.0f} s or exited"
        if kind != "ready":
            self.close()
            raise ValueError(f"data.reward={self.spec!r}: in the reward worker, {detail}")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def one(self, sample, end: float, spent: str) -> tuple[str, object]:
        """The worker's (kind, value) for one sample, waiting until its timeout or `end`, whichever
        comes first; (re)starts the worker first when needed."""
        t0, by_budget = time.monotonic(), True  # a start times out only at `end`
        try:
            if self.proc is None:
                self.spawn()
                self.ready(end)
            deadline = time.monotonic() + self.timeout_s
            by_budget = end < deadline
            send(self.proc.stdin, sample)
            return recv(self.proc.stdout.fileno(), min(deadline, end))
        except TimeoutError:
            if self.proc is not None:
                self.stop()
            if by_budget:
                return "budget", f"stopped after {time.monotonic() - t0:.1f} s: {spent}"
            return "timeout", f"timed out after {self.timeout_s:g} s"
        except (EOFError, BrokenPipeError, ValueError) as e:
            code = self.proc.wait() if self.proc is not None else None
            self.proc = None
            return "error", f"the reward worker exited (code {code})" if code is not None else str(e)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
