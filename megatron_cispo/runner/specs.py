"""Layer and block specs for our GPT: megatron's local spec (dense or MoE) with the reference core
attention and SP-capable norms, or the Transformer Engine spec.

    layer = layer_spec(model_cfg); block = block_spec(layer, transformer_cfg, vp_stage)
The local spec runs on CPU: ReferenceCoreAttention (attention.py) takes packed THD sequences and
context parallelism, which megatron's local DotProductAttention refuses; on GPU use the TE spec.
"""
from __future__ import annotations

from dataclasses import replace

import torch


def grouped_gemm(cfg) -> bool:
    """Grouped-GEMM experts (TEGroupedMLP) only where they really run: the TE spec, on CUDA, with
    TE's grouped linear. Everywhere else the experts are a SequentialMLP of local MLPs."""
    if cfg.num_moe_experts is None or cfg.transformer_impl != "te" or not torch.cuda.is_available():
        return False
    try:
        from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear
    except Exception:  # noqa: BLE001 - a broken optional install counts as absent
        return False
    return TEColumnParallelGroupedLinear is not None


class TorchNorm:
    """megatron's WrappedTorchNorm (torch LayerNorm / RMSNorm) that also allows sequence parallelism.

    WrappedTorchNorm, the local spec's norm without Apex, asserts `not config.sequence_parallel`.
    Under SP each TP rank normalises its own sequence slice, so the (replicated) weights get partial
    gradients; `finalize_model_grads` sums them over TP for parameters marked `sequence_parallel`,
    as Apex's FusedLayerNorm and TE's norms mark theirs. This does the same.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_cls(hidden_size, eps=eps)  # dtype as WrappedTorchNorm leaves it
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def _torch_norm_for(norm):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return TorchNorm if norm is WrappedTorchNorm else norm


def layer_spec(cfg):
    """The transformer layer spec for a runner.model.ModelConfig: megatron's local spec (MoE with
    SequentialMLP experts when configured) with ReferenceCoreAttention, or the TE spec (its own
    attention does THD and CP). The one place a layer spec is chosen."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from .attention import with_reference_attention  # imports megatron-core: only when building

    qk_norm = cfg.arch.qk_norm if cfg.hf_path else False  # Qwen3: RMSNorm on each head's q and k
    if cfg.transformer_impl == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.num_moe_experts, moe_grouped_gemm=grouped_gemm(cfg), qk_layernorm=qk_norm)
    spec = specs.get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False,
                                          qk_layernorm=qk_norm)
    sub = spec.submodules
    attn = sub.self_attention
    attn = replace(attn, submodules=replace(
        attn.submodules, q_layernorm=_torch_norm_for(attn.submodules.q_layernorm),
        k_layernorm=_torch_norm_for(attn.submodules.k_layernorm)))
    return with_reference_attention(replace(spec, submodules=replace(
        sub, input_layernorm=_torch_norm_for(sub.input_layernorm), self_attention=attn,
        pre_mlp_layernorm=_torch_norm_for(sub.pre_mlp_layernorm))))


def block_spec(layer, tcfg, vp_stage: int | None):
    """The decoder block for the layer spec `layer`. megatron takes the final norm from the installed
    backends (TE, else Apex, else WrappedTorchNorm); without either it is TorchNorm here, so that
    sequence parallelism works."""
    from megatron.core.transformer import transformer_block as tb

    final_norm = _torch_norm_for(tb.LayerNormImpl)
    if final_norm is tb.LayerNormImpl:
        return layer
    n = tb.get_num_layers_to_build(tcfg, vp_stage=vp_stage)
    return tb.TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=final_norm)
