"""The signal handling of runner/preempt.py in one process: SIGTERM, SIGINT and SIGHUP set the flag
(rank 0 says which, once), uninstall restores the handlers, a second Ctrl-C ends the process at once."""
import os
import signal
import subprocess
import sys

import pytest

from megatron_cispo.runner import preempt
from megatron_cispo.train import EXIT_INTERRUPTED


@pytest.mark.parametrize("signum", preempt.SIGNALS)
def test_each_signal_sets_the_flag_and_rank_0_says_which_in_one_line(signum, capfd):
    previous = {s: signal.getsignal(s) for s in preempt.SIGNALS}
    preempt.install()
    try:
        assert not preempt.requested()
        os.kill(os.getpid(), signum)  # the process lives on; the handler ran
        os.kill(os.getpid(), signal.SIGHUP)  # a second signal that is no second Ctrl-C changes nothing
        assert preempt.requested()
    finally:
        preempt.uninstall()
    assert {s: signal.getsignal(s) for s in preempt.SIGNALS} == previous
    name = signal.Signals(signum).name
    assert capfd.readouterr().err == f"{name}: finishing this step, then writing a checkpoint (Ctrl-C again " \
                                     "stops at once, without one)\n"
    assert preempt.stop_message("x", 3, "/c", signum) == (f"[x] stopped by {name} after step 3: checkpoint written "
                                                         "to /c; to continue, run the same command with run.resume=true")


SECOND = """
import os, signal, sys, time
from megatron_cispo.runner import preempt
preempt.install()
os.kill(os.getpid(), signal.SIGINT)
print("first handled", flush=True)
os.kill(os.getpid(), getattr(signal, sys.argv[1]))
time.sleep(30)
"""


@pytest.mark.parametrize("second", ["SIGINT", "SIGTERM"])
def test_a_second_ctrl_c_ends_the_process_at_once_with_130_and_one_line(second):
    # Under torchrun the second Ctrl-C reaches a worker as SIGTERM: torchrun's own when it exits.
    proc = subprocess.run([sys.executable, "-c", SECOND, second], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RANK": "0"})
    assert proc.returncode == preempt.EXIT_INTERRUPTED == EXIT_INTERRUPTED == 130 and proc.stdout == "first handled\n"
    assert proc.stderr.splitlines()[1:] == [f"{second} after SIGINT: stopped at once, without a checkpoint; the "
                                            "last checkpoint written is kept"], proc.stderr


def test_only_rank_0_says_anything(capfd):
    os.environ["RANK"] = "1"
    try:
        preempt.install()
        os.kill(os.getpid(), signal.SIGHUP)
        assert preempt.requested()
    finally:
        preempt.uninstall()
        del os.environ["RANK"]
    assert capfd.readouterr().err == ""
