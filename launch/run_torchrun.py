"""torch.distributed.run for the launch scripts (launch/common.sh run_torchrun): the same launcher, with
one line instead of a traceback where the ranks or the rendezvous have already said what happened.

    python launch/run_torchrun.py SCRIPT WAITED_FOR WORLD_SIZE [torchrun arguments ...]

- First the config and overrides after `-m megatron_cispo.train` are checked as `train --check
  --world-size WORLD_SIZE --nnodes N` checks them (N: WORLD_SIZE over torchrun's --nproc-per-node), here (a separate check would start Python and import torch
  once more): a bad one is one line, exit 2, and no rank is started.
- The rendezvous fails (a node did not come in time, the port is taken): one line, SCRIPT: WAITED_FOR
  and then torch's own message; exit 1.
- The workers stop with one of train.py's REPORTED_EXIT_CODES (2 config error, 3 non-finite stop,
  4 peer lost, 5 preempted, 6 checkpoint save failed, 7 rollout engine failed): every failed worker with the same one, but
  for those the agent stopped with SIGTERM after the first failure, or (when torchrun itself got
  the SIGTERM/SIGINT and forwarded it) every worker with it. Rank 0 has printed the one line, so
  torchrun's failure summary, traceback and log lines about it are left out, and this exits with
  that code.
- Anything else (a crash, a signal the workers did not handle, mixed codes): torchrun's own output
  and exit code 1.
"""
import contextlib
import io
import logging
import os
import signal
import sys
import traceback
from pathlib import Path

# c10 reads its log level once, at import: raising it here hides the C++ stack dump the agent logs
# per connection retry while a node waits for node 0, and the workers still get the user setting.
user_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
if user_level is None:
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
from torch.distributed.elastic.multiprocessing import api as workers_api  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.run import main  # noqa: E402

if user_level is None:
    del os.environ["TORCH_CPP_LOG_LEVEL"]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megatron_cispo, as the workers' -m finds it
# Under nohup (SIGHUP ignored) the agent must not handle SIGHUP either: by default it catches it and
# forwards it, and the workers would stop at logout, which nohup was asked to prevent.
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGQUIT")  # torchrun's --signals-to-handle
from megatron_cispo.train import REPORTED_EXIT_CODES, main as train  # noqa: E402

# The agent's log lines about stopping workers, held until we know whether a rank said why already.
HELD = {"torch.distributed.elastic.multiprocessing.api": ("failed (exitcode: ", "Sending process "),
        "torch.distributed.elastic.agent.server.api": ("Received %s death signal",)}


class HeldLogs(logging.Filter):
    def __init__(self):
        super().__init__()
        self.records = []
        for name in HELD:
            logging.getLogger(name).addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(HELD.get(record.name, ())):
            self.records.append(record)
            return False
        return True

    def release(self) -> None:
        """Log the held lines after all: torchrun's output as it would have been."""
        for name in HELD:
            logging.getLogger(name).removeFilter(self)
        for record in self.records:
            logging.getLogger(record.name).handle(record)


# Exit codes of the workers the agent stopped after torchrun got a signal (it raises SignalException,
# which carries none). Recorded by wrapping the agent's SubprocessContext._close (torch >= 2.1).
closed_codes: dict[int, int | None] = {}
_close = getattr(workers_api.SubprocessContext, "_close", None)
if _close is not None:
    def _close_and_record(self, *args, **kwargs):
        try:
            _close(self, *args, **kwargs)
        finally:  # also when a second signal cuts the wait short: a worker still running records None
            closed_codes.update({rank: h.proc.poll() for rank, h in self.subprocess_handlers.items()})

    workers_api.SubprocessContext._close = _close_and_record


def reported(codes, *, stopped_by_agent=()) -> int | None:
    """The exit code all workers in `codes` returned, when it is one whose reason rank 0 printed; workers
    the agent stopped after the first failure (one still on its way out gets its SIGTERM: exit code
    -15) are left out. Else None."""
    said = set(codes) - set(stopped_by_agent)
    return said.pop() if len(said) == 1 and said <= set(REPORTED_EXIT_CODES) else None


def check_config(world: str, torchrun_args: list[str]) -> int:
    """train.py's --check of what the workers will get: 0, or its exit code after it printed one line."""
    if "megatron_cispo.train" not in torchrun_args:
        return 0
    at = torchrun_args.index("megatron_cispo.train")
    config_and_overrides = torchrun_args[at + 1:]
    # the nodes: WORLD_SIZE over torchrun's processes per node (the scripts pass both; --nnodes may be a range)
    flags = torchrun_args[:at]
    per_node = flags[flags.index("--nproc-per-node") + 1] if "--nproc-per-node" in flags else ""
    nnodes = ["--nnodes", str(int(world) // int(per_node))] if per_node.isdigit() and int(per_node) > 0 else []
    with contextlib.redirect_stdout(io.StringIO()):  # the resolved config it prints
        return train(["--check", "--world-size", world, *nnodes, *config_and_overrides])


script, waited_for, world = sys.argv[1:4]
torchrun_args = sys.argv[4:]
if code := check_config(world, torchrun_args):
    sys.exit(code)
held = HeldLogs()
try:
    main(torchrun_args)
except ChildFailedError as e:
    code = reported([f.exitcode for f in e.failures.values()], stopped_by_agent=(-signal.SIGTERM,))
    if code is None:
        held.release()
        raise
    sys.exit(code)
except workers_api.SignalException:
    code = reported(closed_codes.values())  # torchrun forwarded the signal: every worker must have said why
    if code is None:
        held.release()
        raise
    sys.exit(code)
except Exception as e:
    held.release()
    # only failures of the agent rendezvous (joining the store, then agreeing on ranks) get one line
    if "_rendezvous" not in {frame.name for frame in traceback.extract_tb(e.__traceback__)}:
        raise
    torch_says = (str(e).strip().splitlines() or [""])[0] or type(e).__name__
    if "EADDRINUSE" in torch_says:
        waited_for = "the rendezvous port is already in use on this machine (another job?): set MASTER_PORT to a free port"
    print(f"{script}: {waited_for} (torch: {torch_says})", file=sys.stderr)
    sys.exit(1)
held.release()
