"""Shared by test_hf_parity.py and test_hf_layouts.py: tiny Hugging Face models of each family, a
fixed batch of variable-length rows, transformers' own logprobs and gradients on it (the reference,
mapped to megatron's names by hf.mapping.from_hf), and gradients out of megatron's schedule.

transformers 5 keeps a MoE layer's experts fused (gate_up_proj [E, 2f, h], down_proj [E, h, f]) while
the checkpoint stores them per expert; `hf_state` unfuses them and checks the result against the
file, so the reference is keyed exactly as the checkpoint is.
"""
from __future__ import annotations

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")  # every family hf/arch.py builds
# untied, tied + qkv bias, qk-norm, experts: the layouts beyond tp (mistral maps as llama does)
CORE = ("llama", "qwen2", "qwen3", "qwen3_moe")
N, S = 4, 15
LENGTHS = [16, 7, 12, 10]  # real tokens per row (odd and even: CP / SP padding is exercised)


def make_models(root) -> dict[str, str]:
    """family -> a tiny random model directory under `root` (seeded: the same on every call), and
    "qwen3_moe_unnorm": qwen3_moe's weights with norm_topk_prob=false (megatron's pre-softmax router)."""
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    paths = {f: str(make_tiny_hf(f, root / f, seed=1)) for f in FAMILIES}
    return {**paths, "qwen3_moe_unnorm": with_config(paths["qwen3_moe"], root / "qwen3_moe_unnorm",
                                                     norm_topk_prob=False)}


def with_config(path: str, out, **changes) -> str:
    """A copy of the model directory `path` at `out` with config.json's keys set to `changes`."""
    import json
    import shutil

    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    assert set(changes) <= set(config), f"{set(changes) - set(config)} not in {path}/config.json"
    (out / "config.json").write_text(json.dumps({**config, **changes}, indent=2))
    return str(out)


def make_deep_sharded(root) -> str:
    """An 8-layer qwen2 (tied) saved in several safetensors files with their index (pp=4 x vp=2)."""
    import transformers

    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    path = make_tiny_hf("qwen2", root / "single", seed=2, layers=8)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.save_pretrained(root / "sharded", max_shard_size="60KB")
    assert len(list((root / "sharded").glob("*.safetensors"))) > 2
    return str(root / "sharded")


def make_batch(vocab: int, seed: int = 5):
    """tokens [N, S+1] (ids over the whole real vocabulary), lengths [N], loss_mask [N, S] on every
    real target."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (N, S + 1), generator=g)
    lengths = torch.tensor(LENGTHS)
    loss_mask = torch.arange(S)[None] < lengths[:, None] - 1
    return tokens, lengths, loss_mask


def hf_state(model, path: str) -> dict[str, torch.Tensor]:
    """name -> tensor (a parameter, or its .grad after unfuse_grads) keyed as the checkpoint is."""
    return _unfuse(model, path, lambda p: p.detach())


def hf_grads(model, path: str) -> dict[str, torch.Tensor]:
    return _unfuse(model, path, lambda p: p.grad)


def _unfuse(model, path, get) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = get(p)
        if name.endswith("experts.gate_up_proj"):  # [E, 2f, h]: rows [gate; up] per expert
            f = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :f]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, f:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e]
        else:
            out[name] = t
    return out


def hf_reference(path: str, tokens, lengths, loss_mask):
    """transformers' forward of every row alone: (logprobs [N, S] fp32, 0 off the mask; gradients
    of their masked sum, as full megatron tensors under megatron's global names)."""
    import transformers
    from pathlib import Path

    from safetensors.torch import load_file

    from megatron_cispo.hf.arch import read_arch
    from megatron_cispo.hf.mapping import from_hf

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    file = {k: v for f in Path(path).glob("*.safetensors") for k, v in load_file(f).items()}
    for name, t in hf_state(model, path).items():  # the unfusing convention, checked against the file
        assert torch.equal(t, file[name]), name
    model.zero_grad()
    out = torch.zeros(loss_mask.shape)
    for i, length in enumerate(lengths.tolist()):
        logits = model(tokens[i:i + 1, :length - 1]).logits[0].float()
        lp = torch.log_softmax(logits, -1).gather(-1, tokens[i, 1:length, None])[:, 0]
        (lp * loss_mask[i, :length - 1]).sum().backward()
        out[i, :length - 1] = lp.detach() * loss_mask[i, :length - 1]
    return out, from_hf(hf_grads(model, path), read_arch(path))


def megatron_grads(chunks, batch, step_cfg, vocab_size: int) -> dict[str, torch.Tensor]:
    """d(sum of masked logprobs)/d(every parameter), through megatron's schedule and its grad
    finalisation (DP / SP / tied-embedding all-reduces), as full tensors under global names.
    Overwrites the parameters with their gradients (the model is spent afterwards)."""
    from megatron.core import parallel_state as mpu

    from megatron_cispo.base.weights import gather_full_state
    from megatron_cispo.step.forward import forward_step_for, run_schedule
    from megatron_cispo.step.head import head_logprobs
    from megatron_cispo.step.packing import microbatches, step_layout

    def loss_func(mb, output):
        lp = head_logprobs(mb, output, temperature=1.0, vocab_size=vocab_size, entropy=False)
        # num_tokens 0: megatron leaves the summed gradient unscaled (no per-token division)
        return lp.sum(), torch.zeros((), dtype=torch.int), {}

    for c in chunks:
        c.zero_grad_buffer()
    mbs = microbatches(batch, None, step_cfg, step_layout(chunks, step_cfg), mpu.get_data_parallel_group())
    run_schedule(chunks, forward_step_for(loss_func), mbs, forward_only=False)
    with torch.no_grad():
        for c in chunks:
            for p in c.module.parameters():
                p.copy_(p.main_grad)
    return gather_full_state(chunks)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are zero)."""
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    return diff / scale if scale else diff
