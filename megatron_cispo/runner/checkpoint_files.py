"""The files of a checkpoint directory: names, markers, verification and pruning (the durable writes
themselves: base/files.py).

    run_dir/checkpoints/step_000010/       # a complete checkpoint (renamed into place whole)
    run_dir/checkpoints/.step_000012.tmp/  # one being written; never read, removed by the next save

A name is `step_<int>`; checkpoints sort by that int, never by the string. `verify` is the cheap
check `checkpoint.resume_point` runs on rank 0 before it trusts a checkpoint. No collectives here.

Where the common (non-tensor) state lives depends on the megatron-core that wrote it: 0.16-0.18 in
rank 0's common.pt, 0.19+ in the shards as the object "common_state" (`writes_common_pt` tells which
the installed one writes); `verify` and `read_common_state` accept both.
"""
from __future__ import annotations

import inspect
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from ..base.files import FAILURES, MarkerError, describe_error, write_durable
from ..mcore import version_str

MARKER = "COMPLETE"
CONFIG = "config.yaml"  # the resolved experiment config that trained up to this checkpoint
FORMAT = "megatron.core.dist_checkpointing/torch_dist"
COMMON = "common.pt"  # megatron-core 0.16-0.18: the common state, torch.save'd by rank 0
COMMON_STATE = "common_state"  # 0.19+: the same state, a ShardedObject written with the shards
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


def read_config(directory: Path) -> str | None:
    """The config text saved with a checkpoint, or None (written before checkpoints held one)."""
    path = directory / CONFIG
    return path.read_text() if path.is_file() else None


def write_marker(directory: Path, info: dict) -> None:
    write_durable(directory / MARKER, lambda f: f.write(json.dumps(info).encode()))


def read_marker(directory: Path) -> dict:
    """The COMPLETE marker's JSON; OSError, json.JSONDecodeError or MarkerError if it is unusable."""
    text = (directory / MARKER).read_text()
    if not text.strip():
        raise MarkerError("empty")
    info = json.loads(text)
    if not isinstance(info, dict) or info.get("step") != step_of(directory):
        raise MarkerError(f"does not name step {step_of(directory)}: {text[:80]!r}")
    return info


def megatron_core_version() -> str:
    """The installed megatron-core's version, "0.19.2" (its __version__ may end in a git hash)."""
    return version_str()


def writes_common_pt() -> bool:
    """Whether the installed megatron-core keeps a checkpoint's common state in common.pt (0.16-0.18)
    rather than in the shards (0.19+). Probed by the change that came with it: 0.19's
    dist_checkpointing.save lost its common_strategy parameter along with common.pt."""
    from megatron.core import dist_checkpointing

    return "common_strategy" in inspect.signature(dist_checkpointing.save).parameters


def common_state_object(data=None, replica_id: int = 0):
    """The ShardedObject that holds the common state in a 0.19+ checkpoint, as 0.19's
    dist_checkpointing.save makes it (one global copy, written by the rank whose replica_id is 0)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(COMMON_STATE, data, (1,), (0,), replica_id=replica_id)


def read_common_state(directory: Path) -> dict:
    """The common state of a checkpoint whose shards hold it (written by megatron-core 0.19+); works
    with any megatron-core, in one process (no collectives). 0.19+ reads it with
    serialization.load_common_state_dict; 0.16 has no reader for that layout, hence this one, through
    torch.distributed.checkpoint's public load. `verify` checks that one exists."""
    from torch.distributed import checkpoint as dcp

    key = common_state_object().unique_key
    state = {key: io.BytesIO()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
    data = state[key]
    if isinstance(data, io.BytesIO):  # torch's default load planner unpickles it; another may not
        data.seek(0)
        data = torch.load(data, map_location="cpu", weights_only=False)
    return data[0]  # the shard's list of objects: one


def verify(directory: Path) -> str | None:
    """None if `directory` looks intact, else one line: the file and what is wrong with it.

    Cheap: the marker and dist_checkpointing's metadata are parsed, every shard file the metadata
    names must exist and be at least as long as the data it records there, the common state is
    unpickled (common.pt with its tensors memory-mapped, or the shards' common_state; either layout,
    whichever megatron-core is installed) and so is each shared object.
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
        path, key = directory / COMMON, common_state_object().unique_key
        if path.is_file():
            torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        elif key in metadata.state_dict_metadata:  # written by megatron-core 0.19+: in the shards
            path = directory / next((item.relative_path for index, item in metadata.storage_data.items()
                                     if index.fqn == key), ".metadata")  # no storage entry: the index is bad
            read_common_state(directory)
        else:
            return f"{path}: missing, and {directory / '.metadata'} lists no {COMMON_STATE} object either"
        for name in (f"{n}.pt" for n in info.get("shared", [])):
            path = directory / name
            torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except FAILURES as e:  # noqa: B014 - any failure to read makes the checkpoint unusable
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
