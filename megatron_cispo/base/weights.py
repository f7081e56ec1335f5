"""Layout-independent weights: every parameter under its global name, however the model is split.

    init_layout_independent(chunk, seed=0, std=0.02)   # the same model on every (tp, pp, dp, ep) layout
    full = gather_full_state(chunks)                   # every parameter, unsharded, on every rank
A parameter's global name carries the global layer index and the global expert index; its value
is drawn from a seed keyed by that name, then sliced to this rank's TP (or expert-TP) shard.
"""
from __future__ import annotations

import hashlib

import torch

from .param_names import canonical_names, global_param_name, shard_group, tp_split_dim


def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_layout_independent(module: torch.nn.Module, *, seed: int, std: float) -> None:
    """Fill every parameter from a generator keyed by its global name, then take the TP shard
    (the expert-TP shard for expert weights). Norms are 1, biases 0, matrices N(0, std^2)."""
    for name, p in module.named_parameters():
        gname = global_param_name(module, name)
        _, size, rank = shard_group(name)
        dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
        full_shape = list(p.shape)
        if dim >= 0:
            full_shape[dim] *= size
        gen = torch.Generator().manual_seed(_seed_for(seed, gname))
        if name.endswith("bias"):
            full = torch.zeros(full_shape)
        elif "layernorm" in name or name.endswith("norm.weight") or p.dim() == 1:
            full = torch.ones(full_shape)
        else:
            full = torch.randn(full_shape, generator=gen) * std
        if dim >= 0:
            full = full.chunk(size, dim=dim)[rank]
        p.copy_(full.to(dtype=p.dtype, device=p.device))


@torch.no_grad()
def gather_full_state(chunks) -> dict[str, torch.Tensor]:
    """All parameters under their global names, from every PP stage and every EP rank.

    Names are canonical (local spec: canonical_names maps the TE spec's onto them). TP shards are
    concatenated over the TP group (expert weights over the expert-TP group) along tp_split_dim, a
    gated fc1 as [gate; up], megatron's layout for the full tensor; the per-rank dicts are then
    all-gathered over the whole world, which brings every stage's layers and every EP rank's
    experts to every rank. Collective over the world (all ranks must call it).
    """
    import torch.distributed as dist

    local = {}
    for chunk in chunks:
        mod = getattr(chunk, "module", chunk)
        for name, p in mod.named_parameters():
            t = p.detach().float().cpu()
            group, size, _ = shard_group(name)
            gname = next(iter(canonical_names({global_param_name(mod, name): None})))
            if getattr(p, "tensor_model_parallel", False) and size > 1:
                src = p.detach().float().contiguous()
                parts = [torch.empty_like(src) for _ in range(size)]
                dist.all_gather(parts, src, group=group)
                parts = [x.cpu() for x in parts]
                if mod.config.gated_linear_unit and gname.endswith("linear_fc1.weight"):
                    # rank r holds [gate_r; up_r]: the full tensor is [gate; up]
                    halves = [x.chunk(2, dim=0) for x in parts]
                    parts = [h[0] for h in halves] + [h[1] for h in halves]
                t = torch.cat(parts, dim=tp_split_dim(gname))
            local[gname] = t
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    full = {}
    for d in everyone:
        full.update(d)
    return full
