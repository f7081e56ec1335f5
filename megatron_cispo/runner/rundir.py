"""Run-directory ownership: one job per run_dir, and a fresh run never overwrites an earlier one.

    owned = claim_for_job(cfg.run.run_dir, resume=..., overwrite=...)   # collective; rank 0 locks
    ...  # owned.moved_to (rank 0): where an earlier run's files went, or None
    owned.release()   # or let the process exit

The lock is an flock on run_dir/.lock (pid and host written inside): the kernel drops it when the
holder exits, however it exits, so a crashed job never blocks its requeue. A second job on the
same directory fails at once, naming the holder. A multi-node job needs run_dir on a filesystem
every node shares (checkpoints are written by every rank); only rank 0 takes the lock.
"""
from __future__ import annotations

import fcntl
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ..config import ConfigError

LOCK = ".lock"
PREVIOUS = "previous_"  # earlier runs moved aside by run.overwrite=true (or a resume with nothing to resume)


@dataclass
class OwnedRunDir:
    path: Path
    fd: int
    moved_to: Path | None = None

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the flock; the file stays (it only names the last holder)
            self.fd = -1

    def __enter__(self) -> "OwnedRunDir":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def run_contents(path: Path) -> list[Path]:
    """What a run left in `path`: everything except the lock file and runs already moved aside."""
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.name != LOCK and not p.name.startswith(PREVIOUS))


def _lock(path: Path) -> int:
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # read-only filesystem, no permission, a file in the way
        raise ConfigError(f"run.run_dir={path} is not writable: cannot create {e.filename or path / LOCK} "
                          f"({e.strerror or e}); choose a writable run.run_dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ConfigError(f"run.run_dir={path} is in use by {holder} (lock file {path / LOCK}); wait for that "
                          "job to finish or choose another run.run_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    return fd


def _move_aside(path: Path, contents: list[Path]) -> Path:
    dest = path / f"{PREVIOUS}{time.strftime('%Y%m%d_%H%M%S')}"
    n = 1
    while dest.exists():
        dest, n = path / f"{PREVIOUS}{time.strftime('%Y%m%d_%H%M%S')}_{n}", n + 1
    dest.mkdir()
    for p in contents:
        os.replace(p, dest / p.name)  # same filesystem: a rename, nothing is copied or deleted
    return dest


def check_run_dir(run_dir: str | os.PathLike, *, resume: bool, overwrite: bool) -> list[Path]:
    """The earlier run's files in `run_dir` (run_contents); the ConfigError claim_run_dir raises when a
    fresh run (resume=False, overwrite=False) would mix into them. Locks, moves and creates nothing,
    so `train --check` and the launch scripts' preflight can say it before any rank starts."""
    path = Path(run_dir)
    contents = run_contents(path)
    if contents and not (overwrite or resume):
        names = ", ".join(p.name for p in contents[:4]) + (", ..." if len(contents) > 4 else "")
        raise ConfigError(f"run.run_dir={path} already holds a run ({names}); set run.resume=true to continue "
                          f"it, run.overwrite=true to move it aside to {path}/{PREVIOUS}<time>/, or choose "
                          "another run.run_dir")
    return contents


def claim_run_dir(run_dir: str | os.PathLike, *, resume: bool, overwrite: bool,
                  has_checkpoint=lambda path: False) -> OwnedRunDir:
    """Lock `run_dir` for this job and make sure an earlier run's files cannot be mixed into it.

    A fresh run (resume=False) into a directory holding an earlier run refuses with a ConfigError,
    unless `overwrite`, which moves the earlier files to run_dir/previous_<time>/. A resume with
    no checkpoint to resume from (`has_checkpoint(path)` is False) starts fresh and moves the
    earlier files aside too: a requeued job that died before its first checkpoint just restarts.
    """
    path = Path(run_dir)
    owned = OwnedRunDir(path, _lock(path))
    try:
        contents = check_run_dir(path, resume=resume, overwrite=overwrite)
        if contents and resume and has_checkpoint(path):
            return owned
        if contents:
            owned.moved_to = _move_aside(path, contents)
        return owned
    except BaseException:
        owned.release()
        raise


def claim_for_job(run_dir: str | os.PathLike, *, resume: bool, overwrite: bool,
                  has_checkpoint=lambda path: False) -> OwnedRunDir | None:
    """Collective over the world: rank 0 claims `run_dir` (claim_run_dir) and returns the claim,
    other ranks return None; if rank 0 could not, every rank raises the same ConfigError."""
    owned, error = None, None
    if dist.get_rank() == 0:
        try:
            owned = claim_run_dir(run_dir, resume=resume, overwrite=overwrite, has_checkpoint=has_checkpoint)
        except ConfigError as e:
            error = str(e)
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ConfigError(box[0])
    return owned
