"""rollout.engine_gpus: which GPU each local engine replica gets, stated in the config, checked where the config
is read, at --check against the nodes (--nnodes, run.gpus_per_node: rollout/placement.py) and against each
node's GPUs at start, handed to the engine's process as the one GPU it sees, and counted by the memory plan on
the trainer rank it shares a GPU with. No GPU is needed: the CUDA parts are pure."""
import importlib.util
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
    (["rollout.engines=2", "rollout.engine_gpus=[1]"], "rollout.engine_gpus=[1]: expected 2 GPU indices"),
    (["rollout.engine_gpus=[-1]"], "rollout.engine_gpus=[-1]: expected 1 GPU indices >= 0, one per replica"),
    (["rollout.engine_gpus=[6]", "rollout.placement=ray"], "rollout.engine_gpus places engines in their own "
                                                           "processes beside trainer ranks"),
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
    assert share[1] == int(0.35 * 80 * GIB)  # replica 0 beside local rank 1; replica 1 on GPU 9, apart
    assert sum(share.values()) == share[1] and share[0] == 0


def _check(capsys, world: int, *args):
    from megatron_cispo import train

    batch = ["rollout.prompts_per_step=48"] if world == 12 else []  # 384 rows: dp 3 x micro-batch 4 divides them
    code = train.main(["--check", QWEN8B, MATH, *batch, "--world-size", str(world), *args])
    out, err = capsys.readouterr()
    return code, out, err.strip()


@pytest.mark.parametrize("world, args, says", [
    (12, ["--nnodes", "1", "run.gpus_per_node=8", "rollout.engines=2", "rollout.engine_gpus=[7,7]"],
     "rollout.engine_gpus=[7, 7]: replicas 0 and 1 would share GPU 7 of their node (on several nodes, give --check "
     "their number: --nnodes); give each replica on a node its own GPU"),
    (12, ["--nnodes", "2", "run.gpus_per_node=8", "rollout.engines=2", "rollout.engine_gpus=[6,8]"],
     "rollout.engine_gpus=[6, 8]: replica 1 (on node 1) is given GPU 8, which a node of run.gpus_per_node=8 does "
     "not have (0..7; 6 of each node's 8 GPUs train, 2 are left over for engines apart)"),
    (16, ["--nnodes", "2", "run.gpus_per_node=8", "rollout.engines=2", "rollout.placement=ray",
          "rollout.ray_address=127.0.0.1:1"],
     "rollout.placement=ray: 2 engines x tensor_parallel_size 1 need 2 GPUs apart from the trainer, and 2 node(s) "
     "have 0 (8 of each node's 8 GPUs train, 0 are left over for engines apart): launch fewer trainer processes "
     "per node, or fewer engines"),
    (16, ["--nnodes", "2", "run.gpus_per_node=4"], "16 trainer processes on 2 node(s) are 8 per node, more than "
                                                   "run.gpus_per_node=4: add nodes (--nnodes) or fix run.gpus_per_node"),
    (16, ["--nnodes", "3"], "--nnodes 3 must be >= 1 and divide the world size 16 (torchrun starts the same number "
                            "of processes on every node)"),
])
def test_check_refuses_engines_the_nodes_cannot_place_in_one_line(capsys, world, args, says):
    code, out, err = _check(capsys, world, *args)
    assert code == 2 and out == "" and err.endswith(says) and "\n" not in err, err


def _placed(code: int, out: str, err: str) -> bool:
    """--check got past the placement: ok, or (the second megatron-core tier, no vLLM) refused after it, there."""
    if importlib.util.find_spec("vllm") is None:
        return code == 2 and "needs vLLM" in err
    return code == 0 and "# ok: " in out


def test_check_places_replicas_per_node_and_says_what_it_could_not_check(capsys):
    # the same GPU index on two nodes is two GPUs: replica 0 on node 0's GPU 7, replica 1 on node 1's
    code, out, err = _check(capsys, 12, "--nnodes", "2", "run.gpus_per_node=8", "rollout.engines=2",
                            "rollout.engine_gpus=[7,7]")
    assert _placed(code, out, err) and "# not checked: which GPUs" not in out, err
    code, out, err = _check(capsys, 8, "run.gpus_per_node=null")
    assert _placed(code, out, err), err
    if code == 0:
        assert "# not checked: which GPUs the rollout engines get on each node (set run.gpus_per_node)" in out


def test_a_replica_shares_the_gpu_of_the_trainer_rank_on_its_node():
    from megatron_cispo.rollout.placement import colocated_rank

    cfg = load_experiment(QWEN8B, [MATH, "rollout.engines=3", "rollout.engine_gpus=[1,7,2]"], env={})
    # 2 nodes of 6 trainer processes: replica 0 on node 0 GPU 1 (rank 1), 1 on node 1 GPU 7 (apart), 2 on node 0 GPU 2
    assert [colocated_rank(cfg, k, world=12, nnodes=2) for k in range(3)] == [1, None, 2]
    assert [colocated_rank(cfg, k, world=16, nnodes=4) for k in range(3)] == [1, None, 10]


def test_each_node_checks_its_own_replicas_gpus_at_start(monkeypatch):
    # rank 0 for its node's replicas (0 and 2 of 3 on two nodes), a host for its one: the same check
    monkeypatch.setattr(vllm_engine.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm_engine.torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    assert vllm_engine.gpus_here([0, 6], [0, 2]) == (
        "rollout.engine_gpus: replica 0 on GPU 0 (colocated with local rank 0), replica 2 on GPU 6 (apart)")
    assert vllm_engine.gpus_here([None], [0]) is None  # no rollout.engine_gpus: the host's own GPU
    with pytest.raises(ValueError, match=r"GPU 8 is not on its node, which has 8 \(0..7\); 6 of them train"):
        vllm_engine.gpus_here([8], [0], node="its node")
