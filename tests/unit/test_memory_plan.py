"""runner/memory_plan.py: the per-rank memory plan `train --check` prints, from hand-computed parameter counts,
and the run.gpu_memory_gb refusal. No model is built: --check runs none."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_cispo.config import ConfigError
from megatron_cispo.runner.experiment import load_experiment
from megatron_cispo.runner.memory_plan import check_fits, gib, memory_plan
from megatron_cispo.train import EXIT_CONFIG, main

CONFIGS = Path(__file__).resolve().parents[2] / "yaml_configs"
DEMO, TEMPLATE, QWEN8B = (str(CONFIGS / f"{n}.yaml") for n in ("demo_cpu", "gpu_template", "gpu_qwen3_8b"))
MATH = CONFIGS / "data" / "math_sample.jsonl"  # the 8B recipe reads ${MATH_PROMPTS}; the override stands in

# demo_cpu.yaml's GPT on one tp=2 rank (vocab 16, hidden 64, ffn 256, 2 layers, 12 learned positions, LayerNorm
# and linear biases): per layer 2*64 (norm) + 64*192/2 + 192/2 (QKV) + 64*64/2 + 64 (proj) + 2*64 (norm)
# + 64*256/2 + 256/2 (fc1) + 256*64/2 + 64 (fc2) = 25184; + 16*64/2 (embedding) + 12*64 (positions)
# + 2*64 (final norm) + 16*64/2 (output layer). The bench measured these bytes from the model itself.
DEMO_PARAMS = 2 * 25184 + 512 + 768 + 128 + 512


def _plan(path, world, *overrides, device="cpu"):
    cfg = load_experiment(path, list(overrides), env={})
    return cfg, memory_plan(cfg, world, device=device)


def test_weights_gradients_and_adam_state_of_a_known_fp32_model():
    _, plan = _plan(DEMO, 4)
    assert DEMO_PARAMS == 52288
    for g in plan:  # every rank holds the same shards: fp32 weights, fp32 grad buffer, Adam's two fp32 moments
        assert (g.parts["weights"], g.parts["gradients"], g.parts["optimizer state"]) == \
            (4 * DEMO_PARAMS, 4 * DEMO_PARAMS, 8 * DEMO_PARAMS)


def test_bf16_parameters_add_fp32_master_weights_and_keep_fp32_gradients():
    _, plan = _plan(DEMO, 4, "model.dtype=bf16")
    g = plan[0]
    assert (g.parts["weights"], g.parts["gradients"], g.parts["optimizer state"]) == \
        (2 * DEMO_PARAMS, 4 * DEMO_PARAMS, 12 * DEMO_PARAMS)


@pytest.mark.parametrize("world,dp", [(4, 2), (8, 4)])
def test_the_distributed_optimizer_divides_the_optimizer_state_by_dp(world, dp):
    _, plan = _plan(DEMO, world, "optimizer.distributed=true", "model.dtype=bf16", "rollout.prompts_per_step=32")
    assert {g.parts["optimizer state"] for g in plan} == {12 * DEMO_PARAMS // dp}
    assert {g.parts["gradients"] for g in plan} == {4 * DEMO_PARAMS}  # the grad buffer is whole on every rank


def test_pipeline_stages_differ_by_the_embedding_and_the_output_layer():
    cfg, plan = _plan(TEMPLATE, 16)  # tp 2 x pp 2 x dp 4, bf16, learned positions of 2048 rows, hidden 2048
    first = next(g for g in plan if g.stage == 0)
    last = next(g for g in plan if g.stage == 1)
    # stage 0: the embedding shard + the position table; stage 1: the final LayerNorm + the output layer shard
    assert first.parts["weights"] - last.parts["weights"] == 2 * (2048 * 2048 - 2 * 2048)
    assert first.ranks == [0] and last.ranks[0] == 8  # megatron's order: pp is the outermost dimension
    assert sorted(r for g in plan for r in g.ranks) == list(range(16))


def test_rank_0_holds_the_in_process_engine_and_the_senders_hold_buckets():
    cfg, plan = _plan(DEMO, 4)
    by_rank = {r: g for g in plan for r in g.ranks}
    full = 2 * (2 * 64 + 64 * 192 + 192 + 64 * 64 + 64 + 2 * 64 + 64 * 256 + 256 + 256 * 64 + 64) + 16 * 64 * 2 \
        + 12 * 64 + 2 * 64  # the unsharded model: the same sums at tp=1
    assert by_rank[0].parts["rollout engine"] == 2 * full  # rollout.precision: bf16
    # its bucket holds what it sends, the fp32 model gathered over TP (far below rollout.sync_bucket_mb's 256 MiB),
    # plus the TP gather's buffer (1 MiB at least: the largest shard is 32 KiB); no other rank sends: no receive buffer
    assert by_rank[0].parts["weight-sync buckets"] == 4 * full + 2**20
    _, plan = _plan(DEMO, 4, "rollout.sync_bucket_mb=0.25")  # a bucket smaller than the model: a bucket
    assert {r: g.parts["weight-sync buckets"] for g in plan for r in g.ranks}[0] == 2**18 + 2**20
    assert by_rank[1].parts["weight-sync buckets"] == 0  # TP rank 1 sends its rows to rank 0's gather
    assert by_rank[1].parts["lagged versions"] == 3 * 4 * DEMO_PARAMS  # staleness 2: the live copy and 2 older
    assert by_rank[2].parts.get("lagged versions", 0) == 0 and "rollout engine" not in by_rank[2].parts


def test_every_rank_holds_the_global_batch_and_its_dp_shard():
    cfg, plan = _plan(DEMO, 4)  # 16 prompts x 4 samples, per-token credit, the reverse task's fixed-length rows
    r = cfg.rollout
    t = r.total_len - 1  # targets per row
    # int64 tokens and length and version, bool mask, fp32 logprobs, per-token fp32 advantages, fp32 reward,
    # bool correctness per answer token
    row = 8 * (t + 1) + t + 4 * t + 4 * t + 8 + 8 + 4 + r.answer_len
    for g in plan:  # the step's batch and its half (dp 2); the next one and its pickled bytes while sampling
        assert g.parts["rollout batch"] == 64 * row + 32 * row and g.parts["batch broadcast"] == 2 * 64 * row


def test_rank_0_receives_the_largest_other_senders_bucket():
    cfg, plan = _plan(str(CONFIGS / "moe_cpu.yaml"), 2)  # ep 2: rank 1 sends its experts, rank 0 the rest
    by_rank = {r: g for g in plan for r in g.ranks}
    m = cfg.model  # each rank holds half of every layer's experts: an unbiased, ungated fc1 and fc2 each
    experts = m.num_layers * m.num_moe_experts // 2 * 2 * m.hidden_size * m.ffn_size
    assert by_rank[1].parts["weight-sync buckets"] == 4 * experts  # fp32, far below a 256 MiB bucket
    dense_and_experts = by_rank[0].parts["weight-sync buckets"] - 4 * experts  # its own bucket, then rank 1's
    assert dense_and_experts == by_rank[0].parts["weights"]  # tp 1: rank 0 sends every parameter it holds


def test_a_recipe_over_gpu_memory_gb_is_refused_naming_the_largest_part():
    # Qwen3-8B at tp 4 x dp 2 with the plain optimizer: ~2.05B parameters per rank, 12 bytes each of optimizer state
    cfg, plan = _plan(QWEN8B, 8, f"data.prompts={MATH}", "optimizer.distributed=false", "run.gpu_memory_gb=40",
                      device="cuda")
    trainers = [g for g in plan if 0 not in g.ranks]  # rank 0 also gives vLLM its share of the GPU
    worst = max(trainers, key=lambda g: g.total)
    params = worst.parts["weights"] // 2
    assert worst.parts["optimizer state"] == 12 * params and 2.0e9 < params < 2.1e9
    with pytest.raises(ConfigError) as e:
        check_fits(cfg, trainers)
    assert str(e.value) == (f"rank {worst.ranks[0]} needs {gib(worst.total)} > run.gpu_memory_gb=40: "
                            f"optimizer state {gib(12 * params)} is the largest part; set "
                            "optimizer.distributed: true (sharded over dp x cp), or raise parallelism.tp/pp")
    rank0 = next(g for g in plan if 0 in g.ranks)
    assert rank0.parts["rollout engine"] == int(0.4 * 40 * 2**30)  # the recipe's gpu_memory_utilization
    cfg, plan = _plan(QWEN8B, 8, f"data.prompts={MATH}", "rollout.vllm.gpu_memory_utilization=0.9",
                      "run.gpu_memory_gb=200", device="cuda")
    with pytest.raises(ConfigError, match=r"^rank 0 needs .* > run.gpu_memory_gb=200: rollout engine 180 GiB is the "
                                          r"largest part; lower rollout.vllm.gpu_memory_utilization"):
        check_fits(cfg, plan)
    cfg, plan = _plan(QWEN8B, 8, f"data.prompts={MATH}", "run.gpu_memory_gb=1000", device="cuda")
    check_fits(cfg, plan)  # fits: no error


def test_gpu_memory_gb_must_be_positive():
    with pytest.raises(ConfigError, match=r"run.gpu_memory_gb must be finite and > 0 \(GiB\), or null, got -1"):
        load_experiment(DEMO, ["run.gpu_memory_gb=-1"], env={})


def test_check_prints_the_plan_and_refuses_in_one_line(capsys):
    assert main(["--check", DEMO, "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "# memory per rank (estimate; model: fp32, optimizer: adam, head: fused, tokens/microbatch: 144" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("#   ranks ")]
    assert [ln.split(":")[0] for ln in lines] == ["#   ranks 0 (pp stage 0)", "#   ranks 1 (pp stage 0)",
                                                   "#   ranks 2-3 (pp stage 0)"]
    assert "weights 0.199 MiB, gradients 0.199 MiB, optimizer state 0.399 MiB" in lines[2]
    assert main(["--check", DEMO, "--world-size", "4", "run.gpu_memory_gb=0.002"]) == EXIT_CONFIG
    err = capsys.readouterr().err.strip().splitlines()
    # rank 0: its bucket (the 0.39 MiB model) and the TP gather's 1 MiB buffer outweigh the activations
    assert len(err) == 1 and "rank 0 needs 3.6 MiB > run.gpu_memory_gb=0.002: weight-sync buckets 1.39 MiB is " \
        "the largest part; lower rollout.sync_bucket_mb" in err[0]
