"""The CLI under runtime faults, launched with torchrun as a user would: ranks that resolve
different configs, a rank that stops answering (SIGSTOP), preemption (SIGTERM to torchrun), and
Ctrl-C or a dropped terminal (SIGINT, SIGHUP to torchrun's process group, as a terminal sends them;
SIGHUP after the terminal is really gone, on a pty)."""
import contextlib
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from e2e_helpers import DEMO, ROOT, TINY, Job, env, metrics, ranks, torchrun
from megatron_cispo.runner import preempt
from megatron_cispo.runner.checkpoint_files import MARKER, complete
from megatron_cispo.testing import free_port
from megatron_cispo.train import EXIT_CONFIG, EXIT_PEER_LOST, EXIT_PREEMPTED


def _args(run_dir, *extra):
    return [DEMO, *TINY, "parallelism.tp=1", f"run.run_dir={run_dir}", *extra]


def test_ranks_with_different_env_values_stop_at_start_naming_the_keys(tmp_path):
    # Each rank resolves run.seed and run.run_dir from its own RANK / LOCAL_RANK (set by torchrun).
    t0 = time.monotonic()
    proc = torchrun(2, _args(tmp_path / "${LOCAL_RANK}", "run.seed=${RANK}", "run.steps=2"), check=False,
                    timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"exitcode  : {EXIT_CONFIG}" in out, out[-3000:]
    assert time.monotonic() - t0 < 60
    lines = [line for line in out.splitlines() if "differs across ranks" in line]
    assert len(lines) == 1, out[-3000:]  # said once, by rank 0
    assert "run.seed: rank 0: 0, rank 1: 1" in lines[0]
    assert f"run.run_dir: rank 0: '{tmp_path / '0'}', rank 1: '{tmp_path / '1'}'" in lines[0]
    assert "megatron_cispo/" not in out.replace(DEMO, "")  # no traceback from a rank
    assert not (tmp_path / "0" / "metrics.jsonl").exists()  # stopped before training


def test_a_rank_that_stops_answering_is_named_by_rank_0_which_exits_4(tmp_path):
    # (Rank 0 being the stopped one, and the protocol's bounds, are in tests/distributed/test_runtime_health.py.)
    run_dir = tmp_path / "run"
    job = Job(tmp_path, 2, _args(run_dir, "run.steps=100000", "run.dist_timeout_s=4"))
    try:
        job.wait_for_steps(run_dir, 1)
        workers = job.workers()
        rank0, rank1 = workers[0], workers[1]
        os.kill(rank1, signal.SIGSTOP)
        t0 = time.monotonic()
        # gloo times out after 4 s and the health check waits 4 s more; allow a loaded machine.
        while _alive(rank0):
            assert time.monotonic() - t0 < 60, job.output()[-3000:]
            time.sleep(0.1)
        # torchrun would SIGKILL the stopped worker 30 s after SIGTERM; spare the test that wait.
        os.kill(rank1, signal.SIGKILL)
        job.proc.wait(timeout=60)
    finally:
        job.kill()
    out = job.output()
    summary = out[out.index("Root Cause"):]
    assert "rank      : 0" in summary and f"exitcode  : {EXIT_PEER_LOST}" in summary, out[-3000:]
    lines = [line for line in out.splitlines() if "stopped answering" in line]
    assert len(lines) == 1, out[-3000:]  # said once, by rank 0
    assert lines[0].startswith("rank 1 stopped answering: a collective waited longer than run.dist_timeout_s (4 s)")


def _alive(pid: int) -> bool:
    """Running or stopped, not exited (a zombie waits for torchrun to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_resume_runs_to_the_end(tmp_path):
    run_dir = tmp_path / "run"
    args = _args(run_dir, "run.steps=40")  # run.checkpoint_interval stays 0: no periodic checkpoints
    job = Job(tmp_path, 2, args)
    try:
        job.wait_for_steps(run_dir, 1)
        job.proc.send_signal(signal.SIGTERM)  # torchrun forwards it to every worker
        job.proc.wait(timeout=60)
    finally:
        job.kill()
    out = job.output()
    assert job.proc.returncode != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "stopped by SIGTERM" in line]
    assert len(lines) == 1, out[-3000:]  # said once, by rank 0
    steps = [r["step"] for r in metrics(run_dir)]
    stop = steps[-1]
    assert steps == list(range(1, stop + 1)) and stop < 40, steps
    ckpt = run_dir / "checkpoints" / f"step_{stop:06d}"
    assert lines[0] == (f"[cispo:rollout] stopped by SIGTERM after step {stop}: checkpoint written to {ckpt}; "
                        "to continue, run the same command with run.resume=true"), lines[0]
    assert (ckpt / MARKER).is_file() and sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [ckpt.name]

    resumed = ranks(2, [*args, "run.resume=true"], timeout=180)  # the resume is the subject here, not torchrun
    assert f"resumed from {ckpt}" in resumed.stdout
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 41))


def _interrupt(job, run_dir, signum):
    """Send `signum` to torchrun's process group, as a terminal does (its workers lead their own
    sessions, so torchrun forwards it)."""
    job.wait_for_steps(run_dir, 1)
    os.killpg(job.proc.pid, signum)
    job.proc.wait(timeout=90)
    return job.output()


def _still_running(run_dir):
    """Live processes whose command line names `run_dir` (a worker that outlived the launcher)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if f"run.run_dir={run_dir}".encode() in cmdline.read_bytes() and _alive(int(cmdline.parent.name)):
                found.append(int(cmdline.parent.name))
        except (OSError, ValueError):
            continue
    return found


def _sighup_default():
    """SIGHUP at its default in a child, as a shell on a terminal starts it, even when the suite itself
    runs under nohup (the CLI keeps an ignored SIGHUP ignored, and the test would wait in vain)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _assert_no_rank_traceback(out):
    assert "[rank0]" not in out and "[rank1]" not in out and "KeyboardInterrupt" not in out, out[-3000:]


def test_ctrl_c_and_sighup_finish_the_step_write_a_checkpoint_and_resume_runs_to_the_end(tmp_path):
    for signum in (signal.SIGHUP, signal.SIGINT):
        name = signal.Signals(signum).name
        (tmp_path / name).mkdir()
        run_dir = tmp_path / name / "run"
        args = _args(run_dir, "run.steps=40")  # run.checkpoint_interval stays 0: no periodic checkpoints
        job = Job(tmp_path / name, 2, args)
        try:
            out = _interrupt(job, run_dir, signum)
        finally:
            job.kill()
        # Bare torchrun ends with its own SignalException traceback (once, from the launcher) and exit 1.
        assert job.proc.returncode == 1, out[-3000:]
        _assert_no_rank_traceback(out)
        notices = [line for line in out.splitlines() if line.startswith(f"{name}: finishing this step")]
        assert len(notices) == 1, out[-3000:]  # said once, by rank 0, when the signal came
        steps = [r["step"] for r in metrics(run_dir)]
        stop = steps[-1]
        assert steps == list(range(1, stop + 1)) and stop < 40, steps
        ckpt = run_dir / "checkpoints" / f"step_{stop:06d}"
        lines = [line for line in out.splitlines() if "stopped by" in line]
        assert lines == [f"[cispo:rollout] stopped by {name} after step {stop}: checkpoint written to {ckpt}; "
                         "to continue, run the same command with run.resume=true"], out[-3000:]
        assert (ckpt / MARKER).is_file()
    resumed = ranks(2, [*args, "run.resume=true"], timeout=180)  # the resume is the subject here, not torchrun
    assert f"resumed from {ckpt}" in resumed.stdout
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 41))


@contextlib.contextmanager
def _launch_script(run_dir, log, overrides, *, extra_env=None, preexec_fn=None) -> Iterator[subprocess.Popen]:
    """`bash launch/single_node.sh` on 2 CPU ranks in its own process group (a terminal's job), output to `log`;
    the group is killed on the way out if it still runs (a failed assertion leaves no job behind)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", "launch/single_node.sh", *_args(run_dir, *overrides)], cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec_fn,
                                env={**env(), "NGPU": "0", "NPROC": "2", "MASTER_PORT": str(free_port()),
                                     **(extra_env or {})})
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_for_the_first_step(proc, run_dir, log) -> float:
    """Wait until metrics.jsonl has a step (the job is training); returns the deadline used."""
    deadline = time.monotonic() + 150
    while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    return deadline


def test_through_the_launch_script_ctrl_c_exits_5_and_a_second_one_130_with_the_ranks_lines_only(tmp_path):
    # launch/run_torchrun.py passes the ranks' reported exit codes on and leaves out torchrun's traceback.
    # The second Ctrl-C reaches the ranks as the SIGTERM torchrun sends when it is interrupted again, or as
    # the SIGINT of PR_SET_PDEATHSIG when torchrun exits first: either name is right.
    second = (r"(SIGTERM|SIGINT) after SIGINT: stopped at once, without a checkpoint; "
              "the last checkpoint written is kept")
    for times, code, said in ((1, 5, "stopped by SIGINT after step"), (2, 130, second)):
        # The second Ctrl-C must land while the ranks stop: they pause (test-only) before the checkpoint.
        pause = {preempt.TEST_PAUSE_ENV: "120"} if times == 2 else {}
        run_dir = tmp_path / f"ctrl_c_{times}"
        log = tmp_path / f"launch_{times}.txt"
        with _launch_script(run_dir, log, ["run.steps=100000"], extra_env=pause) as proc:
            deadline = _wait_for_the_first_step(proc, run_dir, log)
            os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the script's process group
            if times == 2:
                while "finishing this step" not in log.read_text():  # the second after rank 0 got the first
                    assert time.monotonic() < deadline, log.read_text()[-3000:]
                    time.sleep(0.01)
                os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=90)
        text = log.read_text()
        assert proc.returncode == code, text[-3000:]
        assert "Traceback" not in text and "death signal" not in text and len(re.findall(said, text)) == 1, text[-3000:]
        assert "KeyboardInterrupt" not in text and "[rank0]" not in text and not _still_running(run_dir)
        # once: the checkpoint after the step; twice: none (a save cut short leaves .step_N.tmp for the next)
        assert bool(complete(run_dir)) == (times == 1) and ("stopped by" in text) == (times == 1), text[-3000:]


def test_sighup_from_a_dropped_terminal_checkpoints_exits_5_and_keeps_the_output_in_console_log(tmp_path):
    # The CLI in one process on a pty, as in an ssh session; closing the master side hangs the terminal
    # up: every later write to it fails with EIO (it used to kill rank 0 inside the signal handler).
    run_dir = tmp_path / "run"
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "megatron_cispo.train", *_args(run_dir, "run.steps=100000")],
                            cwd=ROOT, env=env(), stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                            preexec_fn=_sighup_default)
    os.close(slave)
    try:
        deadline = time.monotonic() + 150
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            with contextlib.suppress(OSError):  # keep the pty drained, so the CLI never blocks on it
                while select.select([master], [], [], 0)[0]:
                    os.read(master, 65536)
            time.sleep(0.1)
        os.close(master)
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=90) == EXIT_PREEMPTED
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stop = metrics(run_dir)[-1]["step"]
    ckpt = run_dir / "checkpoints" / f"step_{stop:06d}"
    assert (ckpt / MARKER).is_file()
    text = (run_dir / "console.log").read_text()
    assert text.startswith("SIGHUP: finishing this step") and "Traceback" not in text, text
    assert f"stopped by SIGHUP after step {stop}: checkpoint written to {ckpt}" in text, text


def test_a_nohup_launch_script_trains_on_through_a_hang_up(tmp_path):
    # nohup: SIGHUP ignored from the start. torchrun's agent would catch and forward it to the ranks
    # (which then checkpoint and stop); launch/run_torchrun.py keeps the agent from handling it.
    run_dir, log = tmp_path / "run", tmp_path / "launch.txt"
    nohup = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)  # noqa: E731 - what nohup does
    with _launch_script(run_dir, log, ["run.steps=8"], preexec_fn=nohup) as proc:
        _wait_for_the_first_step(proc, run_dir, log)
        os.killpg(proc.pid, signal.SIGHUP)  # the hang-up a logout sends to the job
        proc.wait(timeout=120)
    text = log.read_text()
    assert proc.returncode == 0 and "stopped by" not in text, text[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 9))
