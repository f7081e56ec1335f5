"""Load a Hugging Face checkpoint into this rank's megatron-core model chunk, reading only its slices.

    check_weights(arch)              # every tensor present with its shape (headers only); ValueError
    load_hf_weights(chunk, arch)     # each parameter = its TP / expert-TP shard, read with get_slice

Each parameter is filled from `mapping.pieces`: row blocks of the HF tensors, sliced on disk by
safetensors' `get_slice` and copied into the parameter's rows one block at a time, file by file, so
a rank never reads tensors of layers, experts or TP shards it does not own (a row-parallel weight,
split along dim 1, still touches every row of its tensor) and holds, besides its parameters, one
block and the pages it touched of one file. The vocabulary padding rows are zeros.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from ..base.param_names import canonical_names, global_param_name, shard_group
from .arch import HFArch
from .mapping import ZEROS, Piece, hf_shapes, pieces


WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"  # as transformers names them


def _weight_files(directory: Path) -> dict[str, list[str]]:
    """safetensors file -> the tensor names to take from it (None: all). With an index, only the
    files its weight_map names, each for the names it maps there (as vLLM reads a directory); a
    model.safetensors the index does not name is refused, since transformers would load it instead."""
    index = directory / INDEX
    if not index.is_file():
        return {str(f): None for f in sorted(directory.glob("*.safetensors"))}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        weight_map = f"{type(e).__name__}: {e}"
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: not a safetensors index with a weight_map ({weight_map}); fix or remove it")
    if (directory / WEIGHTS).is_file() and WEIGHTS not in weight_map.values():
        raise ValueError(f"{directory}: both {WEIGHTS} and {INDEX}, which does not name it; transformers loads "
                         f"model.safetensors, vLLM the index's shards: remove the stale one")
    out: dict[str, list[str]] = {}
    for name, file in sorted(weight_map.items()):
        if not (directory / file).is_file():
            raise ValueError(f"{index} maps {name} to {file}, which is missing from {directory}")
        out.setdefault(str(directory / file), []).append(name)
    return out


@functools.lru_cache(maxsize=16)
def _index(path: str, stamp: float) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF tensor name -> (file, shape), from the safetensors headers of the checkpoint's weight files."""
    from safetensors import safe_open

    files = _weight_files(Path(path))
    if not files:
        raise ValueError(f"model.hf_path={path!r} has no *.safetensors weights (only safetensors are read; "
                         "convert a .bin checkpoint with transformers' save_pretrained)")
    out = {}
    for f, wanted in files.items():
        try:
            with safe_open(f, "pt") as h:
                have = set(h.keys())
                for name in sorted(have) if wanted is None else wanted:
                    if name not in have:
                        raise ValueError(f"{Path(path) / INDEX} maps {name} to {f}, which does not hold it")
                    if name in out:
                        raise ValueError(f"{path}: tensor {name} is in both {out[name][0]} and {f} (no {INDEX} "
                                         "says which to read): remove the stale file")
                    out[name] = (f, tuple(h.get_slice(name).get_shape()))
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a corrupt header
            raise ValueError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    return out


def tensor_index(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF tensor name -> (file, shape) of model directory `path`; ValueError (one line) for an
    inconsistent directory. Cached until a weight file or the index changes."""
    stamp = max((f.stat().st_mtime for f in [*Path(path).glob("*.safetensors"), Path(path) / INDEX] if f.exists()),
                default=0.0)
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
    """The dtype of the checkpoint's tensors (the embedding's), which an export writes back; config.json's
    dtype when the directory holds no weights any more (the export CLI needs only its config)."""
    from safetensors import safe_open

    if not any(Path(arch.path).glob("*.safetensors")):
        return getattr(torch, arch.dtype)
    file, _ = tensor_index(arch.path)["model.embed_tokens.weight"]
    with safe_open(file, "pt") as h:
        return h.get_slice("model.embed_tokens.weight")[0:1].dtype


def _targets(chunk: torch.nn.Module, arch: HFArch) -> list[tuple[Piece, torch.Tensor]]:
    """(piece, the parameter rows it fills) for every parameter of `chunk`, in row order."""
    out = []
    for name, param in chunk.named_parameters():
        gname = next(iter(canonical_names({global_param_name(chunk, name): None})))
        _, size, rank = shard_group(name)
        if not getattr(param, "tensor_model_parallel", False):
            size, rank = 1, 0
        at = 0
        for p in pieces(gname, arch, rank=rank, size=size):
            out.append((p, param[at:at + p.rows]))
            at += p.rows
        if at != param.shape[0]:  # a mapping bug, not bad input: check_weights passed
            raise AssertionError(f"{gname}: the pieces fill {at} rows of a parameter of {list(param.shape)}")
    return out


@torch.no_grad()
def load_hf_weights(chunk: torch.nn.Module, arch: HFArch) -> None:
    """Copy every parameter of `chunk` (one virtual stage of a GPTModel built from `arch`) from the
    checkpoint: this rank's layers, experts and TP (expert-TP) shard only. One safetensors file
    open at a time: the pages a rank maps are at most one file's."""
    from safetensors import safe_open

    check_weights(arch)
    index = tensor_index(arch.path)
    by_file: dict[str, list] = {}
    for p, dst in _targets(chunk, arch):
        if p.name == ZEROS:
            dst.zero_()
        else:
            by_file.setdefault(index[p.name][0], []).append((p, dst))
    for file, todo in sorted(by_file.items()):
        with safe_open(file, "pt") as h:
            for p, dst in todo:  # each block straight into its rows: no assembled copy of the tensor
                sl = h.get_slice(p.name)
                src = sl[p.start:p.stop] if p.cols is None else sl[p.start:p.stop, p.cols.start:p.cols.stop]
                if src.shape != dst.shape:
                    raise AssertionError(f"{p} read {list(src.shape)} for rows of shape {list(dst.shape)}")
                dst.copy_(src)  # casts to the parameter's dtype and device
