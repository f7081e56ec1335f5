"""A checkpoint written with the other megatron-core tier resumes on this one: 0.16.1 (.venv, common.pt)
and 0.19.2 (.venv-mcore-0.19.2, the common state inside the shards); launch/setup_env.sh makes both
(MCORE=0.19.2 for the second). Each tier's run tests the direction it reads, so the suite on both
tiers tests both directions; this test skips, saying so, when the other venv is absent.

The other tier writes: a 2-rank tp2 run of 4 steps, checkpointing every 2, is the reference. This
tier resumes its step-2 checkpoint on the same layout (RNG states restored) and must match steps 3-4,
then writes its own checkpoint (this tier's layout) at step 4.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_helpers import DEMO, ROOT, TINY, assert_metrics_close, env, metrics, torchrun
from megatron_cispo.runner import checkpoint_files

STEPS = 4


def _version(python: str) -> str:
    return subprocess.run([python, "-c", "from megatron.core import package_info as p; print(p.__shortversion__)"],
                          capture_output=True, text=True, env=env(), timeout=300, check=True).stdout.split()[-1]


@pytest.fixture(scope="module")
def other():
    """(python, megatron-core version) of the other tier's venv: .venv or .venv-mcore-*, not this one."""
    here = checkpoint_files.megatron_core_version()
    for venv in sorted(ROOT.glob(".venv*")):
        python = venv / "bin" / "python"
        if python.is_file() and venv.resolve() != Path(sys.prefix).resolve():
            version = _version(str(python))
            if version != here:
                return str(python), version
    pytest.skip(f"no venv with another megatron-core than {here} beside this one in {ROOT} "
                "(make the second tier: MCORE=0.19.2 bash launch/setup_env.sh)")


def _args(run_dir, *extra):
    return [DEMO, *TINY, "parallelism.tp=2", f"run.steps={STEPS}", "run.checkpoint_interval=2",
            f"run.run_dir={run_dir}", *extra]


def test_a_checkpoint_written_by_the_other_megatron_core_resumes_here_and_matches_the_uninterrupted_run(
        other, tmp_path):
    writer, reader = other, (sys.executable, checkpoint_files.megatron_core_version())
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    torchrun(2, _args(reference), python=writer[0])
    step2 = reference / "checkpoints" / "step_000002"
    marker = json.loads((step2 / checkpoint_files.MARKER).read_text())
    assert marker["megatron_core"] == writer[1], marker
    # the writer's own layout: common.pt up to 0.18, the shards' common_state from 0.19
    minor = tuple(int(x) for x in writer[1].split(".")[:2])
    assert (step2 / checkpoint_files.COMMON).is_file() == (minor < (0, 19)), sorted(p.name for p in step2.iterdir())
    shutil.copytree(step2, resumed / "checkpoints" / "step_000002")  # killed right after step 2
    shutil.copy(reference / "metrics.jsonl", resumed / "metrics.jsonl")
    proc = torchrun(2, _args(resumed, "run.resume=true"), python=reader[0])
    assert f"resumed from {resumed / 'checkpoints' / 'step_000002'}" in proc.stdout, proc.stdout[-3000:]
    note = f"was written by megatron-core {writer[1]}; loading it with megatron-core {reader[1]}"
    assert proc.stdout.count(note) == 1, proc.stdout[-3000:]  # said once, by rank 0
    assert [r["step"] for r in metrics(resumed)] == [1, 2, 3, 4]
    assert_metrics_close(metrics(resumed), metrics(reference), steps=STEPS, atol=1e-5)
    assert checkpoint_files.verify(resumed / "checkpoints" / "step_000004") is None  # the reader's own layout
