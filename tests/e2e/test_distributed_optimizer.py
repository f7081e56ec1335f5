"""optimizer.distributed: megatron-core's distributed optimizer through the CLI, against the plain one.

4 steps on dp2 and on tp2 x dp2 (fp32): the weights after the last step (read from the step-4
checkpoints) and every step's metrics equal the plain optimizer's within 1e-6. The dp2 run's step-2
checkpoint resumed on dp1 and on tp2 continues as the plain optimizer's does (Adam's moments and step
counts resharded): metrics within 1e-6 of the uninterrupted run, weights within 1e-6 of the plain
optimizer's resumed the same way. A checkpoint of one optimizer resumed with the other is refused in
one line.
"""
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from e2e_helpers import DEMO, TINY, assert_metrics_close, killed_after_step_2, metrics, ranks

STEPS = 4


def _args(run_dir, *extra):
    return [DEMO, *TINY, f"run.steps={STEPS}", "run.checkpoint_interval=2", f"run.run_dir={run_dir}", *extra]


def _weights(run_dir, step: int, tmp_path) -> dict[str, torch.Tensor]:
    """The model's tensors in checkpoint `step` (megatron's names; the optimizer's and the RNG's left out)."""
    out = tmp_path / f"{run_dir.name}_{step}.pt"
    dcp_to_torch_save(str(run_dir / "checkpoints" / f"step_{step:06d}"), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.startswith(("optimizer", "rng"))}


def _assert_same_weights(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert sorted(a) == sorted(b) and len(a) > 10, (sorted(a)[:5], sorted(b)[:5])
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= atol, worst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distopt")
    out = {}
    for name, nproc, tp in (("dp2", 2, 1), ("tp2_dp2", 4, 2)):
        for optimizer in ("plain", "distributed"):
            run_dir = root / f"{name}_{optimizer}"
            ranks(nproc, _args(run_dir, f"parallelism.tp={tp}", f"optimizer.distributed={optimizer == 'distributed'}"))
            out[name, optimizer] = run_dir
    return out


@pytest.mark.parametrize("layout", ["dp2", "tp2_dp2"])
def test_the_distributed_optimizer_steps_as_the_plain_one(runs, layout, tmp_path):
    plain, sharded = runs[layout, "plain"], runs[layout, "distributed"]
    assert_metrics_close(metrics(sharded), metrics(plain), steps=STEPS, atol=1e-6)
    _assert_same_weights(_weights(sharded, STEPS, tmp_path), _weights(plain, STEPS, tmp_path))


def _resume(reference, run_dir, nproc: int, *overrides) -> None:
    """reference's step-2 checkpoint resumed in run_dir on `nproc` ranks, to step 4."""
    killed_after_step_2(reference, run_dir)
    ranks(nproc, _args(run_dir, *overrides, "run.resume=true"))


@pytest.mark.parametrize("nproc, tp", [(1, 1), (2, 2)], ids=["dp1", "tp2"])
def test_a_resume_on_another_layout_continues_as_the_plain_optimizer_does(runs, tmp_path, nproc, tp):
    """Steps 3-4 after the resume match the uninterrupted dp2 run's metrics within 1e-6, and the weights
    after step 4 equal those of the plain optimizer's checkpoint resumed on the same layout (another TP
    split sums in another order: across layouts the weights agree to about 2e-6, the same for both)."""
    for optimizer in ("distributed", "plain"):
        _resume(runs["dp2", optimizer], tmp_path / optimizer, nproc, f"parallelism.tp={tp}",
                f"optimizer.distributed={optimizer == 'distributed'}")
        assert_metrics_close(metrics(tmp_path / optimizer), metrics(runs["dp2", optimizer]), steps=STEPS, atol=1e-6)
    resumed = _weights(tmp_path / "distributed", STEPS, tmp_path)
    _assert_same_weights(resumed, _weights(tmp_path / "plain", STEPS, tmp_path))
    if nproc == 1:  # no TP split: the uninterrupted run's weights too
        _assert_same_weights(resumed, _weights(runs["dp2", "distributed"], STEPS, tmp_path))


@pytest.mark.parametrize("saved, now", [("plain", "true"), ("distributed", "false")])
def test_switching_the_optimizer_on_resume_is_refused_in_one_line(runs, tmp_path, saved, now):
    run_dir = tmp_path / "switched"
    killed_after_step_2(runs["dp2", saved], run_dir)
    proc = ranks(2, _args(run_dir, "parallelism.tp=1", f"optimizer.distributed={now}", "run.resume=true"),
                 check=False)
    said = [line for line in proc.stderr.splitlines() if "optimizer.distributed" in line]
    assert proc.returncode == 2 and len(said) == 1, proc.stderr[-3000:]
    was = "true" if saved == "distributed" else "false"
    assert f"was saved with optimizer.distributed={was} and this run has optimizer.distributed={now}" in said[0]
    assert "Traceback" not in proc.stderr
