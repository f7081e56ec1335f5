"""Stopping on a signal: on SIGTERM (preemption), SIGINT (Ctrl-C) or SIGHUP (the terminal went away)
the runner finishes the current step, writes a checkpoint and stops; a second SIGINT stops at once.

    preempt.install(console_log=run_dir / "console.log")  # at start; the handler sets a flag, rank 0 says so
    signum = preempt.agreed(env.device)        # after each step, on every rank: MAX of the signal numbers
    if signum: ... save a checkpoint, then raise Preempted(stop_message(label, step, path, signum))
    preempt.uninstall()                        # in the loop's finally

torchrun forwards the signal it gets to its workers (each leads its own session, so a terminal's
Ctrl-C reaches torchrun only) and kills them 30 s later; a scheduler sends SIGTERM to every
process. Ranks that see a signal at different moments still stop after the same step, because
they stop when any rank has seen one. A second Ctrl-C ends the process at once with exit code 130,
without a checkpoint (the last one written stays): a second SIGINT, or after a SIGINT the SIGTERM
torchrun sends when it is interrupted again. Under torchrun a worker also gets SIGINT when torchrun
itself exits (PR_SET_PDEATHSIG), so no worker lives on without its launcher.

A SIGHUP that is ignored (SIG_IGN) when install() runs stays ignored: `nohup` sets it so, and such
a run keeps going after logout (under the launch scripts too: launch/run_torchrun.py keeps a nohup'ed
agent from handling SIGHUP, so its workers inherit the SIG_IGN). SIGTERM and SIGINT are always
caught: a shell starts a background job (`cmd &`) with SIGINT ignored. On SIGHUP the terminal is gone and writing to it fails
(EIO), so the handler points those of file descriptors 1 and 2 that are terminals at `console_log`
(appended; /dev/null when it cannot be opened) before it says anything: the rest of the run's
console output is kept there. Output to files or pipes stays where it goes.
"""
from __future__ import annotations

import ctypes
import os
import signal
import stat
import threading
import time

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
EXIT_INTERRUPTED = 128 + signal.SIGINT  # a second Ctrl-C: the shell's code for a process ended by SIGINT
_PR_SET_PDEATHSIG = 1
# Test-only: seconds to wait after a signal before the checkpoint, so that a test's second Ctrl-C
# surely arrives while the run is stopping (tests/e2e/test_runtime_faults.py). Never set it otherwise.
TEST_PAUSE_ENV = "MEGATRON_CISPO_TEST_PAUSE_BEFORE_SAVE_S"

_received = 0  # the first signal's number, 0 before any
_previous: dict = {}
_console_log: str | None = None  # where fds 1 and 2 go after SIGHUP


class Preempted(RuntimeError):
    """A signal: the step finished, a checkpoint was written and the run stopped; raised alike on
    every rank after rank 0 printed which signal, where the checkpoint is and how to resume."""


def _say(line: str) -> None:
    """One line on stderr from rank 0 (torchrun's RANK; a single process is rank 0). A signal handler
    may run inside a print, so this is one write(2), which Python's I/O locks do not guard."""
    if os.environ.get("RANK", "0") == "0":
        try:
            os.write(2, (line + "\n").encode())
        except OSError:  # a console that is gone must not stop the run: the line is lost, the run is not
            pass


def _on_terminal(fd: int) -> bool:
    """Whether `fd` is a terminal (a character device; a hung-up one still is), not a file or a pipe."""
    try:
        return stat.S_ISCHR(os.fstat(fd).st_mode)
    except OSError:
        return True  # not even fstat works: treat it as gone


def _keep_console() -> None:
    """After SIGHUP: those of fds 1 and 2 that are terminals to the console log (or /dev/null), so no
    later write fails with EIO; files and pipes (a launcher's log, a scheduler's) stay as they are."""
    gone = [std for std in (1, 2) if _on_terminal(std)]
    for target in (_console_log, os.devnull) if gone else ():
        if target is None:
            continue
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            continue
        for std in gone:
            os.dup2(fd, std)
        os.close(fd)
        return


def _handler(signum, frame) -> None:
    global _received
    if signum == signal.SIGHUP:
        _keep_console()
    if not _received:
        _received = signum
        _say(f"{signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
             "(Ctrl-C again stops at once, without one)")
    # A second Ctrl-C. Under torchrun it arrives as SIGTERM: the agent, interrupted again while it waits
    # for the workers, sends SIGTERM as it exits. A second SIGTERM alone is not one: a scheduler may
    # signal the workers and torchrun both, which forwards its own.
    elif signum == signal.SIGINT or (signum == signal.SIGTERM and _received == signal.SIGINT):
        _say(f"{signal.Signals(signum).name} after {signal.Signals(_received).name}: stopped at once, without a "
             "checkpoint; the last checkpoint written is kept")
        os._exit(EXIT_INTERRUPTED)  # no clean-up: the kernel releases the run_dir lock and the sockets


def _die_with_parent() -> None:
    """Under torchrun: SIGINT when the agent exits, so a worker never outlives its launcher."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # a plain process: its parent (a shell) may exit while it finishes its checkpoint
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGINT), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: a worker then outlives a torchrun that died
        pass


def install(console_log: str | os.PathLike | None = None) -> None:
    """Catch SIGTERM, SIGINT and SIGHUP (main thread only; elsewhere signals cannot be caught and
    nothing changes), except SIGHUP when it is ignored (SIG_IGN, as `nohup` sets it).
    After SIGHUP the output to a terminal goes to `console_log` (appended), else to /dev/null."""
    global _received, _console_log
    _received = 0
    _console_log = None if console_log is None else os.fspath(console_log)
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            if not (sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN):  # nohup's choice
                _previous[sig] = signal.signal(sig, _handler)
        _die_with_parent()


def uninstall() -> None:
    for sig, previous in list(_previous.items()):
        signal.signal(sig, previous)
        del _previous[sig]


def requested() -> bool:
    """Whether this process has received one of SIGNALS since install()."""
    return bool(_received)


def agreed(device: torch.device) -> int:
    """Collective over the world (one MAX all-reduce of one int on `device`): the highest signal number
    any rank has received, 0 for none. Every rank gets the same answer, so all stop after the same step."""
    flag = torch.tensor([_received], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def pause_for_tests() -> None:
    """Test-only (TEST_PAUSE_ENV): sleep before the checkpoint of a stop; nothing when it is unset."""
    seconds = os.environ.get(TEST_PAUSE_ENV)
    if seconds:
        time.sleep(float(seconds))


def stop_message(label: str, step: int, path, signum: int = signal.SIGTERM) -> str:
    return (f"[{label}] stopped by {signal.Signals(signum).name} after step {step}: checkpoint written to {path}; "
            "to continue, run the same command with run.resume=true")
