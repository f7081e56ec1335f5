"""Run-directory ownership: the lock (pid and host), refusing a fresh run over an old one, moving aside."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megatron_cispo.config import ConfigError
from megatron_cispo.runner.rundir import LOCK, claim_run_dir

HOLD = """
import sys, time
from megatron_cispo.runner.rundir import claim_run_dir
owned = claim_run_dir(sys.argv[1], resume=False, overwrite=False)
print("held", flush=True)
time.sleep(600)
"""


def _old_run(path):
    (path / "checkpoints" / "step_000004").mkdir(parents=True)
    (path / "checkpoints" / "step_000004" / "COMPLETE").write_text("{}")
    (path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')


def test_a_fresh_run_into_an_empty_or_missing_dir_takes_the_lock_with_pid_and_host(tmp_path):
    with claim_run_dir(tmp_path / "new", resume=False, overwrite=False) as owned:
        assert owned.moved_to is None
        assert (tmp_path / "new" / LOCK).read_text() == f"pid {os.getpid()} on host {socket.gethostname()}\n"
    with claim_run_dir(tmp_path / "new", resume=False, overwrite=False):  # the lock file alone is not a run
        pass


def test_a_fresh_run_over_an_earlier_run_is_refused_and_touches_nothing(tmp_path):
    _old_run(tmp_path)
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints, metrics.jsonl\); set run.resume=true"
                                          r".*run.overwrite=true to move it aside"):
        claim_run_dir(tmp_path, resume=False, overwrite=False)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (tmp_path / "checkpoints" / "step_000004" / "COMPLETE").is_file()
    with claim_run_dir(tmp_path, resume=False, overwrite=True):  # the refusal released the lock
        pass


def test_overwrite_moves_the_earlier_run_aside_and_deletes_nothing(tmp_path):
    _old_run(tmp_path)
    with claim_run_dir(tmp_path, resume=False, overwrite=True) as owned:
        assert owned.moved_to.parent == tmp_path and owned.moved_to.name.startswith("previous_")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([LOCK, owned.moved_to.name])
        assert (owned.moved_to / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
        assert (owned.moved_to / "checkpoints" / "step_000004" / "COMPLETE").is_file()
    _old_run(tmp_path)  # a second overwrite keeps the first one's copy too
    with claim_run_dir(tmp_path, resume=False, overwrite=True) as again:
        assert again.moved_to != owned.moved_to and owned.moved_to.is_dir()


def test_resume_keeps_a_run_with_a_checkpoint_and_moves_aside_one_without(tmp_path):
    _old_run(tmp_path)
    with claim_run_dir(tmp_path, resume=True, overwrite=False, has_checkpoint=lambda p: True) as owned:
        assert owned.moved_to is None and (tmp_path / "metrics.jsonl").is_file()
    with claim_run_dir(tmp_path, resume=True, overwrite=False, has_checkpoint=lambda p: False) as owned:
        assert (owned.moved_to / "metrics.jsonl").is_file() and not (tmp_path / "metrics.jsonl").exists()


def test_a_second_job_fails_at_once_naming_the_holder_and_succeeds_once_it_is_killed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=rf"is in use by pid {holder.pid} on host {socket.gethostname()} "
                                              r"\(lock file .*\.lock\); wait for that job"):
            claim_run_dir(tmp_path, resume=False, overwrite=True)
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(ConfigError, match="in use by"):  # in this process too (another open file)
            claim_run_dir(tmp_path, resume=True, overwrite=False)
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up runs: the kernel drops the lock
        holder.wait()
    with claim_run_dir(tmp_path, resume=False, overwrite=False) as owned:
        assert owned.moved_to is None


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot write: chmod 555, or for root (whom chmod does not stop) a
    read-only tmpfs mounted there."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)]).returncode != 0:
        pytest.skip("root without permission to mount: chmod does not stop root and no read-only mount is possible")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("sub", ["", "run"])
def test_a_read_only_run_dir_is_refused_in_one_line(read_only_dir, sub):
    path = read_only_dir / sub if sub else read_only_dir
    with pytest.raises(ConfigError) as e:
        claim_run_dir(path, resume=False, overwrite=False)
    message = str(e.value)
    assert message.startswith(f"run.run_dir={path} is not writable: cannot create ") and "\n" not in message
    assert "choose a writable run.run_dir" in message and ("Read-only" in message or "Permission" in message)
