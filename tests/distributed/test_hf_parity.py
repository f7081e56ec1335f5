"""Hugging Face checkpoints loaded on every layout give transformers' own logprobs and gradients.

Each family's tiny model (llama untied, mistral, qwen2 tied with qkv bias, qwen3 qk-norm, qwen3_moe
experts) is built by runner.model.build_model from model.hf_path, so each rank reads only its slices
(hf/load.py), and scored through our path: step.compute_logprobs for the logprobs, megatron's
schedule and grad finalisation for d(sum of logprobs)/d(every parameter). The reference is
transformers' forward and autograd on the same rows (hf_helpers.hf_reference). One launch per
layout runs every family: tp=1 and tp=2 with sequence parallelism (all five), pp=2 and cp=2 with
packed THD bins (mistral maps as llama: left out), and for qwen3_moe ep=2 and tp=2+SP x ep=2 (with
dp=2: each DP rank scores half the rows); pp=4 with vp=2 on an 8-layer qwen2 stored in several
safetensors files. qwen3_moe_unnorm (the same weights with norm_topk_prob=false: megatron's
pre-softmax router) runs at tp=1 and ep=2, and its transformers logprobs differ from qwen3_moe's.
"""
import pytest

from megatron_cispo.testing import spawn

from hf_helpers import CORE, FAMILIES, hf_reference, make_batch, megatron_grads, rel_err

LOGPROB_ATOL = 1e-5
GRAD_REL = 1e-4
LAYOUTS = {  # name: (layout, families, packed)
    "tp1": ({}, FAMILIES + ("qwen3_moe_unnorm",), False),
    "tp2_sp": ({"tp": 2, "sp": True}, FAMILIES, False),
    "pp2": ({"pp": 2}, CORE, False),
    "cp2_packed": ({"cp": 2}, CORE, True),
    "ep2": ({"ep": 2}, ("qwen3_moe", "qwen3_moe_unnorm"), False),
    "tp2_sp_ep2": ({"tp": 2, "sp": True, "ep": 2}, ("qwen3_moe",), False),  # expert TP 2 x EP 2, dp=2
    # interleaved stages (gloo needs pp >= 4 with vp; the schedule >= pp microbatches): stage 0
    # holds layers 0 and 4, stage 3 layers 3 and 7 and the tied output layer
    "pp4_vp2": ({"pp": 4, "vp": 2, "mbs": 1}, ("qwen2_deep_sharded",), False),
}
BUDGET = 24  # tokens per packed bin


def worker(layout: dict, paths: dict, families, packed: bool):
    """Per family: (logprobs [N, S] of the whole batch, full gradients by global name)."""
    from megatron.core import parallel_state as mpu

    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model
    from megatron_cispo.step import Rollouts, StepConfig, compute_logprobs

    tp, pp, cp, ep = (layout.get(k, 1) for k in ("tp", "pp", "cp", "ep"))
    vp = layout.get("vp")
    distributed.init_distributed(tp=tp, pp=pp, cp=cp, ep=ep, vp=vp)
    step_cfg = StepConfig(micro_batch_size=layout.get("mbs", 2), max_tokens_per_microbatch=BUDGET if packed else None)
    dp_rank, dp = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    out = {}
    for family in families:
        cfg = ModelConfig(hf_path=paths[family])
        tokens, lengths, loss_mask = make_batch(cfg.vocab_size)
        full = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=lengths * 0.0, lengths=lengths)
        batch = full.dp_shard(dp_rank=dp_rank, dp=dp, minibatches=1)
        chunks = build_model(cfg, tp=tp, pp=pp, vp=vp, cp=cp, ep=ep, sequence_parallel=layout.get("sp", False))
        lp = compute_logprobs(chunks, batch, step_cfg, vocab_size=cfg.vocab_size)
        grads = megatron_grads(chunks, batch, step_cfg, cfg.vocab_size)
        out[family] = (lp, grads, (dp_rank, dp))
    return out


@pytest.fixture(scope="module")
def references(hf_models):
    from megatron_cispo.hf.arch import read_arch

    return {f: hf_reference(p, *make_batch(read_arch(p).vocab_size)) for f, p in hf_models.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_megatron_matches_transformers_logprobs_and_grads(hf_models, references, name):
    """max |logprob diff| <= 1e-5 on every rank; every parameter's gradient within 1e-4 relative
    (the embedding, qkv, fc1 or each expert's fc1 and fc2, norms, router, output layer)."""
    import torch

    layout, families, packed = LAYOUTS[name]
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1) * layout.get("ep", 1)
    results = spawn(worker, world, (layout, hf_models, families, packed))
    for family in families:
        want_lp, want_grads = references[family]
        for rank, res in enumerate(results):
            lp, grads, (dp_rank, dp) = res[family]
            rows = want_lp.shape[0] // dp
            ref = want_lp[dp_rank * rows:(dp_rank + 1) * rows]
            diff = (lp - ref).abs().max().item()
            assert diff <= LOGPROB_ATOL, f"{name} {family} rank {rank}: logprobs differ by {diff:.3g}"
        grads = results[0][family][1]
        assert set(want_grads) <= set(grads), f"{name} {family}: missing {set(want_grads) - set(grads)}"
        for pname, want in want_grads.items():
            assert grads[pname].shape == want.shape, f"{name} {family} {pname}"
            err = rel_err(grads[pname], want)
            assert err <= GRAD_REL, f"{name} {family} {pname}: gradient relative error {err:.3g}"
            assert torch.isfinite(grads[pname]).all()


def test_router_settings_differ_in_transformers(hf_models, references):
    """norm_topk_prob true and false on the same weights give different transformers logprobs and
    router gradients, so qwen3_moe_unnorm's match above is a test of the pre-softmax router."""
    import json

    for family, want in (("qwen3_moe", True), ("qwen3_moe_unnorm", False)):
        with open(f"{hf_models[family]}/config.json") as f:
            assert json.load(f)["norm_topk_prob"] is want, family
    (lp_norm, g_norm), (lp_raw, g_raw) = references["qwen3_moe"], references["qwen3_moe_unnorm"]
    diff = (lp_norm - lp_raw).abs().max().item()
    assert diff > 1e3 * LOGPROB_ATOL, f"logprobs differ by only {diff:.3g} between the router settings"
    router = [n for n in g_norm if n.endswith("mlp.router.weight")]
    assert router and all(rel_err(g_raw[n], g_norm[n]) > 1e2 * GRAD_REL for n in router)
