"""rollout.placement: ray through the CLI: the engine replicas are Ray actors in a Ray cluster the run joins
(rollout.ray_address), in one placement group of CPU bundles, fed by the same pool as local placement.

One local Ray cluster (ray.init(num_cpus=2) in this process, its files in a temp dir) serves every test here,
and only here: starting one costs seconds and memory, so CI pays for it once. With rollout.engines=2,
vLLM, fp32, sync mode and staleness 0 every step's CISPO ratio pi_theta / pi_rollout is within 1e-4 of 1
(each push reached both actors through the object store) and both replicas served their half of the
prompts; with rollout.on_engine_death=restart, replica 1's actor SIGKILLed after step 2 is replaced by a
fresh actor in its bundle that rejoins at the next push, replica 0 serving that step alone (the ratio
stays at 1), and its vLLM process dies with the old actor. Joining keeps the run's SIGTERM handler (ray.init replaces it), a live replica's refusal
is one line, closing removes the placement group but leaves a connection the process had before, and
bundles the cluster cannot place stop the start in one line naming what it has.
Skipped without ray unless CISPO_REQUIRE_RAY=1 (then it fails): CI's tier 1 installs it (RAY=1).
"""
import importlib.util
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from e2e_helpers import ROOT, metrics, ranks, served_per_step

YAML = str(ROOT / "yaml_configs" / "vllm_qwen2_tiny.yaml")
for _name, _how in (("ray", "RAY=1 bash launch/setup_env.sh"), ("vllm", "VLLM=1 bash launch/setup_env.sh")):
    if importlib.util.find_spec(_name) is None:
        if os.environ.get("CISPO_REQUIRE_RAY") == "1":
            raise RuntimeError(f"CISPO_REQUIRE_RAY=1 but {_name} is not installed here: {_how}")
        pytest.skip(f"{_name} is not installed ({_how}); CI's tier 1 has it", allow_module_level=True)

FAST = ["rollout.precision=fp32", "rollout.staleness=0", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "parallelism.micro_batch_size=8", "parallelism.tp=1", "parallelism.sequence_parallel=false",
        "run.log_interval=1", "run.tensorboard=false", "run.checkpoint_interval=0", "optimizer.lr=1e-2",
        "rollout.sync_bucket_mb=0.02", "data.eval_prompts=null", "optimizer.schedule=constant"]
# differs within every group, so every step moves the weights and a push that never arrived would show
REWARD = "def spread(record, completion, token_ids):\n    return float(sum(token_ids) % 5)\n"


@pytest.fixture(scope="module")
def cluster():
    """The address of a local Ray cluster with 2 CPUs, shut down after the module (ray.shutdown ends the
    processes this ray.init started, nothing else)."""
    import ray

    temp = tempfile.mkdtemp(prefix="cispo_ray_", dir="/tmp")  # short: Ray's socket paths live under it
    # Ray's memory monitor kills a starting actor when the node is above 95% memory, which a machine shared
    # with other jobs reaches (seen: the restarted replica killed); the kernel's OOM killer still applies
    monitor = os.environ.get("RAY_memory_monitor_refresh_ms")
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"  # read by the raylet ray.init starts
    try:
        ctx = ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, object_store_memory=100 << 20,
                       log_to_driver=False, logging_level="WARNING")
    finally:
        if monitor is None:
            os.environ.pop("RAY_memory_monitor_refresh_ms")
        else:
            os.environ["RAY_memory_monitor_refresh_ms"] = monitor
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    root = tmp_path_factory.mktemp("ray_cli")
    (root / "spread.py").write_text(REWARD)
    return make_tiny_hf("qwen2", root / "qwen2", vocab=16, heads=2, kv_heads=2, seed=3)


def _off_one(r) -> float:
    return max(abs(r["cispo/ratio_min"] - 1), abs(r["cispo/ratio_max"] - 1))


def _vllm_child_logging_to(log: Path) -> tuple[int, int] | None:
    """(pid, parent pid) of the vLLM worker whose stderr is `log` (replica k's vllm.<k>.log), else None."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if b"vllm_worker" in (stat.parent / "cmdline").read_bytes() and \
                    os.readlink(stat.parent / "fd" / "2") == str(log):
                return int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return None


def test_joining_keeps_the_sigterm_handler_a_live_refusal_is_one_line_and_close_leaves_the_connection(cluster):
    """In this process, with the in-process torch engine hosted by two actors (no vLLM start)."""
    import ray
    from ray.util.placement_group import placement_group_table

    from megatron_cispo.rollout.engine import EngineStart, Sampling, engine_spec
    from megatron_cispo.rollout.ray_engines import open_ray_pool
    from megatron_cispo.runner.model import ModelConfig

    def ours(signum, frame):  # stands for runner/preempt.py's handler
        pass

    before = signal.signal(signal.SIGTERM, ours)
    try:
        model = ModelConfig(vocab_size=24, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=2,
                            ffn_hidden_size=48)
        start = EngineStart(model=model, precision="fp32", seed=0, max_model_len=16, start_timeout_s=120,
                            call_timeout_s=60)
        pool = open_ray_pool(engine_spec("torch"), lambda k: start, 2, address=cluster, gpus_per_engine=0,
                             on_death="restart")
        assert signal.getsignal(signal.SIGTERM) is ours
        try:
            with pytest.raises(RuntimeError) as e:  # no weights pushed yet: refused, the actor alive
                pool.generate([[1, 2], [3]], Sampling(n=1, max_new_tokens=2, seeds=[0, 10]))
            assert str(e.value).startswith("engine replica 0: Ray replica 0: generating 1 prompts x 1 failed: ")
            assert "\n" not in str(e.value) and pool.restarts == [0, 0]
        finally:
            pool.close()
        assert ray.is_initialized()
        assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
        with pytest.raises(RuntimeError) as e:  # 3 bundles of 1 CPU on a 2-CPU cluster: one line, no hang
            open_ray_pool(engine_spec("torch"), lambda k: start, 3, address=cluster, gpus_per_engine=0, timeout_s=2)
        assert str(e.value).startswith(f"rollout.placement=ray: the Ray cluster at {cluster} could not place 3 "
                                       "engine bundles {'CPU': 1.0} within 2 s; it has {")
    finally:
        signal.signal(signal.SIGTERM, before)


def test_two_ray_actors_serve_half_the_prompts_each_the_ratio_is_1_and_a_killed_actor_is_restarted(
        cluster, model, tmp_path):
    from megatron_cispo.rollout.ray_engines import placement_problem
    from megatron_cispo.runner.data import RolloutConfig

    assert placement_problem(RolloutConfig(engine="vllm", placement="ray", ray_address=cluster)) is None
    run_dir = tmp_path / "run"
    done: dict = {}
    run = threading.Thread(target=lambda: done.update(proc=ranks(2, [
        YAML, f"model.hf_path={model}", f"run.run_dir={run_dir}", "run.steps=4",
        f"data.reward={model.parent / 'spread.py'}:spread", *FAST, "rollout.engines=2", "rollout.placement=ray",
        f"rollout.ray_address={cluster}", "rollout.on_engine_death=restart"], timeout=600, check=False)))
    run.start()
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").is_file() or len(metrics(run_dir)) < 2:
        assert run.is_alive() and time.monotonic() < deadline, done.get("proc")
        time.sleep(0.1)
    found = _vllm_child_logging_to(run_dir / "vllm.1.log")
    assert found, "no vLLM process logs to vllm.1.log"
    engine, actor = found
    os.kill(actor, signal.SIGKILL)  # replica 1's Ray actor, which hosts its vLLM process
    run.join(timeout=600)
    proc = done["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 for r in recs), [r["grad_norm"] for r in recs]
    assert all(_off_one(r) <= 1e-4 for r in recs), [_off_one(r) for r in recs]
    served = served_per_step(recs)  # replica 0 serves one step alone: the fresh actor rejoins at the next push
    assert served[:2] == [(2, 2)] * 2 and sorted(served[2:]) == [(2, 2), (4, 0)], served
    assert all(r["sync/buckets"] >= 10 for r in recs)
    restarts = [r["rollout/engine_restarts"] for r in recs]  # the kill is met at step 3's push or generate, or later
    assert restarts[1] == 0 and restarts[-1] == 1, restarts
    said = [ln for ln in proc.stderr.splitlines() if "engine replica 1 died in" in ln]
    assert len(said) == 1 and "Ray replica 1: its actor died while" in said[0], proc.stderr[-3000:]
    deadline = time.monotonic() + 30  # the old actor's vLLM process died with it
    while Path(f"/proc/{engine}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{engine}").exists(), "the killed actor's vLLM process outlived it"
