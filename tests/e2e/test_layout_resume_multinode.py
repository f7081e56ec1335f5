"""Layout independence, resume equivalence (on the same and on another layout) and a two-"node"
loopback launch, on one tiny config.

One uninterrupted (tp, pp, dp) = (2, 1, 2) run of 4 steps, checkpointing every 2, is the reference.
"""
import shutil
import subprocess
import sys

import pytest

from e2e_helpers import DEMO, ROOT, TINY, assert_metrics_close, env, killed_after_step_2, metrics, ranks
from megatron_cispo.testing import free_port

STEPS = 4


def _args(run_dir, *extra):
    return [DEMO, *TINY, f"run.steps={STEPS}", "run.checkpoint_interval=2", f"run.run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref") / "tp2_dp2"
    ranks(4, _args(run_dir, "parallelism.tp=2", "parallelism.pp=1"))
    return run_dir


@pytest.mark.parametrize("nproc, tp, pp", [(1, 1, 1), (4, 2, 2)], ids=["tp1_pp1_dp1", "tp2_pp2_dp1"])
def test_layouts_give_the_same_first_three_steps(reference, tmp_path, nproc, tp, pp):
    ranks(nproc, _args(tmp_path / "run", f"parallelism.tp={tp}", f"parallelism.pp={pp}", "run.steps=3",
                       "run.checkpoint_interval=0"))
    assert_metrics_close(metrics(tmp_path / "run"), metrics(reference), steps=3, atol=1e-4)


def test_resumed_run_matches_uninterrupted_run_step_for_step(reference, tmp_path):
    run_dir = tmp_path / "resumed"
    killed_after_step_2(reference, run_dir)
    proc = ranks(4, _args(run_dir, "run.resume=true"))
    assert "resumed from" in proc.stdout
    resumed, straight = metrics(run_dir), metrics(reference)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert_metrics_close(resumed, straight, steps=STEPS, atol=0.0)


def test_resume_on_another_layout_matches_the_uninterrupted_run(reference, tmp_path):
    # Saved at (tp, pp, dp) = (2, 1, 2), resumed at (1, 2, 1): dist_checkpointing reshards the
    # model and the optimizer state, and steps 3-4 match the uninterrupted run as layouts match.
    run_dir = tmp_path / "relayout"
    killed_after_step_2(reference, run_dir)
    proc = ranks(2, _args(run_dir, "run.resume=true", "parallelism.tp=1", "parallelism.pp=2"))
    assert "resumed from" in proc.stdout and "world 2 = tp 1 x pp 2 x dp 1" in proc.stdout
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert_metrics_close(resumed, metrics(reference), steps=STEPS, atol=1e-4)


def test_resume_skips_an_incomplete_checkpoint(reference, tmp_path):
    # A job killed while saving step 4: both checkpoints on disk, step 4 without its COMPLETE marker.
    run_dir = tmp_path / "partial"
    shutil.copytree(reference / "checkpoints", run_dir / "checkpoints")
    (run_dir / "checkpoints" / "step_000004" / "COMPLETE").unlink()
    shutil.copy(reference / "metrics.jsonl", run_dir / "metrics.jsonl")
    proc = ranks(4, _args(run_dir, "run.resume=true"))
    resumed_line = next(line for line in proc.stdout.splitlines() if "resumed from" in line)
    assert resumed_line.split("resumed from", 1)[1].strip().endswith("step_000002"), resumed_line
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # steps 3-4 were trained again from step 2
    assert_metrics_close(resumed, metrics(reference), steps=STEPS, atol=0.0)
    assert (run_dir / "checkpoints" / "step_000004" / "COMPLETE").is_file()


def test_two_nodes_on_loopback_match_one_node(reference, tmp_path):
    # launch/multi_node.sh twice: torchrun --nnodes 2 --node-rank 0|1 --master-addr 127.0.0.1, 2 ranks each.
    args = _args(tmp_path / "two_nodes", "parallelism.tp=2", "run.steps=1", "run.checkpoint_interval=0")
    node_env = {**env(), "NNODES": "2", "GPUS_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()), "NGPU": "0", "PY": sys.executable}
    procs = [subprocess.Popen(["bash", "launch/multi_node.sh", *args], cwd=ROOT, env={**node_env, "NODE_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    assert "world 4 = tp 2 x pp 1 x dp 2" in outs[0][0]
    assert_metrics_close(metrics(tmp_path / "two_nodes"), metrics(reference), steps=1, atol=1e-6)
