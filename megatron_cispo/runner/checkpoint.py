"""Sharded per-rank checkpoints with atomic writes, and finding the last complete one.

    run_dir/checkpoints/step_000010/rank_00003.pt   # this rank's model chunks, optimizer, RNG
    run_dir/checkpoints/step_000010/sampler.pt      # each object in `shared`, by name (rank 0)
    run_dir/checkpoints/step_000010/COMPLETE        # written by rank 0 after every rank saved

Each file is written to a temporary name and renamed into place (atomic on POSIX), so a crash
never leaves a half-written file under a final name; a step directory without COMPLETE is
ignored on resume. Resuming needs the same (tp, pp, vp) and world size as the run that saved.
`shared` maps a name to any object with state_dict()/load_state_dict() that is the same on
every rank (the demo's sampler); this module imports none of their types.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import ConfigError

MARKER = "COMPLETE"


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def last_complete(run_dir: str | Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    done = sorted(p for p in root.glob("step_*") if (p / MARKER).is_file()) if root.is_dir() else []
    return done[-1] if done else None


def save(run_dir, step: int, *, chunks, optimizer, shared: dict, layout: dict, keep: int) -> Path:
    """Collective: every rank writes its shard, then rank 0 marks the step complete and prunes."""
    rank = dist.get_rank()
    path = step_dir(run_dir, step)
    path.mkdir(parents=True, exist_ok=True)
    _atomic_save({"step": step, "chunks": [c.state_dict() for c in chunks], "optimizer": optimizer.state_dict(),
                  "rng": torch.get_rng_state()}, path / f"rank_{rank:05d}.pt")
    if rank == 0:
        for name, obj in shared.items():
            _atomic_save(obj.state_dict(), path / f"{name}.pt")
    dist.barrier()
    if rank == 0:
        tmp = path / f".{MARKER}.tmp"
        tmp.write_text(json.dumps({"step": step, **layout}))
        os.replace(tmp, path / MARKER)
        complete = sorted(p for p in path.parent.glob("step_*") if (p / MARKER).is_file())
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def load(path: Path, *, chunks, optimizer, shared: dict, layout: dict) -> int:
    """Restore this rank's shard and every object in `shared` from complete checkpoint `path`;
    returns its step."""
    saved = json.loads((path / MARKER).read_text())
    mismatch = {k: (saved.get(k), v) for k, v in layout.items() if saved.get(k) != v}
    if mismatch:
        diff = ", ".join(f"{k}: saved {a}, now {b}" for k, (a, b) in mismatch.items())
        raise ConfigError(f"run.resume: checkpoint {path} was written with another layout ({diff}); "
                          "resume with the same parallelism and world size")
    state = torch.load(path / f"rank_{dist.get_rank():05d}.pt", map_location="cpu", weights_only=False)
    for chunk, sd in zip(chunks, state["chunks"]):
        chunk.load_state_dict(sd)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    for name, obj in shared.items():
        obj.load_state_dict(torch.load(path / f"{name}.pt", map_location="cpu", weights_only=False))
    return int(state["step"])
