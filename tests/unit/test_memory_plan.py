"""runner/memory_plan.py: the per-rank memory plan `train --check` prints, from hand-computed parameter counts,
and the run.gpu_memory_gb refusal. No model is built: --check runs none."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_cispo.config import ConfigError
from megatron_cispo.runner.experiment import load_experiment
from megatron_cispo.runner.memory_parts import Shape, activation_bytes, expert_skew, microbatch_tokens, row_tokens
from megatron_cispo.runner.memory_plan import check_fits, gib, memory_plan
from megatron_cispo.train import EXIT_CONFIG, main

CONFIGS = Path(__file__).resolve().parents[2] / "yaml_configs"
DEMO, TEMPLATE, QWEN8B = (str(CONFIGS / f"{n}.yaml") for n in ("demo_cpu", "gpu_template", "gpu_qwen3_8b"))
MOE, QWEN2_TINY, QWEN30B = (CONFIGS / f"{n}.yaml" for n in ("moe_cpu", "hf_qwen2_tiny", "gpu_qwen3_30b_a3b"))
MATH = CONFIGS / "data" / "math_sample.jsonl"  # the 8B recipe reads ${MATH_PROMPTS}; the override stands in

# demo_cpu.yaml's GPT on one tp=2 rank (vocab 16, hidden 64, ffn 256, 2 layers, 12 learned positions, LayerNorm
# and linear biases): per layer 2*64 (norm) + 64*192/2 + 192/2 (QKV) + 64*64/2 + 64 (proj) + 2*64 (norm)
# + 64*256/2 + 256/2 (fc1) + 256*64/2 + 64 (fc2) = 25184; + 16*64/2 (embedding) + 12*64 (positions)
# + 2*64 (final norm) + 16*64/2 (output layer). The bench measured these bytes from the model itself.
DEMO_PARAMS = 2 * 25184 + 512 + 768 + 128 + 512
# demo_cpu's activations on one tp=2 rank, fp32, one microbatch of 16 rows of 9 tokens packed into one bin of 144
# (parallelism.max_tokens_per_microbatch 160; no SP or CP: no padding), 2 heads of 16 and ffn 128 per rank. Per
# layer, in floats: 2 * 144*64 (LayerNorm input, QKV input) + 144*96 (QKV out) + 144*32 (attention out)
# + 2 * 144*32 (K and V repeated to every head) + 2 * 144*64 (LayerNorm input, fc1 input) + 2 * 144*128 (fc1
# out after its bias, GELU out) = 101376, times 4 bytes; plus the reference attention's fp32 probabilities
# 2*144*144*4 = 165888 bytes of the one [144, 144] block and its bool mask 144*144. Then the larger of the head's
# (final norm input, output layer input, hidden gradient: 3 * 144*64*4, weight gradient 8*64*4 = 112640) and the
# transient scores of one layer (scaled, masked: 2 * 165888, the mask again: 20736 = 352512).
DEMO_ACTIVATIONS = 2 * (101376 * 4 + 165888 + 20736) + 352512


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
    assert rank0.parts["rollout engine"] == int(0.35 * 40 * 2**30)  # the recipe's gpu_memory_utilization
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
    # rank 0: the activations (1.47 MiB) outweigh its bucket (the 0.39 MiB model) and the TP gather's 1 MiB buffer
    assert gib(DEMO_ACTIVATIONS) == "1.47 MiB"
    assert len(err) == 1 and "rank 0 needs 3.6 MiB > run.gpu_memory_gb=0.002: activations 1.47 MiB is the largest " \
        "part; lower parallelism.max_tokens_per_microbatch" in err[0]


def test_packed_rows_attend_across_their_bin_and_padded_rows_within_their_row():
    cfg, plan = _plan(DEMO, 4)
    assert {g.parts["activations"] for g in plan} == {DEMO_ACTIVATIONS}
    # padded [16, 9] microbatches: the reference attention's scores are 16 blocks of [9, 9] (2 heads: 10368 bytes,
    # the mask 81), not one [144, 144]; the head's 112640 bytes then outweigh the transient scores (2*10368 + 81)
    _, plan = _plan(DEMO, 4, "parallelism.max_tokens_per_microbatch=null")
    assert {g.parts["activations"] for g in plan} == {2 * (101376 * 4 + 10368 + 81) + 112640}


def test_sequence_parallel_pads_every_row_and_the_head_workspace_has_each_ranks_real_vocabulary(shipped_env):
    cfg = load_experiment(QWEN2_TINY, [], env=shipped_env(QWEN2_TINY))  # tp 2 + SP, rows of 9 tokens
    assert row_tokens(cfg) == 9 and microbatch_tokens(cfg) == 16 * 10  # each row padded to a multiple of tp
    plan = {r: g for g in memory_plan(cfg, 4, device="cpu") for r in g.ranks}
    # 300 real vocabulary rows padded to 384: tp rank 0 holds 192 real columns, tp rank 1 the other 108; the fused
    # head's workspace is two fp32 blocks of 128 rows (its floor) by those columns
    assert [plan[r].parts["head workspace"] for r in range(4)] == [2 * 128 * c * 4 for c in (192, 108, 192, 108)]
    # per layer, in floats at t=160 (80 rows per rank under SP), 2 heads of 16 and 1 kv head per rank, ffn 48:
    # 3 * 80*64 (RMSNorm input, its x * rstd, QKV input) + 160*64 (QKV out) + 160*48 (q, k after RoPE)
    # + 160*32 (attention out) + 2 * 160*32 (K, V repeated) + 3 * 80*64 (the MLP's norm) + 5 * 160*48 (fc1 out,
    # 2f; SiLU out; x_linear + 0.0; their product) = 102400, times 4; fp32 probabilities 2*160*160*4 and the
    # mask 160*160. Then the transient scores (2 * 204800 + 25600) outweigh the head (240*64*4 + 160*64*4 + 192*64*4)
    assert plan[0].parts["activations"] == 2 * (102400 * 4 + 204800 + 25600) + 2 * 204800 + 25600


def test_prompt_rows_train_one_token_fewer_than_prompt_plus_completion():
    cfg = load_experiment(QWEN8B, [f"data.prompts={MATH}"], env={})
    # data.max_prompt_tokens 512 + rollout.max_new_tokens 2048 = 2560 tokens: 2559 targets, 2560 padded to tp 4
    assert row_tokens(cfg) == 2559 and microbatch_tokens(cfg) == 4 * 2560


def test_moe_experts_keep_their_routed_tokens_at_the_balanced_share():
    cfg = load_experiment(MOE, [], env={})  # ep 2, tp 1, 4 experts of ffn 256 (GELU), top-2, bins of 96 tokens
    s = Shape.of(cfg.model)
    # per layer, in floats: 2 * 96*64 (norm input, QKV input) + 96*192 (QKV out) + 96*64 (attention out)
    # + 2 * 96*64 (K, V repeated) + 2 * 96*64 (norm input, router input) + 96*2 routed copies x (64 (the
    # dispatched token, fc1's input) + 3 * 256 (fc1 out, GELU out, GELU out x router probability)) = 221184, times
    # 4; fp32 probabilities 4*96*96*4, the mask 96*96, the router's fp32 logits and probabilities 2*96*4*4; then the
    # transient scores 2 * 147456 + 9216 outweigh the head (192*64*4 + 96*64*4 + 16*64*4)
    want = 2 * (221184 * 4 + 147456 + 9216 + 3072) + 2 * 147456 + 9216
    assert activation_bytes(cfg, s, in_flight=1, last=True, device="cpu") == want
    # dropless routing: one rank's 2 experts can take every token's both copies from both ranks, 2x the share
    assert expert_skew(cfg, s) == 2.0
    q30 = load_experiment(QWEN30B, [f"data.prompts={MATH}"], env={})
    assert expert_skew(q30, Shape.of(q30.model)) == 8.0  # ep 8, 16 experts per rank, top-8: 8 x 8 of 8 copies


def test_check_says_moe_activations_assume_balanced_routing(capsys):
    assert main(["--check", str(MOE), "--world-size", "2"]) == 0
    assert "#   (MoE: activations at balanced routing; the dropless dispatcher can give one rank's experts up to " \
        "2x their share of the routed tokens)" in capsys.readouterr().out
