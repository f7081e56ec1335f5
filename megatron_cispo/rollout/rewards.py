"""The user's reward function, named by `data.reward: "module:function"` or "path/to/file.py:function",
called as fn(record, completion, token_ids) (or fn(record, completion)) and returning a number. A
function with a parameter named `finish_reason` is also given how the sample ended: "stop" (at an EOS
or stop token, the last of token_ids) or "length" (cut at rollout.max_new_tokens), None when unknown.
The completion is decoded without special tokens, so its text cannot show whether the sample ended.

    runner = RewardRunner("megatron_cispo.rollout.arith:exact_match", timeout_s=10.0)
    result = runner.score(records, completions, token_ids, finish_reasons=reasons, budget_s=60)   # None where it failed
    runner.close()

The function runs in a worker process (reward_worker.py, started once, restarted after a
timeout or a crash), not under SIGALRM in the trainer: a timer cannot interrupt C code that holds
the GIL, needs the main thread and would share the process's signal state with runner/preempt.py
(and with rewards such as math-verify that set their own alarm); a process can always be killed,
so a timeout really stops waiting, and a crash or os._exit in the reward cannot end the run. The
cost: records, completions and results are pickled over a pipe (tens of microseconds a sample), the
module is imported twice (here, to check the spec, and in the worker), and each timeout restarts
the worker (its import time, outside the per-sample timeout, inside the call's budget). Not thread-safe: one caller at a time.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import subprocess
import sys
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
    timeouts: int                 # past timeout_s (the worker was killed) or past the call's budget_s
    non_numbers: int              # it returned something other than a finite number (bool counts: 1.0 / 0.0)
    first_failure: str | None     # one line: the function, the sample and the cause


class RewardRunner:
    """Scores completions with the function of `spec`, each call limited to `timeout_s` seconds."""

    def __init__(self, spec: str, *, timeout_s: float):
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"reward timeout_s={timeout_s!r}: expected a finite number of seconds > 0")
        load_reward(spec)  # refuse a bad spec here, in one line, before the worker exists
        target, _, name = spec.rpartition(":")
        self.spec = f"{Path(target).absolute()}:{name}" if target.endswith(".py") else spec
        self.timeout_s = float(timeout_s)
        self._proc: subprocess.Popen | None = None
        self._start()

    def _start(self, end: float = math.inf) -> None:
        """Start the worker and wait until it has loaded the spec: ValueError when it fails (or takes
        START_TIMEOUT_S), TimeoutError (the worker killed) when time.monotonic() passes `end` first."""
        self._proc = start(_WORKER, (self.spec, list(sys.path)))
        limit = time.monotonic() + START_TIMEOUT_S
        try:
            kind, detail = recv(self._proc.stdout.fileno(), min(limit, end))
        except (TimeoutError, EOFError) as e:
            if isinstance(e, TimeoutError) and end < limit:
                self._stop()
                raise
            kind, detail = "error", f"the worker did not start within {START_TIMEOUT_S:.0f} s or exited"
        if kind != "ready":
            self.close()
            raise ValueError(f"data.reward={self.spec!r}: in the reward worker, {detail}")

    def _stop(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._proc = None

    def score(self, records: list[dict], completions: list[str], token_ids: list[list[int]], *,
              finish_reasons: list[str | None] | None = None, budget_s: float | None = None) -> RewardResult:
        """One reward per sample, each call limited to timeout_s and the whole call to budget_s seconds
        (None: no limit; the trainer's other ranks wait in a collective meanwhile). Samples not reached
        within the budget count as timeouts without calling the reward. finish_reasons: per sample
        "stop" or "length" (None: unknown), for a reward that takes finish_reason."""
        reasons = [None] * len(records) if finish_reasons is None else list(finish_reasons)
        if not len(records) == len(completions) == len(token_ids) == len(reasons):
            raise ValueError(f"score: {len(records)} records, {len(completions)} completions, {len(token_ids)} "
                             f"token lists and {len(reasons)} finish reasons; expected one of each per sample")
        if budget_s is not None and not (isinstance(budget_s, (int, float)) and 0 <= budget_s < math.inf):
            raise ValueError(f"score: budget_s={budget_s!r}: expected None or a finite number of seconds >= 0")
        end = math.inf if budget_s is None else time.monotonic() + budget_s
        spent = f"the step's reward budget of {budget_s:g} s was spent" if budget_s is not None else ""
        res = RewardResult(rewards=[], errors=0, timeouts=0, non_numbers=0, first_failure=None)
        for i, sample in enumerate(zip(records, completions, [list(map(int, t)) for t in token_ids], reasons)):
            if time.monotonic() >= end:
                kind, detail = "timeout", f"not scored: {spent}"
            else:
                kind, detail = self._one(sample, end, spent)
            if kind == "ok":
                res.rewards.append(detail)
                continue
            res.rewards.append(None)
            res.errors += kind == "error"
            res.timeouts += kind == "timeout"
            res.non_numbers += kind == "non_number"
            if res.first_failure is None:
                res.first_failure = f"reward {self.spec} on sample {i} (record {repr(sample[0])[:80]}): {detail}"
        return res

    def _one(self, sample, end: float, spent: str) -> tuple[str, object]:
        """The worker's (kind, value) for one sample, waiting until its timeout or `end`, whichever
        comes first; (re)starts the worker first when needed."""
        t0, by_budget = time.monotonic(), True  # a start times out only at `end`
        try:
            if self._proc is None:
                self._start(end)
            deadline = time.monotonic() + self.timeout_s
            by_budget = end < deadline
            send(self._proc.stdin, sample)
            return recv(self._proc.stdout.fileno(), min(deadline, end))
        except TimeoutError:
            if self._proc is not None:
                self._stop()
            return "timeout", (f"stopped after {time.monotonic() - t0:.1f} s: {spent}" if by_budget else
                               f"timed out after {self.timeout_s:g} s")
        except (EOFError, BrokenPipeError, ValueError) as e:
            code = self._proc.wait() if self._proc is not None else None
            self._proc = None
            return "error", f"the reward worker exited (code {code})" if code is not None else str(e)

    def close(self) -> None:
        """End the worker (it also ends when this process does: PR_SET_PDEATHSIG)."""
        if self._proc is not None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None:
            self._stop()
