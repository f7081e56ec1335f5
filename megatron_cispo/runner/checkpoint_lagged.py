"""A sampler's lagged policy versions in a checkpoint, sharded like the model (rollout.sync: stream, sync mode,
rollout.staleness k > 0): each rank that keeps shards of the last k versions (DP = CP = 0) saves them under
the model's own sharded-tensor metadata with another key, so dist_checkpointing writes each shard once and
reshards it on a resume at another layout, and no rank ever holds a whole version.

    sd.update(lagged_state_dict(model_sd, chunks, "sampler", {7: shards_v7, 8: shards_v8}))   # save
    sd.update(lagged_state_dict(model_sd, chunks, "sampler", {7: None, 8: None}))             # load into
    sampler.load_lagged(lagged_from_state(chunks, "sampler", [7, 8], loaded))
"""
from __future__ import annotations

import torch

from ..base.param_names import sends_param


def _param_slots(chunks) -> dict:
    """{(data_ptr, shape): (chunk index, local parameter name)} of every parameter, named as a sampler keeps
    its lagged shards (getattr(chunk, "module", chunk).named_parameters())."""
    return {(p.data_ptr(), tuple(p.shape)): (i, n) for i, c in enumerate(chunks)
            for n, p in getattr(c, "module", c).named_parameters()}


def lagged_state_dict(model_sd: dict, chunks, name: str, held: dict) -> dict:
    """Sharded entries for `held` ({version: per chunk {local parameter name: tensor}}, None: an empty
    one to load into): the sharded tensors of `model_sd` (the chunks' sharded state dict: their keys,
    shapes and replica ids) with another key prefix and the version's data, so a lagged version is saved
    and resharded exactly as the model is. Keys "<name>_lagged/v<version>/<chunk>:<parameter>"."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    slots, out = _param_slots(chunks), {}

    def walk(node):
        if isinstance(node, dict):
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, (ShardedTensor, ShardedTensorFactory)):
            slot = slots.get((node.data.data_ptr(), tuple(node.data.shape)))
            if slot is not None:  # a parameter (buffers and extra state stay the model's)
                yield slot, node

    for slot, node in walk(model_sd):
        for v, tensors in held.items():
            kept_here = sends_param(slot[1]) if tensors is None else slot[1] in tensors[slot[0]]
            if not kept_here:
                continue  # another rank's copy is the one kept (sends_param: DP = 0, expert DP = 0 for experts)
            data = torch.empty_like(node.data) if tensors is None else tensors[slot[0]][slot[1]]
            out[f"{name}_lagged/v{v}/{slot[0]}:{slot[1]}"] = replace(node, key=f"{name}_lagged.v{v}.{node.key}", data=data)
    return out


def lagged_from_state(chunks, name: str, versions: list, state: dict) -> dict:
    """The loaded lagged versions, {version: per chunk {local parameter name: tensor}} (None where this
    rank loaded none)."""
    out = {}
    for v in versions:
        got = {k.rsplit("/", 1)[1]: t for k, t in state.items() if k.startswith(f"{name}_lagged/v{v}/")}
        if not got:
            out[v] = None
            continue
        per_chunk = [{} for _ in chunks]
        for key, tensor in got.items():
            i, _, param = key.partition(":")
            per_chunk[int(i)][param] = tensor
        out[v] = per_chunk
    return out
