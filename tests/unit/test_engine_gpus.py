"""rollout.engine_gpus: which GPU each local engine replica gets, stated in the config, checked where the config
is read and against rank 0's node at start, handed to the engine's process as the one GPU it sees, and counted
by the memory plan on the trainer rank it shares a GPU with. No GPU is needed: the CUDA parts are pure."""
from pathlib import Path

import pytest

from megatron_cispo.config import ConfigError
from megatron_cispo.rollout import vllm_engine
from megatron_cispo.rollout.vllm_engine import gpu_placement, visible_device
from megatron_cispo.runner.experiment import load_experiment
from megatron_cispo.runner.memory_plan import GIB, memory_plan

CONFIGS = Path(__file__).resolve().parents[2] / "yaml_configs"
QWEN8B = str(CONFIGS / "gpu_qwen3_8b.yaml")  # a Transformer Engine recipe: judged for CUDA anywhere
MATH = f"data.prompts={CONFIGS / 'data' / 'math_sample.jsonl'}"


def test_the_engine_sees_its_gpu_alone_through_the_schedulers_allocation():
    assert visible_device(3, None) == "3" and visible_device(0, "") == "0"
    assert visible_device(1, "4,5,6") == "5"  # the node's GPU 1 is the allocation's second
    with pytest.raises(ValueError, match=r"^rollout.engine_gpus names GPU 3, but CUDA_VISIBLE_DEVICES=4,5,6 gives "
                                         r"this node 3 GPUs \(0..2\)$"):
        visible_device(3, "4,5,6")


def test_placement_is_said_at_start_and_a_gpu_the_node_lacks_is_one_line():
    assert gpu_placement([0, 6], device_count=8, local_trainers=6) == (
        "rollout.engine_gpus: replica 0 on GPU 0 (colocated with local rank 0), replica 1 on GPU 6 (apart)")
    with pytest.raises(ValueError, match=r"^rollout.engine_gpus=\[6, 8\]: GPU 8 is not on rank 0's node, which has 8 "
                                         r"\(0..7\); 6 of them train, 2 are left over for engines apart$"):
        gpu_placement([6, 8], device_count=8, local_trainers=6)


@pytest.mark.parametrize("overrides, says", [
    (["rollout.engines=2"], "rollout.engines=2 on CUDA GPUs would put every replica on rank 0's GPU: give each its "
                            "GPU in rollout.engine_gpus"),
    (["rollout.engines=2", "rollout.engine_gpus=[1]"], "rollout.engine_gpus=[1]: expected 2 distinct GPU indices"),
    (["rollout.engines=2", "rollout.engine_gpus=[1,1]"], "expected 2 distinct GPU indices >= 0, one per replica"),
    (["rollout.engine_gpus=[-1]"], "rollout.engine_gpus=[-1]: expected 1 distinct GPU indices >= 0"),
    (["rollout.engine_gpus=[6]", "rollout.placement=ray"], "rollout.engine_gpus places engines in their own "
                                                           "processes beside rank 0"),
])
def test_bad_engine_gpus_are_refused_where_the_config_is_read(overrides, says):
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        load_experiment(QWEN8B, [MATH, *overrides], env={})


def test_the_child_gets_cuda_visible_devices_and_the_plan_counts_the_share_where_it_sits(monkeypatch, tmp_path):
    seen = {}

    def start(module, first, *, env=None, stderr=None):
        seen.update(env)
        raise RuntimeError("not starting vLLM here")
    monkeypatch.setattr(vllm_engine, "vllm_missing", lambda: None)
    monkeypatch.setattr(vllm_engine, "start", start)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(RuntimeError, match="not starting vLLM here"):
        vllm_engine.VLLMEngine(str(tmp_path), precision="bf16", max_model_len=8, seed=0, kept_sets=False, gpu=1,
                               log_path=str(tmp_path / "log"))
    assert seen["CUDA_VISIBLE_DEVICES"] == "3"
    cfg = load_experiment(QWEN8B, [MATH, "rollout.engines=2", "rollout.engine_gpus=[1,9]"], env={})
    share = {r: dict(g.parts).get("rollout engine", 0) for g in memory_plan(cfg, 8, device="cuda") for r in g.ranks}
    assert share[1] == int(0.4 * 80 * GIB)  # replica 0 beside local rank 1; replica 1 on GPU 9, apart
    assert sum(share.values()) == share[1] and share[0] == 0
