"""Process groups and megatron parallel state for our runner, demo and tests.

`init_distributed(tp=, pp=, cp=, ep=, ...)` reads torchrun's environment, picks NCCL on CUDA and
gloo otherwise, checks that every rank resolved the same config (consistency.py), builds
megatron-core's parallel state with one timeout for every group, and (on CPU only) enters
`CpuCompat` (cpu_compat.py). `shutdown()` undoes all of it. Library code never calls these:
a Megatron training loop brings its own process groups.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .consistency import check_same_config
from ..mcore import require_names
from ..step.groups import default_groups
from .cpu_compat import CpuCompat, import_megatron_core
from .peers import health_group


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """What `init_distributed` set up; pass it to `shutdown`."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    vp: int | None
    compat: CpuCompat
    timeout_s: float  # every process group's timeout (run.dist_timeout_s)
    health: object | None  # gloo: the group peers.explain_lost_peer uses; None on NCCL
    groups: object  # megatron-core's ProcessGroupCollection of the groups above: what the step is handed


_ENV: DistEnv | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (one-process groups, tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, vp: int | None = None,
    seed: int = 1234, timeout_s: float = 300, backend: str | None = None, config_text: str | None = None,
) -> DistEnv:
    """Init torch.distributed from torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR/PORT) and
    megatron parallel state; dp = world_size // (tp * pp * cp). Expert layers are split over
    ep ranks with expert TP = tp (megatron's default), so world_size must also be a multiple of
    tp * ep * pp. Single process without env vars works too (world size 1 on 127.0.0.1).

    Every process group (megatron's too) times out after `timeout_s` seconds. With `config_text`
    (the resolved YAML), a rank whose text differs from another's makes every rank raise
    ConfigError before megatron's groups exist (one all-reduce; see consistency.py)."""
    global _ENV
    import_megatron_core()  # a process's first megatron import: on CPU without compiling (~2 s per rank)
    require_names("all")  # one line naming what this megatron-core lacks, before any rank builds
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if _ENV is not None:
        raise RuntimeError("init_distributed was already called in this process; call shutdown() first")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    for name, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if world % (tp * pp * cp):
        raise ValueError(
            f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}; "
            f"launch a multiple of {tp * pp * cp} processes")
    if world % (tp * ep * pp):
        # megatron's expert rank grid: expert TP (= tp) x ep x pp must tile the world
        raise ValueError(
            f"world size {world} is not divisible by tp*ep*pp = {tp}*{ep}*{pp} (the expert layers' "
            f"layout); launch a multiple of {tp * ep * pp} processes")
    if vp is not None and pp < 2:
        raise ValueError(f"vp={vp} (virtual pipeline stages) needs pp >= 2, got pp={pp}")
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "gloo" and vp is not None and pp == 2:
        # With pp=2 the previous and next stage are the same peer; gloo matches p2p messages
        # per peer in posting order, so interleaved activations and gradients can swap silently.
        raise ValueError(f"vp={vp} with pp=2 is not supported over gloo (activations and gradients "
                         "to the same peer can be mismatched); use pp >= 4 with vp, or no vp")
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(
            backend=backend, rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s))
    if config_text is not None:
        try:  # before megatron's groups: a differing parallelism would hang or mismatch them
            check_same_config(config_text, device=device)
        except BaseException:
            if created:
                dist.destroy_process_group()
            raise
    compat = CpuCompat().__enter__()
    try:
        health = health_group(backend, timeout_s)
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp, context_parallel_size=cp,
            expert_model_parallel_size=ep,
            distributed_timeout_minutes=timeout_s / 60)  # megatron makes a timedelta of it
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        groups = default_groups()  # megatron's groups, now up, as the step's pg_collection
    except BaseException:
        compat.__exit__(None, None, None)
        raise
    _ENV = DistEnv(rank=rank, world_size=world, local_rank=local_rank, backend=backend,
                   device=device, tp=tp, pp=pp, dp=world // (tp * pp * cp), cp=cp, ep=ep, vp=vp,
                   compat=compat, timeout_s=timeout_s, health=health, groups=groups)
    return _ENV


def shutdown() -> None:
    """Destroy megatron parallel state and the process group, and leave CpuCompat."""
    global _ENV
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    if _ENV is not None:
        _ENV.compat.__exit__(None, None, None)
    _ENV = None


def optional_backends() -> dict[str, bool]:
    """Which optional accelerated backends import here (NVIDIA Apex, Transformer Engine)."""
    found = {}
    for name, mod in (("apex", "apex.normalization"), ("transformer_engine", "transformer_engine.pytorch")):
        try:
            __import__(mod)
            found[name] = True
        except Exception:  # noqa: BLE001 - a broken optional install counts as absent
            found[name] = False
    return found
