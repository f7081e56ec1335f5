"""docs/examples/fork_step.py, the in-house fork recipe of docs/integration.md, trains on CPU: two
gloo processes, data-parallel and tensor-parallel, give finite losses, moving weights and the
same numbers (the same global batch and the same initial weights in both layouts)."""
import json
import math
import subprocess
import sys

import pytest

from e2e_helpers import ROOT, env
from megatron_cispo.testing import free_port

STEPS = 3


def _run(tp: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "docs/examples/fork_step.py", "--tp", str(tp), "--steps", str(STEPS)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"tp={tp} exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_the_fork_example_trains_on_two_cpu_processes_and_dp2_matches_tp2():
    runs = {tp: _run(tp) for tp in (1, 2)}  # tp=1: dp=2
    for tp, steps in runs.items():
        assert [s["step"] for s in steps] == list(range(STEPS)), tp
        for s in steps:
            assert s["updated"] is True and s["policy/tokens"] > 0, (tp, s)
            assert all(math.isfinite(v) for v in s.values() if isinstance(v, float)), (tp, s)
            assert s["moved"] > 0, (tp, s)  # the optimizer changed the weights
        assert steps[-1]["moved"] > steps[0]["moved"], tp
        assert len({s["policy/loss"] for s in steps}) == STEPS, tp  # a new batch and new weights each step
    for dp2, tp2 in zip(runs[1], runs[2]):
        assert set(dp2) == set(tp2)
        for key, value in dp2.items():
            assert tp2[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (dp2["step"], key)
