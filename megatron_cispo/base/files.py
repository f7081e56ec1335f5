"""Durable writes and one-line failures, for every directory this package writes (checkpoints, Hugging Face
exports): a file is fsynced, a directory written beside its final place and renamed into it whole.

    write_durable(tmp / "x.bin", lambda f: f.write(data)); replace_dir(tmp, final); fsync_path(final.parent)
    except FAILURES as e: print(describe_error(e))   # the type and the first line, the lowest rank's own
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

# what a save or an export catches to report one line on every rank (CheckpointException derives
# from BaseException)
FAILURES = (Exception, CheckpointException)


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


def replace_dir(tmp: Path, final: Path) -> None:
    """Put the written directory `tmp` in place of `final` (fsyncs `tmp` first): an existing `final`
    is renamed to .<name>.old, `tmp` renamed into place, then the old one deleted; if the second
    rename fails the old one is put back. The caller fsyncs final's parent to make it durable."""
    fsync_path(tmp)
    old = final.with_name(f".{final.name}.old")
    if final.exists():  # a checkpoint of an abandoned history, an earlier export of this step
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old.exists() and not final.exists():
            os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


class MarkerError(ValueError):
    """A marker file that is empty or names another step (a checkpoint's COMPLETE)."""


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
