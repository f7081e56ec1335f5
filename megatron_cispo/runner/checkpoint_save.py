"""Writing one checkpoint so that a failure on any rank, in any part, stops every rank alike.

    path = write(run_dir, step, sharded_state_dict, extra={"sampler.pt": fn}, marker=info, keep=2)  # collective

The parts: rank 0 clears .step_<step>.tmp/; every rank writes its shards (torch.distributed.checkpoint,
which gathers the ranks' errors itself); rank 0 writes its own files (dist_checkpointing's metadata.json,
common.pt with megatron-core 0.16-0.18, the `extra` files, COMPLETE) and renames the directory into
place. After each part every rank learns whether any rank failed (`first_failure`, one
all_gather_object), so no rank is left alone in a collective; then rank 0 removes the temporary
directory and every rank raises the same SaveFailed. Any exception counts: torch.save to a full disk
raises RuntimeError, not OSError. This is the installed megatron-core's dist_checkpointing.save (its
synchronous path) taken apart for that; the files are those it writes (with 0.19+ the common state goes
into the shards as "common_state", no common.pt). What fails after the rename (pruning) is a warning:
the checkpoint is in place.
"""
from __future__ import annotations

import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from ..base import files as durable
from . import checkpoint_files as files_

FAILURES = durable.FAILURES


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (a full disk, a quota, a lost mount): raised alike on every
    rank, its one line names the file, the error and the free space; the temporary directory is
    removed and the earlier checkpoints are untouched."""


def first_failure(error: str | None) -> tuple[int, str] | None:
    """Collective (one all_gather_object; none in a single process): (rank, error) of the lowest rank
    whose `error` is not None, the same on every rank; None when no rank failed."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None if error is None else (0, error)
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next(((rank, e) for rank, e in enumerate(errors) if e is not None), None)


# Less than this free after a failed write: the disk is full, whatever the writer said. torch's zip writer
# (torch.save, which torch.distributed.checkpoint uses for objects) reports a short write as
# "unexpected pos", not as ENOSPC.
FULL_DISK_BYTES = 1 << 20


def _attempt(parts: list[tuple[Path | None, Callable[[], None]]], directory: Path) -> str | None:
    """Run each (file it writes, fn) in order; the first failure in one line naming its file, else None.
    A failure that is not an OSError while `directory`'s disk is full says so (ENOSPC)."""
    for path, fn in parts:
        try:
            fn()
        except FAILURES as e:  # noqa: B014 - CheckpointException is a BaseException
            said = durable.describe_error(e)
            if not isinstance(durable.root_cause(e), OSError) and _free_bytes(directory) < FULL_DISK_BYTES:
                said = f"OSError: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} (the writer said {said})"
            return said if path is None or str(path) in said else f"{path}: {said}"
    return None


def _free_bytes(directory: Path) -> float:
    """Free bytes where `directory` is (its nearest existing parent); infinity when that cannot be read."""
    for d in (directory, *directory.parents):
        try:
            return shutil.disk_usage(d).free
        except OSError:
            continue
    return float("inf")


def _part(parts, run_dir, step: int, *, on_every_rank: bool = False) -> None:
    """Collective: run `parts` on rank 0 (or on every rank), then agree; on a failure anywhere rank 0
    removes the temporary directory and every rank raises the same SaveFailed."""
    rank = dist.get_rank()
    failed = first_failure(_attempt(parts, files_.root(run_dir)) if on_every_rank or rank == 0 else None)
    if failed is None:
        return
    box = [None]
    if rank == 0:
        where, error = failed
        tmp = files_.tmp_dir(run_dir, step)
        written, free = _mib(lambda: files_.tree_bytes(tmp)), _mib(lambda: shutil.disk_usage(files_.root(run_dir)).free)
        shutil.rmtree(tmp, ignore_errors=True)
        on = f" (rank {where})" if where else ""
        box[0] = (f"checkpoint of step {step} not written: {error}{on}; {tmp} ({written} MiB written) "
                  f"was removed, {free} MiB are free in {files_.root(run_dir)}; the earlier checkpoints "
                  "are untouched. Free space (or set run.checkpoint_keep lower) and resume with run.resume=true")
    dist.broadcast_object_list(box, src=0)
    raise SaveFailed(box[0])


def _mib(size) -> str:
    """`size()` bytes in MiB, or "?" when the filesystem cannot say (a lost mount): the failure must
    still reach the broadcast that the other ranks wait in."""
    try:
        return f"{size() / 2**20:.1f}"
    except OSError:
        return "?"


def _write_shards(sharded: dict, directory: Path) -> None:
    """Collective: every rank writes its part of `sharded` (dist_checkpointing's ShardedTensors and
    ShardedObjects) in the torch_dist format, in this process, through torch.distributed.checkpoint's
    FileSystemWriter (fsyncs each file; a failure on any rank is raised on every rank).

    megatron-core's own TorchDistSaveShardedStrategy.save writes the same files but cannot be stopped
    alike on every rank: 0.16 forks writer processes (needs psutil) and waits forever when one fails;
    0.19 raises on rank 0 alone when .metadata cannot be written, while the others wait in a broadcast.
    So its translation is called here, and that needs the one private megatron-core function this
    package uses: _replace_state_dict_keys_with_sharded_keys (the same in 0.16-0.19) names each shard
    by its global key and keeps the main replicas; nothing public does that."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)
    from torch.distributed import checkpoint as dcp

    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
    dcp.save(mcore_to_pyt_state_dict(flat, False),
             storage_writer=dcp.FileSystemWriter(str(directory), sync_files=True),
             planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))


def write_common_pt(common: dict, directory: Path) -> None:
    """Rank 0: megatron-core 0.16-0.18's common.pt (what their save_common writes), fsynced."""
    durable.write_durable(directory / files_.COMMON, lambda f: torch.save(common, f))


def write(run_dir, step: int, sharded_state_dict: dict, *, extra: dict, marker: dict, keep: int) -> Path:
    """Collective: write checkpoint `step` (the sharded state, each `extra` file name -> write(file)
    on rank 0, COMPLETE holding `marker`), rename it into place, prune to `keep`; returns its path.
    SaveFailed, alike on every rank, when any part fails on any rank."""
    from megatron.core.dist_checkpointing import core as dist_core
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    final, tmp = files_.step_dir(run_dir, step), files_.tmp_dir(run_dir, step)

    def start() -> None:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        tmp.mkdir(parents=True)

    _part([(tmp, start)], run_dir, step)
    sharded, common = save_preprocess(sharded_state_dict, validate_access_integrity=True)  # collective checks
    own = []
    if files_.writes_common_pt():
        own.append((tmp / files_.COMMON, lambda: write_common_pt(common, tmp)))
    else:  # megatron-core 0.19+: one copy, from rank 0, with the shards
        sharded[files_.COMMON_STATE] = files_.common_state_object(common, replica_id=dist.get_rank())
    _part([(None, lambda: _write_shards(sharded, tmp))], run_dir, step, on_every_rank=True)
    metadata = tmp / "metadata.json"  # the format's name; shards and common.pt are fsynced by their writers
    own += [(metadata, lambda: dist_core.save_config(dist_core.CheckpointingConfig("torch_dist", 1), str(tmp))),
            (metadata, lambda: durable.fsync_path(metadata))]
    own += [(tmp / name, lambda p=tmp / name, fn=fn: durable.write_durable(p, fn)) for name, fn in extra.items()]
    own += [(tmp / files_.MARKER, lambda: files_.write_marker(tmp, marker)),
            (final, lambda: durable.replace_dir(tmp, final))]
    _part(own, run_dir, step)
    if dist.get_rank() == 0:
        _tidy(run_dir, final, keep)
    return final


def _tidy(run_dir, final: Path, keep: int) -> None:
    """Rank 0, after the rename: make it durable and prune; a failure here is a warning, never a lost
    checkpoint (the checkpoint is in place and complete)."""
    try:
        durable.fsync_path(final.parent)
        files_.prune(run_dir, keep=keep, newest=final)
    except FAILURES as e:  # noqa: B014
        try:
            print(f"warning: checkpoint {final} is written, but tidying {files_.root(run_dir)} failed "
                  f"({durable.describe_error(e)}); older checkpoints may be left", file=sys.stderr, flush=True)
        except OSError:
            pass
