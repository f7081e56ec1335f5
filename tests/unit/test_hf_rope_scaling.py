"""RoPE scalings megatron-core expresses (hf/arch.py ROPE_TYPES): a llama with `linear` or `llama3`
rope_parameters gives transformers' logits, through our build_model (single process, tp=1)."""
import json
import shutil

import pytest
import torch

from megatron_cispo.testing import spawn

SCALINGS = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
}


def _worker(dirs: dict, n_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model

    distributed.init_distributed(tp=1)
    tokens = torch.randint(0, 300, (1, n_tokens), generator=torch.Generator().manual_seed(0))
    out = {}
    for kind, path in dirs.items():
        cfg = ModelConfig(hf_path=path)
        (chunk,) = build_model(cfg, tp=1, pp=1, wrap_ddp=False)
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            ours = chunk(tokens, torch.arange(n_tokens)[None], None)[..., :cfg.vocab_size]
            theirs = ref(tokens).logits
        out[kind] = ((ours - theirs).abs().max().item(), (theirs - out.get("default_logits", theirs)).abs().max().item())
        if kind == "default":
            out["default_logits"] = theirs
    out.pop("default_logits")
    return out


def test_linear_and_llama3_rope_scaling_give_transformers_logits(tmp_path):
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    base = make_tiny_hf("llama", tmp_path / "llama", seed=3)
    dirs = {}
    for kind, params in SCALINGS.items():
        d = tmp_path / kind
        shutil.copytree(base, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(rope_parameters=params, max_position_embeddings=256)
        (d / "config.json").write_text(json.dumps(cfg))
        dirs[kind] = str(d)
    (res,) = spawn(_worker, world_size=1, args=(dirs, 200))
    for kind, (diff, vs_default) in res.items():
        assert diff <= 1e-5, (kind, diff)
        if kind != "default":  # the scaling changed the logits far beyond the tolerance: the match is not vacuous
            assert vs_default > 50 * max(diff, 1e-6), (kind, diff, vs_default)
