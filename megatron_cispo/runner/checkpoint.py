"""Checkpoints through megatron-core's dist_checkpointing: resumable on another (tp, pp, dp) layout.

    path = checkpoint.save(run_dir, step, chunks=, optimizer=, shared={"sampler": s}, keep=2)  # collective
    path = checkpoint.resume_point(run_dir)      # collective: newest intact checkpoint, or None
    step = checkpoint.load(path, chunks=, optimizer=, shared={"sampler": s})                 # collective
    step = checkpoint.load_model(path, chunks=)  # collective: the model only, on any layout (export_hf)

A checkpoint is run_dir/checkpoints/step_<step>/: the model chunks' and the optimizer's sharded
state dicts and every rank's RNG states in dist_checkpointing's torch_dist format (`__<rank>_0.distcp`,
`.metadata`, `metadata.json`, and `common.pt` from megatron-core 0.16-0.18; 0.19+ keeps that common
state in the shards), `<name>.pt` for each object in `shared` (rank 0; objects with
state_dict()/load_state_dict() that are the same on every rank, like the demo's sampler), the
experiment's config.yaml when save() is given it, and a COMPLETE marker (JSON: step, layout, shared
names, the megatron-core version that wrote it). Either layout loads with megatron-core 0.16 and
0.19 (`_common_strategy`); 0.17-0.18 refuse a 0.19+ checkpoint in one line naming both versions.
The optimizer's state (moments, steps) is loaded; its settings stay those it was built with.
It is written under .step_<step>.tmp/, every file and the directory fsynced, COMPLETE last, then
renamed into place (checkpoint_save.py: a failure on any rank stops every rank alike); files_
(checkpoint_files.py) names, verifies and prunes them. Tensors are resharded on load, so the model and optimizer resume on any
layout; RNG states are restored only on the layout that saved them (as Megatron-LM does). A
multi-node job needs run_dir on a filesystem every node shares: rank 0 verifies and decides for all.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..base import files as durable
from . import checkpoint_files as files_
from .checkpoint_lagged import lagged_from_state, lagged_state_dict
from . import checkpoint_save
from .checkpoint_optim import check_optimizer_count, check_optimizer_kind, is_distributed, load_optimizer_state, \
    optimizer_count, sgd_init_state, zero_step
from .checkpoint_save import SaveFailed  # noqa: F401 - raised by save(), caught as checkpoint.SaveFailed

step_dir = files_.step_dir


def last_complete(run_dir: str | os.PathLike) -> Path | None:
    """The highest-step checkpoint with a COMPLETE marker, not verified (see resume_point)."""
    done = files_.complete(run_dir)
    return done[-1] if done else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _layout() -> dict:
    from megatron.core import parallel_state as mpu

    return {"tp": mpu.get_tensor_model_parallel_world_size(), "pp": mpu.get_pipeline_model_parallel_world_size(),
            "vp": mpu.get_virtual_pipeline_model_parallel_world_size(), "cp": mpu.get_context_parallel_world_size(),
            "ep": mpu.get_expert_model_parallel_world_size(), "world_size": dist.get_world_size()}


def _describe(layout: dict) -> str:
    return " ".join(f"{k} {v}" for k, v in layout.items() if v is not None)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import convert_cuda_rng_state, get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(),
             "tracker": {k: convert_cuda_rng_state(v, to_graphable=False).clone()
                         for k, v in get_cuda_rng_tracker().get_states().items()}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import (
        convert_cuda_rng_state, get_cuda_rng_tracker, is_graph_safe_cuda_rng_tracker)

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = get_cuda_rng_tracker()
    graphable = is_graph_safe_cuda_rng_tracker(tracker)
    tracker.set_states({k: convert_cuda_rng_state(v, to_graphable=graphable) for k, v in state["tracker"].items()})


def _sharded_state_dict(chunks, optimizer, *, loading: bool, with_rng: bool) -> dict:
    """Megatron-LM's layout: "model" (or model0, model1, ... with virtual pipeline chunks),
    "optimizer" built on the model's sharded tensors, and one RNG object per global rank."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    metadata = _metadata()
    if is_distributed(optimizer):
        # the canonical state (one tensor per parameter, as the plain optimizer's), resharded on load to any
        # (tp, pp, dp) layout. Saving gathers the DP shards on DP rank 0 of each (tp, pp) shard; megatron's
        # default, fully_sharded_model_space, writes without that gather but is refused by its own checks
        # in 0.16 ("ShardedTensor.flattened_range is not supported"), and dp_reshardable reshards DP only.
        metadata["distrib_optim_sharding_type"] = "fully_reshardable"
    sd = _model_state_dict(chunks, metadata)
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(sub, "init_state_fn", sgd_init_state) is None:
            sub.init_state_fn = sgd_init_state
        if loading and is_distributed(sub) and not sub.optimizer.state:
            zero_step(sub)
    sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=loading, metadata=metadata)
    if with_rng:
        sd["rng_state"] = ShardedObject("rng_state", _rng_state(), (dist.get_world_size(),), (dist.get_rank(),),
                                        replica_id=0)
    return sd


def _metadata() -> dict:
    """sharded_state_dict's metadata. Megatron-LM's training/checkpointing.py passes the same: no
    "chained_<i>." prefix, so an optimizer tensor's key is its parameter's key, however chained."""
    from megatron.core import parallel_state as mpu

    return {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}


def _model_state_dict(chunks, metadata: dict) -> dict:
    """{"model": sharded state} or, with virtual pipeline chunks, {"model0": ..., "model1": ...}."""
    from megatron.core.utils import unwrap_model

    models = unwrap_model(list(chunks))  # DDP's own state dict would prefix every key with "module."
    return {("model" if len(models) == 1 else f"model{i}"): m.sharded_state_dict(metadata=metadata)
            for i, m in enumerate(models)}


def _model_part(sd: dict) -> dict:
    """The model entries of _sharded_state_dict's result (the lagged versions take their metadata)."""
    return {k: v for k, v in sd.items() if k == "model" or k.startswith("model") and k[5:].isdigit()}


def _load_models(chunks, state: dict) -> None:
    from megatron.core.utils import unwrap_model

    models = unwrap_model(list(chunks))
    for i, m in enumerate(models):
        m.load_state_dict(state["model" if len(models) == 1 else f"model{i}"])


def save(run_dir, step: int, *, chunks, optimizer, shared: dict, keep: int, config: str = "") -> Path:
    """Collective: write checkpoint `step` (with `config`, the experiment's YAML, as config.yaml when
    given), rename it into place, prune to `keep`; returns its path. SaveFailed (the same on every
    rank) when any part fails on any rank; checkpoint_save.py says how."""
    extra = {f"{name}.pt": (lambda f, o=obj: torch.save(o.state_dict(), f)) for name, obj in shared.items()}
    if config:
        extra[files_.CONFIG] = lambda f: f.write(config.encode())
    marker = {"step": step, "format": files_.FORMAT, "layout": _layout(), "optimizers": optimizer_count(optimizer),
              "distributed_optimizer": is_distributed(optimizer), "shared": sorted(shared),
              "megatron_core": files_.megatron_core_version()}
    sd = _sharded_state_dict(chunks, optimizer, loading=False, with_rng=True)
    for name, obj in shared.items():  # a sampler's lagged versions, sharded like the model
        held = obj.lagged_shards() if hasattr(obj, "lagged_shards") else {}
        if held:
            marker[f"{name}_lagged"] = sorted(held)
            sd.update(lagged_state_dict(_model_part(sd), chunks, name, held))
    return checkpoint_save.write(run_dir, step, sd, extra=extra, marker=marker, keep=keep)


def resume_point(run_dir: str | os.PathLike) -> Path | None:
    """Collective (or single-process): the newest checkpoint that passes `checkpoint_files.verify`.

    Rank 0 checks from the highest step down and prints one warning line per unusable checkpoint
    (the file and why; a step directory without COMPLETE is one) before falling back to the previous
    one; its choice is broadcast. None when there is no step directory; ConfigError on every rank,
    naming each one, when none is intact.
    """
    decision: list = [None, None]
    if _rank() == 0:
        problems = []
        for path in reversed(files_.step_dirs(run_dir)):
            why = files_.verify(path)
            if why is None:
                decision[0] = str(path)
                break
            problems.append(why)
            print(f"warning: checkpoint {path} is unusable, {why}; trying the previous one", file=sys.stderr,
                  flush=True)
        if decision[0] is None and problems:
            decision[1] = (f"run.resume: no intact checkpoint in {files_.root(run_dir)}: " + "; ".join(problems)
                           + ". Move them aside, or start afresh with run.resume=false run.overwrite=true")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(decision, src=0)
    if decision[1] is not None:
        raise ConfigError(decision[1])
    return None if decision[0] is None else Path(decision[0])


def _other_writer(info: dict) -> bool:
    """Whether another megatron-core wrote the checkpoint; markers from before versions were recorded
    (no "megatron_core" key) were written in the common.pt layout, which every release here reads."""
    return "megatron_core" in info and info["megatron_core"] != files_.megatron_core_version()


def _written_by(info: dict) -> str:
    """Which megatron-core wrote a checkpoint, from its marker (not recorded before 0.19 was supported)."""
    return f"megatron-core {info['megatron_core']}" if "megatron_core" in info else "an unrecorded megatron-core"


def _common_strategy(path: Path, info: dict):
    """What dist_checkpointing.load needs as common_strategy to read `path`'s common state: None (its
    own) for common.pt, which every version reads, or wherever megatron-core reads the 0.19+ layout
    itself. megatron-core 0.16 reads only common.pt, but takes a common strategy: one that reads the
    shards' copy. 0.17-0.18 take none, so a 0.19+ checkpoint is refused there in one line."""
    if (path / files_.COMMON).is_file() or not files_.writes_common_pt():
        return None
    try:  # 0.16 only: removed in 0.17 with load()'s support for common strategies
        from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    except ImportError:
        raise ConfigError(f"run.resume: {path} was written by {_written_by(info)}, which keeps the common "
                          f"state in the shards (no {files_.COMMON}); megatron-core {files_.megatron_core_version()} "
                          "reads only common.pt. Resume with megatron-core 0.16 or >= 0.19") from None

    class ShardsCommonLoad(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return files_.read_common_state(Path(checkpoint_dir))

    return ShardsCommonLoad()


@contextlib.contextmanager
def _quiet(logger: str):
    """Hide `logger`'s warnings: megatron-core 0.19 says "load_common is deprecated" on every rank
    when it reads a 0.16-0.18 checkpoint's common.pt; rank 0's note says which version wrote it."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _load_error(path: Path, info: dict, e: BaseException, what: str = "run.resume: cannot load the model and "
                "optimizer") -> str:
    """One line for a failed load; "saved by another model or optimizer" only where the checkpoint's
    tensors or keys do not fit this model (a read error or a bug is said as what it is), with the
    megatron-core versions when another one wrote it."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    cause = durable.root_cause(e)
    text = f"{what} from {path}: {durable.describe_error(e)}"
    if isinstance(cause, (CheckpointingException, KeyError)) or "size mismatch" in str(cause) \
            or "shape mismatch" in str(cause).lower():
        settings = f" (its settings: {path / files_.CONFIG})" if (path / files_.CONFIG).is_file() else ""
        text += f"; it was saved by another model or optimizer{settings}"
    if _other_writer(info):
        text += f"; it was written by {_written_by(info)}, this is megatron-core {files_.megatron_core_version()}"
    return text


def _raise_agreed(error: str | None, cause: BaseException | None) -> None:
    """Collective: ConfigError on every rank, with the lowest failing rank's line, when any rank failed."""
    failed = checkpoint_save.first_failure(error)
    if failed is not None:
        rank, text = failed
        raise ConfigError(text + (f" (on rank {rank})" if rank else "")) from (cause if error else None)


def load(path: Path, *, chunks, optimizer, shared: dict) -> int:
    """Collective: restore the model chunks, the optimizer, RNG states (same layout only) and every
    object in `shared` from checkpoint `path`; returns its step. ConfigError names the file that failed."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    try:
        info = files_.read_marker(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"run.resume: {path / files_.MARKER}: {durable.describe_error(e)}") from e
    missing = sorted(set(shared) - set(info.get("shared", [])))
    if missing:
        raise ConfigError(f"run.resume: {path} has no {', '.join(missing)} state (it has {info.get('shared')})")
    check_optimizer_count(path, info, optimizer, ep_now=_layout()["ep"])
    check_optimizer_kind(path, info, optimizer)
    common = _common_strategy(path, info)
    same_layout = {k: info.get("layout", {}).get(k) for k in _layout()} == _layout()
    if not same_layout and _rank() == 0:
        print(f"note: {path} was saved at {_describe(info.get('layout', {}))}; the model and optimizer are "
              f"resharded to {_describe(_layout())}, RNG states stay as seeded by run.seed", flush=True)
    if _other_writer(info) and _rank() == 0:
        print(f"note: {path} was written by {_written_by(info)}; loading it with megatron-core "
              f"{files_.megatron_core_version()}", flush=True)
    state, error, cause = None, None, None
    try:
        kwargs = {} if common is None else {"common_strategy": common}
        sd = _sharded_state_dict(chunks, optimizer, loading=True, with_rng=same_layout)
        lagged = {name: info.get(f"{name}_lagged", []) for name, obj in shared.items() if hasattr(obj, "load_lagged")}
        for name, versions in lagged.items():
            if versions and shared[name].holds_lagged():
                sd.update(lagged_state_dict(_model_part(sd), chunks, name, {v: None for v in versions}))
        with _quiet("megatron.core.dist_checkpointing.strategies.common"):
            state = dist_checkpointing.load(sd, str(path), **kwargs)
        _load_models(chunks, state)
        load_optimizer_state(optimizer, state["optimizer"])
        for name, versions in lagged.items():
            shared[name].load_lagged(lagged_from_state(chunks, name, versions, state))
    except checkpoint_save.FAILURES as e:  # noqa: B014 - CheckpointException is a BaseException
        error, cause = _load_error(path, info, e), e
    _raise_agreed(error, cause)  # the per-rank loads above fail on some ranks only: all must stop
    if same_layout:
        _set_rng_state(state["rng_state"])
    error = None
    for name, obj in shared.items():
        try:
            obj.load_state_dict(torch.load(path / f"{name}.pt", map_location="cpu", weights_only=False))
        except Exception as e:  # noqa: BLE001 - name the file, whatever went wrong in it
            error, cause = f"run.resume: cannot load {path / f'{name}.pt'}: {durable.describe_error(e)}", e
            break
    _raise_agreed(error, cause)
    return int(info["step"])


def load_model(path: Path, *, chunks) -> int:
    """Collective: restore only the model chunks from checkpoint `path`, resharded to this layout (the
    optimizer, RNG states and shared objects are not read); returns its step. ConfigError names the file."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    try:
        info = files_.read_marker(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path / files_.MARKER}: {durable.describe_error(e)}") from e
    common = _common_strategy(path, info)
    error, cause = None, None
    try:
        kwargs = {} if common is None else {"common_strategy": common}
        with _quiet("megatron.core.dist_checkpointing.strategies.common"):
            state = dist_checkpointing.load(_model_state_dict(chunks, _metadata()), str(path), **kwargs)
        _load_models(chunks, state)
    except checkpoint_save.FAILURES as e:  # noqa: B014 - CheckpointException is a BaseException
        error, cause = _load_error(path, info, e, what="cannot load the model"), e
    _raise_agreed(error, cause)
    return int(info["step"])
