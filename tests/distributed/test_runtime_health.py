"""Start-up and runtime health checks over gloo: a config that differs across ranks is refused
on every rank naming the key, and a rank that does not answer is named by exactly one rank
(rank 0, or the first live rank when rank 0 is the silent one). A rank that sleeps through the
timeout stands in for a stopped one here; tests/e2e/test_runtime_faults.py stops one for real."""
import contextlib
import datetime
import io
import time

import pytest
import torch
import torch.distributed as dist

from megatron_cispo.testing import spawn

TIMEOUT_S = 2


def mismatch_worker(seed_on_rank_2):
    from megatron_cispo.config import ConfigError
    from megatron_cispo.runner.consistency import check_same_config

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    seed = seed_on_rank_2 if dist.get_rank() == 2 else 1234
    text = f"run:\n  seed: {seed}\n  steps: 3\nmodel:\n  hidden_size: 64\n"
    try:
        check_same_config(text, device=torch.device("cpu"))
    except ConfigError as e:
        return str(e)
    return None


def test_a_config_that_differs_on_one_rank_is_refused_on_every_rank_naming_the_key():
    same = spawn(mismatch_worker, 3, args=(1234,))
    assert same == [None, None, None]
    refused = spawn(mismatch_worker, 3, args=(7,))
    assert refused[0] == refused[1] == refused[2]  # every rank raises the same message
    assert refused[0].endswith("set it alike everywhere: run.seed: ranks 0-1: 1234, rank 2: 7"), refused[0]


def silent_rank_worker(silent, err_text):
    from megatron_cispo.runner.peers import PeerLost, explain_lost_peer, health_group

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
    work = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT_S))
    health = health_group("gloo", TIMEOUT_S)
    if rank == silent:  # alive, but in no collective until the others are done
        with contextlib.suppress(dist.DistNetworkError):  # (rank 0 may be done and gone with the store)
            while store.add("test/done", 0) < 2:
                time.sleep(0.05)
        return None
    t0 = time.monotonic()
    err = RuntimeError(err_text)
    if err_text == "gloo":  # the real thing: a collective with the silent rank times out
        try:
            dist.all_reduce(torch.ones(1), group=work)
        except RuntimeError as e:
            err = e
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            explain_lost_peer(err, health, rank=rank, timeout_s=TIMEOUT_S)
            outcome = "returned"
        except PeerLost as e:
            outcome = str(e)
    store.add("test/done", 1)
    with contextlib.suppress(dist.DistNetworkError):  # gone: rank 0 held it and saw both live ranks done
        while store.add("test/done", 0) < 2:  # rank 0 holds the store: it leaves only after both live ranks
            time.sleep(0.05)
    return {"outcome": outcome, "printed": stderr.getvalue(), "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("silent", [1, 0])
def test_the_rank_that_does_not_answer_is_named_once(silent):
    results = spawn(silent_rank_worker, 3, args=(silent, "gloo"), timeout_s=120)
    live = [r for rank, r in enumerate(results) if rank != silent]
    said = "rank 1 stopped answering: a collective waited longer than run.dist_timeout_s (2 s)" if silent else \
        "rank 0 stopped answering (seen by rank "
    assert all(r["outcome"].startswith(said) for r in live), live
    printed = [r["printed"] for r in live if r["printed"]]
    assert len(printed) == 1 and printed[0].startswith(said), live  # said once
    if silent == 1:
        assert results[0]["printed"]  # by rank 0
    assert all(r["seconds"] < 6 * TIMEOUT_S for r in live), live  # bounded: timeout, barrier, verdict


def test_an_error_that_is_not_gloo_returns_at_once_without_a_barrier():
    # Rank 1 reaches no barrier until the others are done: they must not wait for it.
    results = spawn(silent_rank_worker, 3, args=(1, "shape mismatch in my own code"), timeout_s=60)
    assert all(r["outcome"] == "returned" and r["seconds"] < 1 and not r["printed"]
               for rank, r in enumerate(results) if rank != 1), results
