"""Megatron's parameter names and how tensor parallelism splits them: what the runner, the HF mapping and
the weight stream share, below all three (hf imports nothing from runner or rollout).

    canonical_names(state)          # TE-spec names -> the local spec's names
    global_param_name(module, n)    # this rank's name -> the layout-independent one (global layer, expert)
    tp_split_dim(n), shard_group(n) # the dim TP splits along; the (group, size, rank) that shards it
"""
from __future__ import annotations

import re

import torch


_GROUPED_EXPERT_PARAM = re.compile(r"(weight|bias)(\d+)")

# Transformer Engine fuses the pre-attention/pre-MLP norms into the next linear layer.
_TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
# TEGroupedMLP keeps expert i's weights as experts.linear_fc1.weight<i>; SequentialMLP as
# experts.local_experts.<i>.linear_fc1.weight (both [out, in] per expert).
_GROUPED_EXPERT = re.compile(r"(.*\.experts)\.(linear_fc[12])\.(weight|bias)(\d+)")


def canonical_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map TE-spec parameter names onto the local spec's names; other names pass through."""
    out = {}
    for name, t in state.items():
        for te, local in _TE_NAMES.items():
            if name.endswith(te):
                name = name[: -len(te)] + local
        grouped = _GROUPED_EXPERT.fullmatch(name)
        if grouped:
            prefix, linear, kind, i = grouped.groups()
            name = f"{prefix}.local_experts.{i}.{linear}.{kind}"
        out[name] = t
    return out


_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")  # TP splits these along dim 1


def tp_split_dim(name: str) -> int:
    """The dim TP splits a tensor-parallel parameter along, from its canonical (local-spec) name:
    1 for row-parallel linears (linear_proj, linear_fc2), 0 for the rest (QKV, fc1, embedding,
    output layer). Read from the name, not a partition_dim attribute, which TE's grouped expert
    linears set by their own rule."""
    return 1 if name.endswith(_ROW_PARALLEL) else 0


def global_param_name(module: torch.nn.Module, name: str) -> str:
    """Map a local parameter name to its layout-independent name (global layer and expert index).

    `decoder.layers.<i>` gets the global layer index; an expert's local index i (SequentialMLP
    `experts.local_experts.<i>`, TEGroupedMLP `experts.linear_fc1.weight<i>`) becomes
    ep_rank * num_local_experts + i.
    """
    from megatron.core.utils import get_pg_rank

    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        owner = module.get_submodule(".".join(parts[: i + 2]))
        parts[i + 1] = str(owner.layer_number - 1)
    if "experts" in parts:
        j = parts.index("experts")
        experts = module.get_submodule(".".join(name.split(".")[: j + 1]))
        offset = get_pg_rank(experts.ep_group) * experts.num_local_experts
        grouped = _GROUPED_EXPERT_PARAM.fullmatch(parts[-1])
        if parts[j + 1] == "local_experts":
            parts[j + 2] = str(offset + int(parts[j + 2]))
        elif grouped:
            parts[-1] = f"{grouped[1]}{offset + int(grouped[2])}"
    return ".".join(parts)


def _is_expert(name: str) -> bool:
    return "experts" in name.split(".")


def sends_param(name: str) -> bool:
    """Whether this rank's copy of parameter `name` is the one a sender streams or saves: data-parallel rank
    0 (with context parallel) for dense parameters, expert-data-parallel rank 0 for experts (EP shards
    them, so each EP rank's experts have their own DP = 0 copy)."""
    from megatron.core import parallel_state as mpu

    if _is_expert(name):
        return mpu.get_expert_data_parallel_rank() == 0
    return mpu.get_data_parallel_rank(with_context_parallel=True) == 0


def shard_group(name: str):
    """(group, size, rank) that shards this parameter: expert TP for experts, TP otherwise."""
    from megatron.core import parallel_state as mpu

    if _is_expert(name):
        return (mpu.get_expert_tensor_parallel_group(), mpu.get_expert_tensor_parallel_world_size(),
                mpu.get_expert_tensor_parallel_rank())
    return (mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_world_size(),
            mpu.get_tensor_model_parallel_rank())
