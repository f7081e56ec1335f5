"""Write a Hugging Face model directory (what transformers, vLLM and SGLang load) from the trained model.

    write_hf_dir(to_hf(full_state, arch), arch, "runs/x/hf/step_10")   # one process: the files
    export_chunks(chunks, arch, "runs/x/hf/step_10")                   # collective: streamed, rank 0 writes

The directory holds the source model's config.json (unchanged), its generation config and tokenizer
files, MARKER (the step, the source, this package's version), and the weights in safetensors: `model.safetensors`, or shards `model-0000k-of-0000n.safetensors`
with `model.safetensors.index.json` above `max_shard_bytes`, named and indexed as transformers'
save_pretrained does. It is written into `.<name>.tmp` beside it, every file and the directory
fsynced, then renamed into place (base/files.py's replace_dir), so a reader never sees half of one.
Only an earlier export is ever replaced, and never the source directory (check_out).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import Tensor

from ..base import files as durable
from .arch import HFArch
from .load import INDEX, WEIGHTS  # noqa: F401 - the names this module writes; tests read them here

MAX_SHARD_BYTES = 5 * 2**30  # transformers' and the hub's usual shard size
# written into every export: proof that a directory is ours to replace (a user's model never is);
# loaders ignore files they do not know
MARKER = "megatron_cispo_export.json"
# files of a model directory that are not weights and that loaders read: config, generation
# defaults, tokenizers (fast, sentencepiece, BPE vocab/merges, tiktoken) and chat templates
COPIED = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
          "vocab.*", "merges.txt", "*.tiktoken", "spiece.model", "chat_template*")


def copied_files(source: Path) -> list[Path]:
    """The non-weight files of model directory `source` that an export carries over."""
    found = {p for pattern in COPIED for p in source.glob(pattern) if p.is_file()}
    return sorted(found)


def check_out(out_dir, source) -> None:
    """ValueError (one line) unless writing `out_dir` is safe: it must not be, contain or lie inside
    the source model directory `source` (model.hf_path), and an existing non-empty directory there is
    replaced only if an export wrote it (it holds MARKER)."""
    out, src = Path(out_dir).resolve(), Path(source).resolve()
    where = "is" if out == src else "contains" if out in src.parents else "lies inside" if src in out.parents else None
    if where:
        raise ValueError(f"{out_dir} {where} the source model directory {source} (model.hf_path), which an "
                         "export must never touch: choose a path outside it")
    if out.exists() and not (out.is_dir() and ((out / MARKER).is_file() or not any(out.iterdir()))):
        raise ValueError(f"{out_dir} exists and is not a megatron_cispo export (no {MARKER}); it would be "
                         "replaced whole: choose a new path, or remove it yourself")


def tmp_dir(out_dir: Path) -> Path:
    return out_dir.with_name(f".{out_dir.name}.tmp")


def write_hf_dir(hf_tensors: dict[str, Tensor], arch: HFArch, out_dir, *, dtype: torch.dtype | None = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES, step: int | None = None) -> Path:
    """Write `hf_tensors` (HF name -> tensor, any dtype and device) and arch.path's config and tokenizer
    files to `out_dir`, replacing an existing export only once the new one is complete; returns out_dir.
    Tensors are cast to `dtype` (default: the source checkpoint's, hf.load.source_dtype). MARKER records
    `step` (the optimizer steps the weights have), the source directory and this package's version.
    ValueError if check_out refuses out_dir; on any failure the temporary directory is removed, an
    existing out_dir is untouched, and the error raised."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from .load import source_dtype

    dtype = dtype or source_dtype(arch)

    def weights(tmp: Path) -> None:
        tensors = {name: t.detach().to(device="cpu", dtype=dtype).contiguous() for name, t in hf_tensors.items()}
        split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=max_shard_bytes)
        for file, names in split.filename_to_tensors.items():
            save_file({n: tensors[n] for n in names}, str(tmp / file), metadata={"format": "pt"})
            durable.fsync_path(tmp / file)
        if split.is_sharded:
            _write_index(tmp, split.tensor_to_filename, split.metadata["total_size"],
                         sum(t.numel() for t in tensors.values()))
    return _write_dir(arch, out_dir, step, weights)


def _write_index(tmp: Path, weight_map: dict, total_size: int, total_parameters: int) -> None:
    index = {"metadata": {"total_parameters": total_parameters, "total_size": total_size}, "weight_map": weight_map}
    text = json.dumps(index, indent=2, sort_keys=True) + "\n"
    durable.write_durable(tmp / INDEX, lambda f: f.write(text.encode()))


def _write_dir(arch: HFArch, out_dir, step, weights) -> Path:
    """out_dir written through `.<name>.tmp`: the source's config and tokenizer files, MARKER, then
    weights(tmp) (the safetensors and index); renamed into place when complete, removed on failure."""
    from .. import __version__

    out = Path(out_dir)
    check_out(out, arch.path)
    tmp = tmp_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)  # left by an export that crashed
    try:
        tmp.mkdir(parents=True)
        for src in copied_files(Path(arch.path)):
            durable.write_durable(tmp / src.name, lambda f, s=src: f.write(s.read_bytes()))
        mark = json.dumps({"megatron_cispo": __version__, "source": str(arch.path), "step": step}, indent=2) + "\n"
        durable.write_durable(tmp / MARKER, lambda f: f.write(mark.encode()))
        weights(tmp)
        durable.replace_dir(tmp, out)
        durable.fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_hf_stream(tensors, arch: HFArch, out_dir, *, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES, step: int | None = None) -> Path:
    """write_hf_dir for tensors that arrive one by one ((HF name, tensor) pairs, each complete): a shard
    is written as soon as it is full (the same greedy split as save_pretrained, in arrival order), so
    this holds one shard, never the model. The same directory, files and guarantees as write_hf_dir."""
    from safetensors.torch import save_file

    from .load import source_dtype

    dtype = dtype or source_dtype(arch)

    def weights(tmp: Path) -> None:
        files, shard, size, total, params = [], {}, 0, 0, 0

        def flush():
            nonlocal shard, size
            if shard:
                files.append((tmp / f".part-{len(files)}.safetensors", sorted(shard)))
                save_file(shard, str(files[-1][0]), metadata={"format": "pt"})
                durable.fsync_path(files[-1][0])
            shard, size = {}, 0
        for name, t in tensors:
            t = t.detach().to(device="cpu", dtype=dtype).contiguous()
            n = t.numel() * t.element_size()
            if shard and size + n > max_shard_bytes:
                flush()
            shard[name], size, total, params = t, size + n, total + n, params + t.numel()
        flush()
        if len(files) == 1:
            files[0][0].rename(tmp / WEIGHTS)
        else:
            weight_map = {}
            for k, (part, names) in enumerate(files, 1):
                final = f"model-{k:05d}-of-{len(files):05d}.safetensors"
                part.rename(tmp / final)
                weight_map.update({n: final for n in names})
            _write_index(tmp, weight_map, total, params)
        durable.fsync_path(tmp)
    return _write_dir(arch, out_dir, step, weights)
