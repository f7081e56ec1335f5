"""The pure parts of the runtime checks: the config-mismatch message and the SIGTERM flag."""
import os
import signal

from megatron_cispo.runner import preempt
from megatron_cispo.runner.consistency import describe_mismatch, flatten
from megatron_cispo.runner.peers import _TRANSPORT


def test_flatten_gives_dotted_key_paths_with_lists_as_leaves():
    assert flatten({"run": {"seed": 1, "dirs": [1, 2]}, "loss": {"cispo": {"eps": 0.2}}}) == \
        {"run.seed": 1, "run.dirs": [1, 2], "loss.cispo.eps": 0.2}


def test_a_mismatch_names_each_key_with_the_ranks_that_hold_each_value():
    configs = [{"run.seed": 1, "run.steps": 5}, {"run.seed": 1, "run.steps": 5}, {"run.seed": 1, "run.steps": 5},
               {"run.seed": 7, "run.steps": 5}, {"run.seed": 1, "run.steps": 5}, {"run.seed": 1}]
    assert describe_mismatch(configs) == \
        "run.seed: ranks 0-2,4-5: 1, rank 3: 7; run.steps: ranks 0-4: 5, rank 5: '<missing>'"


def test_a_mismatch_in_many_keys_names_ten_and_counts_the_rest():
    a = {f"k{i:02d}": 0 for i in range(13)}
    b = {k: 1 for k in a}
    text = describe_mismatch([a, b])
    assert text.count("rank 0: 0, rank 1: 1") == 10 and text.endswith("; and 3 more keys"), text


def test_sigterm_only_sets_a_flag_until_uninstalled():
    previous = signal.getsignal(signal.SIGTERM)
    preempt.install()
    try:
        assert not preempt.requested()
        os.kill(os.getpid(), signal.SIGTERM)  # the process lives on; the handler ran
        assert preempt.requested()
    finally:
        preempt.uninstall()
    assert signal.getsignal(signal.SIGTERM) is previous
    preempt.install()  # a new run starts with the flag down
    try:
        assert not preempt.requested()
    finally:
        preempt.uninstall()


def test_only_gloo_transport_errors_start_the_health_check():
    for text in ["[/x/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv",
                 "[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"]:
        assert _TRANSPORT.search(text)
    for text in ["CUDA out of memory", "shape '[4, 8]' is invalid for input of size 3", "Expected all tensors"]:
        assert not _TRANSPORT.search(text)
