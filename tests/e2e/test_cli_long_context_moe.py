"""The CLI on long-sequence and MoE layouts: context parallelism and an MoE model at ep=2, tp=2 (with
sequence parallelism) and dp=2 each give the single-process run's metrics over 3 steps, within 2e-4.

The demo's rollout config trains packed (parallelism.max_tokens_per_microbatch), as the user
commands in docs/launch.md run it; the batch is smaller and the sampler fp32 so that 3 steps are quick.
"""
import pytest

from e2e_helpers import ROOT, assert_metrics_close, metrics, ranks

CONFIG = str(ROOT / "yaml_configs" / "cispo_rollout.yaml")
SMALL = ["rollout.prompts_per_step=8", "rollout.group_size=4", "parallelism.micro_batch_size=8",
         "rollout.precision=fp32", "run.log_interval=1", "run.tensorboard=false", "run.steps=3"]
MOE = ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_aux_loss_coeff=0.01"]


def _run(tmp_path, name, nproc, *overrides):
    run_dir = tmp_path / name
    ranks(nproc, [CONFIG, *SMALL, *overrides, f"run.run_dir={run_dir}"])
    return metrics(run_dir)


def test_context_parallel_cli_matches_one_process(tmp_path):
    one = _run(tmp_path, "one", 1, "parallelism.tp=1")
    cp2 = _run(tmp_path, "cp2", 2, "parallelism.tp=1", "parallelism.cp=2")
    assert_metrics_close(cp2, one, steps=3, atol=2e-4)


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("moe"), "one", 1, *MOE, "parallelism.tp=1")


@pytest.mark.parametrize("layout", [
    ["parallelism.tp=1", "parallelism.ep=2"],
    ["parallelism.tp=2", "parallelism.sequence_parallel=true"],
    ["parallelism.tp=1"],
], ids=["ep2", "tp2_sp", "dp2"])
def test_moe_cli_matches_one_process(moe_reference, tmp_path, layout):
    got = _run(tmp_path, "moe", 2, *MOE, *layout)
    assert "num_moe_experts: 4" in (tmp_path / "moe" / "config.yaml").read_text()  # the run was MoE
    assert_metrics_close(got, moe_reference, steps=3, atol=2e-4)
