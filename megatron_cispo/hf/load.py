"""Load a Hugging Face checkpoint into this rank's megatron-core model chunk, reading only its slices.

    check_weights(arch)              # every tensor present with its shape (headers only); ValueError
    load_hf_weights(chunk, arch)     # each parameter = its TP / expert-TP shard, read with get_slice

Each parameter is filled from `mapping.pieces`: row blocks of the HF tensors, sliced on disk by
safetensors' `get_slice` and copied into the parameter's rows one block at a time, so a rank never
reads tensors of layers, experts or TP shards it does not own (a row-parallel weight, split along
dim 1, still touches every row of its tensor) and never holds more than one block besides its
parameters. The vocabulary padding rows are zeros.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..runner.weights import canonical_names, global_param_name, shard_group
from .arch import HFArch
from .mapping import ZEROS, Piece, hf_shapes, pieces


@functools.lru_cache(maxsize=16)
def _index(path: str, stamp: float) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF tensor name -> (file, shape), from the safetensors headers of every *.safetensors in `path`."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.hf_path={path!r} has no *.safetensors weights (only safetensors are read; "
                         "convert a .bin checkpoint with transformers' save_pretrained)")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as h:
                for name in h.keys():
                    out[name] = (str(f), tuple(h.get_slice(name).get_shape()))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a corrupt header
            raise ValueError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    return out


def tensor_index(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    stamp = max((f.stat().st_mtime for f in Path(path).glob("*.safetensors")), default=0.0)
    return _index(str(path), stamp)


def check_weights(arch: HFArch) -> None:
    """ValueError (one line) naming the first tensor config.json needs that is missing or mis-shaped."""
    index = tensor_index(arch.path)
    for name, shape in hf_shapes(arch).items():
        if name not in index:
            raise ValueError(f"{arch.path}: tensor {name} is missing (expected shape {list(shape)} from config.json)")
        file, have = index[name]
        if have != shape:
            raise ValueError(f"{file}: {name} has shape {list(have)}; config.json implies {list(shape)}")


def source_dtype(arch: HFArch) -> torch.dtype:
    """The dtype of the checkpoint's tensors (the embedding's), which an export writes back."""
    from safetensors import safe_open

    file, _ = tensor_index(arch.path)["model.embed_tokens.weight"]
    with safe_open(file, "pt") as h:
        return h.get_slice("model.embed_tokens.weight")[0:1].dtype


@torch.no_grad()
def load_hf_weights(chunk: torch.nn.Module, arch: HFArch) -> None:
    """Copy every parameter of `chunk` (one virtual stage of a GPTModel built from `arch`) from the
    checkpoint: this rank's layers, experts and TP (expert-TP) shard only."""
    from safetensors import safe_open

    check_weights(arch)
    index = tensor_index(arch.path)
    handles: dict[str, object] = {}

    def read(p: Piece) -> torch.Tensor:
        file = index[p.name][0]
        if file not in handles:
            handles[file] = safe_open(file, "pt")
        sl = handles[file].get_slice(p.name)
        return sl[p.start:p.stop] if p.cols is None else sl[p.start:p.stop, p.cols.start:p.cols.stop]

    for name, param in chunk.named_parameters():
        gname = next(iter(canonical_names({global_param_name(chunk, name): None})))
        _, size, rank = shard_group(name)
        if not getattr(param, "tensor_model_parallel", False):
            size, rank = 1, 0
        parts = pieces(gname, arch, rank=rank, size=size)
        at = 0
        for p in parts:  # straight into the parameter's rows: no assembled copy of the whole tensor
            dst = param[at:at + p.rows]
            src = None if p.name == ZEROS else read(p)
            if dst.shape[0] != p.rows or (src is not None and src.shape != dst.shape):
                # a mapping bug, not bad input: check_weights passed
                raise AssertionError(f"{gname}: piece {p} does not fit rows {at}.. of a parameter of "
                                     f"{list(param.shape)}")
            if src is None:
                dst.zero_()
            else:
                dst.copy_(src)  # casts to the parameter's dtype and device
            at += p.rows
        if at != param.shape[0]:
            raise AssertionError(f"{gname}: the pieces fill {at} of {param.shape[0]} rows")
