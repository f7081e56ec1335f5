"""The signal handling of runner/preempt.py in one process: SIGTERM, SIGINT and SIGHUP set the flag
(rank 0 says which, once), uninstall restores the handlers, a second Ctrl-C ends the process at once."""
import os
import pty
import signal
import subprocess
import sys

import pytest

from megatron_cispo.runner import preempt
from megatron_cispo.train import EXIT_INTERRUPTED


@pytest.fixture(autouse=True)
def sighup_as_a_terminal_leaves_it():
    """SIGHUP at its default, as a shell on a terminal starts a process, whatever the suite was started
    under: `nohup pytest` leaves it ignored, and install() keeps an ignored SIGHUP
    ignored (tested below), so the SIGHUP cases would not see their handler. The children inherit it."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, previous)


@pytest.mark.parametrize("signum", preempt.SIGNALS)
def test_each_signal_sets_the_flag_and_rank_0_says_which_in_one_line(signum, capfd, tmp_path):
    previous = {s: signal.getsignal(s) for s in preempt.SIGNALS}
    log = tmp_path / "console.log"  # where SIGHUP sends fds 1 and 2 when they are a terminal: not capfd's files
    preempt.install(console_log=log)
    try:
        assert not preempt.requested()
        os.kill(os.getpid(), signum)  # the process lives on; the handler ran
        os.kill(os.getpid(), signal.SIGHUP)  # a second signal that is no second Ctrl-C changes nothing
        assert preempt.requested()
    finally:
        preempt.uninstall()
    assert {s: signal.getsignal(s) for s in preempt.SIGNALS} == previous
    name = signal.Signals(signum).name
    assert not log.exists()
    assert capfd.readouterr().err == (f"{name}: finishing this step, then writing a checkpoint (Ctrl-C again "
                                      "stops at once, without one)\n")
    assert preempt.stop_message("x", 3, "/c", signum) == (
        f"[x] stopped by {name} after step 3: checkpoint written to /c; to continue, run the same command with "
        "run.resume=true")


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


def test_only_rank_0_says_anything(capfd, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    preempt.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert preempt.requested()
    finally:
        preempt.uninstall()
    assert capfd.readouterr().err == ""


def test_an_ignored_sighup_stays_ignored_so_a_nohup_run_survives_logout(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what `nohup` does
    try:
        preempt.install()
        try:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # the others are caught
            os.kill(os.getpid(), signal.SIGHUP)
            assert not preempt.requested()
        finally:
            preempt.uninstall()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_sigint_and_sigterm_are_caught_even_when_started_ignored(monkeypatch):
    # a shell starts a background job (`cmd &`) with SIGINT ignored: it must still finish the step and
    # checkpoint (and PR_SET_PDEATHSIG's SIGINT must still reach it when torchrun dies)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        for sig in sigs:
            preempt.install()
            try:
                assert signal.getsignal(sig) is preempt._handler
                os.kill(os.getpid(), sig)
                assert preempt.requested()
            finally:
                preempt.uninstall()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


HUNG_UP = """
import os, sys, time
from megatron_cispo.runner import preempt
preempt.install(console_log=sys.argv[1])
print("started", flush=True)
from megatron_cispo.runner.metrics import say
while not preempt.requested():  # a progress line per step, as the demo prints it (a lost line is no error)
    say("step", sys.stdout)
    time.sleep(0.01)
print("step finished after the signal", flush=True)
print("stopped: checkpoint written", file=sys.stderr, flush=True)
open(sys.argv[2], "w").close()  # stands for the checkpoint
sys.exit(5)
"""


def test_sighup_after_the_terminal_is_gone_still_finishes_and_keeps_the_output_in_the_console_log(tmp_path):
    # The terminal is a pty; closing its master side hangs it up: every later write to it fails with EIO.
    master, slave = pty.openpty()
    log, done = tmp_path / "console.log", tmp_path / "checkpoint"
    proc = subprocess.Popen([sys.executable, "-c", HUNG_UP, str(log), str(done)], stdin=slave, stdout=slave,
                            stderr=slave, start_new_session=True, env={**os.environ, "RANK": "0"})
    os.close(slave)
    try:
        seen = b""
        while b"step" not in seen:
            chunk = os.read(master, 1024)  # EIO once the child has closed the pty: it died before a step
            seen += chunk
        os.close(master)
        os.kill(proc.pid, signal.SIGHUP)
        assert proc.wait(timeout=60) == 5
    finally:
        if proc.poll() is None:
            proc.kill()
    assert done.is_file()
    text = log.read_text()
    assert text.startswith("SIGHUP: finishing this step") and "stopped: checkpoint written\n" in text, text
