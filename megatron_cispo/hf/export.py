"""Write a Hugging Face model directory (what transformers, vLLM and SGLang load) from the trained model.

    write_hf_dir(to_hf(full_state, arch), arch, "runs/x/hf/step_10")   # one process: the files
    export_chunks(chunks, arch, "runs/x/hf/step_10")                   # collective: gather, rank 0 writes

The directory holds the source model's config.json (unchanged), its generation config and tokenizer
files, MARKER (the step, the source, this package's version), and the weights in safetensors: `model.safetensors`, or shards `model-0000k-of-0000n.safetensors`
with `model.safetensors.index.json` above `max_shard_bytes`, named and indexed as transformers'
save_pretrained does. It is written into `.<name>.tmp` beside it, every file and the directory
fsynced, then renamed into place (checkpoint_files.replace_dir), so a reader never sees half of one.
Only an earlier export is ever replaced, and never the source directory (check_out).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import Tensor

from ..runner import checkpoint_files as files_
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

    from .. import __version__
    from .load import source_dtype

    out = Path(out_dir)
    check_out(out, arch.path)
    dtype = dtype or source_dtype(arch)
    tmp = tmp_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)  # left by an export that crashed
    try:
        tmp.mkdir(parents=True)
        for src in copied_files(Path(arch.path)):
            files_.write_durable(tmp / src.name, lambda f, s=src: f.write(s.read_bytes()))
        mark = json.dumps({"megatron_cispo": __version__, "source": str(arch.path), "step": step}, indent=2) + "\n"
        files_.write_durable(tmp / MARKER, lambda f: f.write(mark.encode()))
        tensors = {name: t.detach().to(device="cpu", dtype=dtype).contiguous() for name, t in hf_tensors.items()}
        split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=max_shard_bytes)
        for file, names in split.filename_to_tensors.items():
            save_file({n: tensors[n] for n in names}, str(tmp / file), metadata={"format": "pt"})
            files_.fsync_path(tmp / file)
        if split.is_sharded:
            index = {"metadata": {"total_parameters": sum(t.numel() for t in tensors.values()), **split.metadata},
                     "weight_map": split.tensor_to_filename}
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            files_.write_durable(tmp / INDEX, lambda f: f.write(text.encode()))
        files_.replace_dir(tmp, out)
        files_.fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_chunks(chunks, arch: HFArch, out_dir, *, dtype: torch.dtype | None = None,
                  step: int | None = None) -> Path:
    """Collective over the world: gather every parameter (runner.weights.gather_full_state), map it to
    HF names (hf.mapping.to_hf) and write `out_dir` on rank 0; every rank returns after rank 0 is done.
    A failure on rank 0 raises checkpoint_save.SaveFailed with one line on every rank.

    gather_full_state brings the whole model, in fp32, to the CPU memory of every rank (an
    all_gather_object of each rank's parameters): fine for tests and small models, a limit for large
    ones (docs/launch.md, "Exporting")."""
    import torch.distributed as dist

    from ..runner.checkpoint_save import SaveFailed, first_failure
    from ..runner.weights import gather_full_state
    from .mapping import to_hf

    full = gather_full_state(chunks)
    error = None
    if dist.get_rank() == 0:
        try:
            write_hf_dir(to_hf(full, arch), arch, out_dir, dtype=dtype, step=step)
        except files_.FAILURES as e:  # noqa: B014 - any failure: every rank must hear of it
            error = f"Hugging Face export to {out_dir} not written: {files_.describe_error(e)}"
    del full
    failed = first_failure(error)
    if failed is not None:
        raise SaveFailed(failed[1])
    return Path(out_dir)
