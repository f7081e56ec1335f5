"""The files of a checkpoint directory: names, durable writes, verification and pruning.

    run_dir/checkpoints/step_000010/       # a complete checkpoint (renamed into place whole)
    run_dir/checkpoints/.step_000012.tmp/  # one being written; never read, removed by the next save

A name is `step_<int>`; checkpoints sort by that int, never by the string. `verify` is the cheap
check `checkpoint.resume_point` runs on rank 0 before it trusts a checkpoint. No collectives here.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

MARKER = "COMPLETE"
CONFIG = "config.yaml"  # the resolved experiment config that trained up to this checkpoint
FORMAT = "megatron.core.dist_checkpointing/torch_dist"
_NAME = re.compile(r"step_(\d+)")
_LEFTOVER = re.compile(r"\.step_(\d+)\.(tmp|old)")  # a save that crashed


def root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return root(run_dir) / f"step_{step:06d}"


def tmp_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return root(run_dir) / f".step_{step:06d}.tmp"


def step_of(path: Path) -> int | None:
    """The step in a checkpoint directory's name (`step_<int>`), or None for any other name."""
    m = _NAME.fullmatch(path.name)
    return int(m[1]) if m else None


def step_dirs(run_dir: str | os.PathLike) -> list[Path]:
    """Every `step_<int>` directory, with or without a COMPLETE marker, oldest step first."""
    return sorted((p for p in root(run_dir).glob("step_*") if step_of(p) is not None and p.is_dir()), key=step_of)


def complete(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint directories that have a COMPLETE marker (not verified), oldest step first."""
    return [p for p in step_dirs(run_dir) if (p / MARKER).is_file()]


def tree_bytes(path: Path) -> int:
    """Bytes in the files under `path` (0 if it is gone)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entries to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, write) -> None:
    """Write `path` through `write(file)`, then fsync it (the caller renames its directory)."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def read_config(directory: Path) -> str | None:
    """The config text saved with a checkpoint, or None (written before checkpoints held one)."""
    path = directory / CONFIG
    return path.read_text() if path.is_file() else None


def write_marker(directory: Path, info: dict) -> None:
    write_durable(directory / MARKER, lambda f: f.write(json.dumps(info).encode()))


class MarkerError(ValueError):
    """A COMPLETE marker that is empty or names another step."""


def read_marker(directory: Path) -> dict:
    """The COMPLETE marker's JSON; OSError, json.JSONDecodeError or MarkerError if it is unusable."""
    text = (directory / MARKER).read_text()
    if not text.strip():
        raise MarkerError("empty")
    info = json.loads(text)
    if not isinstance(info, dict) or info.get("step") != step_of(directory):
        raise MarkerError(f"does not name step {step_of(directory)}: {text[:80]!r}")
    return info


def root_cause(e: BaseException) -> BaseException:
    """The lowest rank's own error inside torch.distributed.checkpoint's CheckpointException (which
    gathers every rank's and derives from BaseException), else `e`."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return failures[min(failures)][0]
    return e


def describe_error(e: BaseException) -> str:
    """One line: the exception's type and the first line of its message (a CheckpointException's
    lowest rank's error; a KeyError's key, without the list of keys that megatron appends)."""
    e = root_cause(e)
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    lines = text.strip().splitlines()
    if isinstance(e, MarkerError):
        return lines[0]
    first = lines[0].split(": [", 1)[0] if lines else ""
    return f"{type(e).__name__}: {first[:200]}".rstrip(": ")


def verify(directory: Path) -> str | None:
    """None if `directory` looks intact, else one line: the file and what is wrong with it.

    Cheap: the marker and dist_checkpointing's metadata are parsed, every shard file the metadata
    names must exist and be at least as long as the data it records there, and the torch files
    (common.pt and each shared object) are unpickled with their tensors memory-mapped, not read.
    Bytes flipped inside a shard's tensor data are not detected (the format has no checksums).
    """
    from megatron.core.dist_checkpointing.core import maybe_load_config
    from torch.distributed.checkpoint import FileSystemReader

    path = directory / MARKER
    if not path.is_file():  # save() renames a directory into place only after writing it: damaged since
        return f"{path}: missing"
    try:
        info = read_marker(directory)
        path = directory / "metadata.json"
        config = maybe_load_config(str(directory))
        if config is None:
            return f"{path}: missing (not a dist_checkpointing checkpoint; written by an older version?)"
        path = directory / ".metadata"
        metadata = FileSystemReader(str(directory)).read_metadata()
        needed: dict[str, int] = {}
        for item in metadata.storage_data.values():
            needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
        for name, size in sorted(needed.items()):
            path = directory / name
            if not path.is_file():
                return f"{path}: missing"
            if path.stat().st_size < size:
                return f"{path}: truncated ({path.stat().st_size} bytes, its data ends at byte {size})"
        for name in ["common.pt", *(f"{n}.pt" for n in info.get("shared", []))]:
            path = directory / name
            torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # noqa: BLE001 - any failure to read makes the checkpoint unusable
        return f"{path}: {describe_error(e)}"
    return None


def prune(run_dir: str | os.PathLike, *, keep: int, newest: Path) -> list[Path]:
    """Delete complete checkpoints beyond the `keep` highest steps, never `newest` (the one just
    written), and directories a crashed save left (.step_<step>.tmp/.old); returns what was deleted.

    Checkpoints with a higher step than `newest` can only come from an earlier run or an abandoned
    history (a resume from an older step); they are kept, and a warning says a resume would pick them.
    """
    done = complete(run_dir)
    keep_set = set(done[-keep:]) | {newest}
    later = [p for p in done if step_of(p) > step_of(newest)]
    if later:
        print(f"warning: {', '.join(p.name for p in later)} in {root(run_dir)} have a higher step than the "
              f"checkpoint just written ({newest.name}); they are from another run or history, and "
              "run.resume would try the highest first", file=sys.stderr, flush=True)
    gone = [p for p in done if p not in keep_set]
    gone += [p for p in root(run_dir).glob(".step_*") if _LEFTOVER.fullmatch(p.name)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
