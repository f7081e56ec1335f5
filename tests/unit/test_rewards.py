"""The reward runner: module and file specs, 2- and 3-argument functions, numbers and bools, every
failure counted while the run goes on, a timeout that really stops waiting; the shipped exact match."""
import os
import textwrap
import time

import pytest

from megatron_cispo.rollout import arith
from megatron_cispo.rollout.rewards import RewardRunner, load_reward

REWARDS = '''
import os, time
import numpy as np

def by_kind(record, completion, token_ids):
    kind = record["kind"]
    if kind == "raise":
        raise KeyError("no such\\nkey")
    if kind == "sleep":
        time.sleep(10)
    if kind == "sleep1":
        time.sleep(1)
        return 1.0
    if kind == "exit":
        os._exit(3)
    print("a reward that prints does not disturb the pipe")
    return {"len": len(token_ids), "str": "1.0", "nan": float("nan"), "inf": float("inf"), "none": None,
            "true": True, "false": False, "np": np.float32(0.25), "npbool": np.bool_(True),
            "int": 2, "sleep": 1.0}[kind]

def timed(record, completion, token_ids):
    t0 = time.time()
    time.sleep(record["s"])
    with open(record["log"], "a") as f:
        f.write(f"{os.getpid()} {t0} {time.time()}\\n")
    return float(record["i"])

def two(record, completion):
    return completion == record["answer"]

def four(a, b, c, d):
    return 0.0

def broken_import_is_below():
    pass

NOT_CALLABLE = 3
'''


@pytest.fixture
def rewards_py(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def _score(runner, kinds, **kw):
    return runner.score([{"kind": k} for k in kinds], ["x"] * len(kinds), [[1, 2, 3]] * len(kinds), **kw)


def test_a_file_spec_scores_numbers_bools_and_numpy_scalars(rewards_py):
    with RewardRunner(f"{rewards_py}:by_kind", timeout_s=30) as runner:
        res = _score(runner, ["len", "true", "false", "np", "npbool", "int"])
    assert res.rewards == [3.0, 1.0, 0.0, 0.25, 1.0, 2.0]
    assert (res.errors, res.timeouts, res.non_numbers, res.first_failure) == (0, 0, 0, None)


def test_a_relative_file_spec_is_resolved_against_the_cwd_at_load(rewards_py, monkeypatch, tmp_path):
    monkeypatch.chdir(rewards_py.parent)
    runner = RewardRunner("my_rewards.py:two", timeout_s=30)
    monkeypatch.chdir(tmp_path.parent)  # the worker (re)started later still finds the file
    try:
        assert runner.spec == f"{rewards_py}:two"
        assert runner.score([{"answer": "7"}] * 2, ["7", "8"], [[7], [8]]).rewards == [1.0, 0.0]
    finally:
        runner.close()


def test_a_module_spec_and_a_two_argument_function(rewards_py):
    with RewardRunner("megatron_cispo.rollout.arith:exact_match", timeout_s=30) as runner:
        res = runner.score([{"answer": "12"}] * 4, ["12", " 12<eos>", "21", "12"], [[1, 2], [1, 2, 13], [2, 1], [1, 2]],
                           finish_reasons=["stop", "stop", "stop", "length"])
    assert res.rewards == [1.0, 1.0, 0.0, 0.0]  # finish_reason reaches a reward that takes it: cut short scores 0
    fn = load_reward(f"{rewards_py}:two")  # wrapped to the 4-argument form
    assert fn({"answer": "a"}, "a", [0], "stop") is True and fn({"answer": "a"}, "b", [0], None) is False


def test_finish_reason_reaches_only_a_reward_that_names_it(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def named(r, c, t, finish_reason):\n    return float(finish_reason == 'stop')\n"
                 "def kw(r, c, t, **kw):\n    return float(len(kw))\n"
                 "def three(r, c, t, extra=5):\n    return float(extra)\n")
    assert load_reward(f"{f}:named")({}, "", [], "stop") == 1.0
    assert load_reward(f"{f}:kw")({}, "", [], "stop") == 0.0  # not through **kwargs
    assert load_reward(f"{f}:three")({}, "", [], "stop") == 5.0  # a defaulted 4th parameter keeps its default


def test_every_failure_is_counted_and_the_run_goes_on(rewards_py):
    kinds = ["len", "raise", "str", "nan", "inf", "none", "sleep", "len", "exit", "true"]
    with RewardRunner(f"{rewards_py}:by_kind", timeout_s=1.0) as runner:
        res = _score(runner, kinds)
        assert _score(runner, ["len"]).rewards == [3.0]  # the worker came back after the timeout and the exit
    assert res.rewards == [3.0, None, None, None, None, None, None, 3.0, None, 1.0]
    assert (res.errors, res.timeouts, res.non_numbers) == (2, 1, 4)
    assert res.first_failure == (f"reward {rewards_py}:by_kind on sample 1 (record {{'kind': 'raise'}}): "
                                 f"raised KeyError: 'no such\\nkey'")


@pytest.mark.parametrize("kind, cause", [
    ("str", "returned str '1.0', not a finite number"), ("nan", "returned float nan, not a finite number"),
    ("none", "returned NoneType None, not a finite number"), ("sleep", "timed out after 0.5 s"),
    ("exit", "the reward worker exited (code 3)"),
])
def test_first_failure_names_the_function_the_sample_and_the_cause_in_one_line(rewards_py, kind, cause):
    with RewardRunner(f"{rewards_py}:by_kind", timeout_s=0.5) as runner:
        res = _score(runner, ["len", kind])
    assert res.first_failure == f"reward {rewards_py}:by_kind on sample 1 (record {{'kind': '{kind}'}}): {cause}"


def test_a_timeout_stops_waiting_on_a_reward_that_sleeps_10_s(rewards_py):
    with RewardRunner(f"{rewards_py}:by_kind", timeout_s=0.5) as runner:
        pid = runner._slots[0].proc.pid
        start = time.monotonic()
        res = _score(runner, ["sleep"])
        elapsed = time.monotonic() - start
    assert res.timeouts == 1 and res.rewards == [None]
    assert 0.5 <= elapsed < 3.0, elapsed  # 0.5 s and a kill, not the 10 s sleep
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the stuck worker is gone, not left running


def test_the_call_stops_when_its_budget_is_spent_and_counts_the_rest_as_cut_by_it(rewards_py):
    """1 s a sample, 5 samples, a 2.5 s budget: 2 are scored, the third is stopped at 2.5 s and the
    last two are not called (the trainer's other ranks wait in a collective meanwhile)."""
    with RewardRunner(f"{rewards_py}:by_kind", timeout_s=10) as runner:
        start = time.monotonic()
        res = _score(runner, ["sleep1"] * 5, budget_s=2.5)
        elapsed = time.monotonic() - start
        assert _score(runner, ["len"], budget_s=2.5).rewards == [3.0]  # the stopped worker came back
    assert 2.5 <= elapsed < 3.5, elapsed  # not the 5 s the samples would take
    scored = [r for r in res.rewards if r is not None]
    assert scored == [1.0] * len(scored) and 1 <= len(scored) <= 2
    assert len(scored) + res.budget_cut == 5 and res.errors == res.non_numbers == res.timeouts == 0
    assert res.rewards[:len(scored)] == scored  # in order: the scored ones first
    i = len(scored)
    assert res.first_failure.startswith(f"reward {rewards_py}:by_kind on sample {i} (record {{'kind': 'sleep1'}}): ")
    assert res.first_failure.endswith("the step's reward budget of 2.5 s was spent")


def test_a_budget_already_spent_scores_nothing_and_says_so(rewards_py):
    with RewardRunner(f"{rewards_py}:by_kind", timeout_s=10) as runner:
        res = _score(runner, ["len", "len"], budget_s=0)
        with pytest.raises(ValueError, match=r"budget_s=-1: expected None or a finite number of seconds >= 0"):
            _score(runner, ["len"], budget_s=-1)
    assert res.rewards == [None, None] and res.budget_cut == 2 and res.timeouts == 0
    assert res.first_failure.endswith("sample 0 (record {'kind': 'len'}): not scored: the step's reward budget "
                                      "of 0 s was spent")


@pytest.mark.parametrize("spec, expected", [
    ("nocolon", "data.reward='nocolon': expected 'package.module:function' or 'path/to/file.py:function'"),
    ("megatron_cispo.rollout.nope:f", "data.reward='megatron_cispo.rollout.nope:f': module not found "
                                      "(No module named 'megatron_cispo.rollout.nope'); is it installed or on PYTHONPATH?"),
    ("{dir}/missing.py:f", "data.reward='{dir}/missing.py:f': no such file {dir}/missing.py"),
    ("{dir}/my_rewards.py:nope", "data.reward='{dir}/my_rewards.py:nope': {dir}/my_rewards.py has no attribute 'nope'"),
    ("{dir}/my_rewards.py:NOT_CALLABLE", "data.reward='{dir}/my_rewards.py:NOT_CALLABLE': NOT_CALLABLE has type int, "
                                         "which is not callable"),
    ("{dir}/my_rewards.py:four", "data.reward='{dir}/my_rewards.py:four': four(a, b, c, d) cannot be called as "
                                 "fn(record, completion, token_ids) or fn(record, completion)"),
    ("{dir}/broken.py:f", "data.reward='{dir}/broken.py:f': importing it raised ZeroDivisionError: division by zero"),
])
def test_a_spec_that_cannot_be_used_is_refused_in_one_line(rewards_py, spec, expected):
    (rewards_py.parent / "broken.py").write_text(textwrap.dedent("""
        x = 1 / 0
        def f(r, c, t): return 0.0
    """))
    d = rewards_py.parent
    for make in (load_reward, lambda s: RewardRunner(s, timeout_s=1)):
        with pytest.raises(ValueError) as e:
            make(spec.format(dir=d))
        assert str(e.value) == expected.format(dir=d) and "\n" not in str(e.value)


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), "1"])
def test_a_timeout_that_is_not_a_positive_number_is_refused(timeout):
    with pytest.raises(ValueError, match="reward timeout_s=.*: expected a finite number of seconds > 0"):
        RewardRunner("megatron_cispo.rollout.arith:exact_match", timeout_s=timeout)


def _timed(log, n, seconds):
    return [{"log": str(log), "i": i, "s": seconds} for i in range(n)]


def test_several_workers_score_at_the_same_time_and_keep_the_samples_order(rewards_py, tmp_path):
    """data.reward_workers=4: 8 samples of 0.4 s go to whichever worker is free; the results come back in
    the samples' order, and calls from different workers overlap in time (seen in the calls' own log)."""
    log = tmp_path / "calls.log"
    with RewardRunner(f"{rewards_py}:timed", timeout_s=10, workers=4) as runner:
        records = _timed(log, 8, 0.4)
        res = runner.score(records, ["x"] * 8, [[1]] * 8)
    assert res.rewards == [float(i) for i in range(8)] and res.errors == res.timeouts == 0
    calls = [(int(pid), float(a), float(b)) for pid, a, b in (line.split() for line in log.read_text().splitlines())]
    assert len(calls) == 8 and len({pid for pid, _, _ in calls}) >= 2
    assert any(p != q and a < d and c < b for p, a, b in calls for q, c, d in calls), calls  # two at once


def test_a_worker_that_times_out_is_restarted_while_the_others_go_on(rewards_py):
    with RewardRunner(f"{rewards_py}:by_kind", timeout_s=0.5, workers=2) as runner:
        res = _score(runner, ["len", "sleep", "int", "len", "true"])
        again = _score(runner, ["len"] * 4)
    assert res.rewards == [3.0, None, 2.0, 3.0, 1.0] and res.timeouts == 1 and res.errors == 0
    assert res.first_failure == (f"reward {rewards_py}:by_kind on sample 1 (record {{'kind': 'sleep'}}): "
                                 "timed out after 0.5 s")
    assert again.rewards == [3.0] * 4


@pytest.mark.parametrize("workers", [0, -1, "2", 1.5])
def test_a_worker_count_that_is_not_a_positive_integer_is_refused(workers):
    with pytest.raises(ValueError, match=f"reward workers={workers!r}: expected an integer >= 1"):
        RewardRunner("megatron_cispo.rollout.arith:exact_match", timeout_s=1, workers=workers)


def test_exact_match_strips_whitespace_and_special_tokens_only():
    rec = {"answer": "12"}
    assert [arith.exact_match(rec, c, []) for c in ("12", " 12\n", "<bos>12<eos>", "12<|endoftext|>")] == [1.0] * 4
    assert [arith.exact_match(rec, c, []) for c in ("21", "1 2", "12+", "", "120")] == [0.0] * 5
    assert arith.exact_match(rec, "12", [1, 2, 13], "stop") == 1.0
    assert arith.exact_match(rec, "12", [1, 2], "length") == 0.0  # right digits, no <eos>: truncated
