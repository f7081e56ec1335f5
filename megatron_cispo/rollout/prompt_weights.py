"""PromptSampler's weights (rollout/prompt_sampler.py): each policy version into the engine, and the lagged
versions in checkpoints.

rollout.sync=stream: nothing is gathered; one rank per stage streams the version in named buckets
(weight_stream.py) into the engine's update_weights; in sync mode with rollout.staleness k > 0 every rank
with DP = CP = 0 keeps its own shards of the last k versions, in their dtype, and a checkpoint saves them
sharded like the model (runner/checkpoint_lagged.py calls lagged_shards / load_lagged). rollout.sync=disk
(the fallback): every version gathered whole on rank 0 and written as an fp32 HF directory for vLLM to reload.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..base.console import say
from ..base.param_names import canonical_names, sends_param
from ..hf.export import write_hf_dir
from ..hf.mapping import to_hf
from .prompt_sources import RolloutFailed, _pause_for_tests
from .sampler import Batch


class EngineWeights:
    """The weights side of the samplers with an engine on rank 0 (PromptSampler, TaskSampler): each version
    into the engine, the lagged versions, the batch shared with every rank. Its own state: _init_weights()."""

    def _init_weights(self, cfg, rank: int, wait_group=None) -> None:
        """The state this side keeps; called by the sampler's __init__ after Sampler's."""
        self.exp, self.rank = cfg, rank
        self.engine_ = None  # rank 0: the engine (rollout.engine), started at the first push
        self.loaded: Optional[int] = None  # the policy version the engine holds
        self.chunks = None  # rollout.sync=stream: the model chunks, the live version's weights
        self.live: Optional[int] = None  # the version the live parameters hold
        self.wait_group = wait_group  # the group the batch's broadcast runs in (None: the default one)
        self._lagged_loaded: dict = {}  # the checkpoint's lagged versions, until resumed() takes them
        self._versions_in_checkpoint = False  # rollout.sync=disk: the checkpoint held rank 0's versions
        self._megatron_manifest: Optional[dict] = None  # megatron-named engines: gathered at the first push

    def _export(self, version: int) -> tuple[Path, int]:
        """Policy version `version` as an HF directory for vLLM; (its path, bytes of weights written)."""
        out = Path(self._tmp) / f"v{version}"
        write_hf_dir(to_hf(canonical_names(self.versions[version]), self.model_cfg.arch), self.model_cfg.arch,
                     out, dtype=torch.float32)
        return out, sum(f.stat().st_size for f in out.glob("*.safetensors"))

    def _engine_at(self, version: int) -> dict:
        """rollout.sync=disk: start the engine on `version`, or reload it there; the sync metrics."""
        if self.loaded == version:
            return {"sync/seconds": 0.0, "sync/bytes": 0.0}
        t0 = time.perf_counter()
        path, nbytes = self._export(version)
        info = {"sync/bytes": float(nbytes)}
        if self.engine_ is None:
            info.update(self._start_engine(str(path), stream=False))
        else:
            self.engine_.load_weights(str(path))
        info["sync/seconds"] = time.perf_counter() - t0
        if self.loaded is not None:
            shutil.rmtree(Path(self._tmp) / f"v{self.loaded}", ignore_errors=True)
        self.loaded = version
        return info

    def _stream_to_engine(self, version: int) -> tuple[dict, Optional[str]]:
        """Collective (rollout.sync=stream): version `version` into rank 0's engine (rollout.engine, started
        on first use), bucket by bucket, named as the engine names its weights; rank 0 returns (sync
        metrics, None) or ({}, the failure's line), having drained the stream either way so no sender is
        left waiting. The engine's previous weights stay when the push fails."""
        from .engine import engine_spec
        from .weight_stream import stream_buckets

        held = self.versions[version]  # None: the live parameters (or, on a rank that sends nothing, nothing)
        if held is None and version != self.live and self._sends():
            raise RuntimeError(f"sampler: version {version} is neither held nor live ({self.live})")
        namer, size = engine_spec(self.cfg.engine).namer(self.model_cfg.arch), self.cfg.sync_bucket_bytes
        stream = lambda buffer=None: stream_buckets(self.chunks, namer=namer, bucket_bytes=size,  # noqa: E731
                                                    tensors=held, buffer=buffer)
        if self.rank != 0:
            for _ in stream():
                pass
            self.loaded = version
            return {}, None
        info, error, buckets = {}, None, None
        try:
            if self.engine_ is None:
                info.update(self._start_engine(self.model_cfg.hf_path, stream=True))
            packed = getattr(self.engine_, "buffer", None)  # an engine in its own process maps a shared file
            buckets = stream(packed(self.manifest, size) if packed else None)
            info.update(self.engine_.update_weights(self._paused(buckets, version), manifest=self.manifest,
                                                     bucket_bytes=size))
        except Exception as e:  # noqa: BLE001 - reported on every rank through the batch's broadcast
            error = f"weight sync of policy version {version} failed: {e}"
        for _ in buckets if buckets is not None else stream():  # after a failure the other senders still send
            pass
        self.loaded = None if error else version
        return info, error

    @property
    def manifest(self) -> dict:
        """Every tensor a complete push holds, as the engine names them: the HF export mapping's shapes, or
        (megatron names) the stream's own, gathered once at the first push."""
        from ..hf.mapping import hf_shapes
        from .engine import engine_spec

        if engine_spec(self.cfg.engine).names == "hf":
            return hf_shapes(self.model_cfg.arch)
        return self._megatron_manifest

    def _paused(self, buckets, version: int):
        for i, bucket in enumerate(buckets):
            yield bucket
            if i == 0:
                _pause_for_tests(self.exp.run.run_dir, "push", version)

    def _sends(self) -> bool:
        """Whether this rank holds the sent copy of some parameter (sends_param: DP = CP = 0, expert DP = 0)."""
        return any(self._owned(self.chunks))

    @staticmethod
    def _owned(chunks) -> list[dict]:
        """Per chunk {parameter name: parameter} of the parameters whose copy on this rank is sent."""
        return [{n: p for n, p in getattr(c, "module", c).named_parameters() if sends_param(n)} for c in chunks]

    def sync(self, version: int, full_state) -> None:
        """rollout.sync=disk: rank 0 keeps the versions (it alone exports them, and the checkpoint holds
        its state); the other ranks took part in the gather and keep nothing."""
        if self.rank == 0:
            super().sync(version, full_state)

    def push(self, version: int, chunks) -> None:
        """Collective with rollout.sync=disk (the gather). rollout.sync=stream: the live parameters are now
        `version`; with rollout.staleness k > 0 every rank keeps a copy of the shards it sends (DP = CP = 0;
        experts: expert DP = 0), in their dtype, for the k steps that will sample with it. Nothing is gathered."""
        if self.cfg.sync == "disk":
            return super().push(version, chunks)
        self.chunks, self.live = chunks, version
        if self._megatron_manifest is None:
            from .engine import engine_spec
            from .weight_stream import stream_manifest

            spec = engine_spec(self.cfg.engine)
            self._megatron_manifest = {} if spec.names == "hf" else stream_manifest(chunks, spec.namer(None))
        if self.cfg.mode == "async":  # no versions kept: the old weights are whatever the engine still holds
            self.versions = {version: None}
            return self._push_async(version)
        owned = self._owned(chunks) if self.cfg.staleness > 0 else []
        self.versions[version] = [{n: p.detach().clone() for n, p in per.items()} for per in owned] \
            if any(owned) else None
        for v in [v for v in self.versions if v < version - self.cfg.staleness]:
            del self.versions[v]

    def resumed(self, step: int, chunks) -> None:
        """Collective, after a checkpoint's load: its model is version `step`. rollout.sync=stream in sync
        mode: the lagged versions come from the checkpoint, sharded (load_lagged), so the lag continues
        exactly; from a checkpoint without them (async mode's, staleness 0's) the lag restarts at 0 and is
        back at rollout.staleness k steps later. rollout.sync=disk from a checkpoint without versions (a
        stream run's): gathered."""
        if self.cfg.sync == "disk" and not self._versions_in_checkpoint:
            super().push(step, chunks)
        if self.cfg.sync == "stream":
            lagged, self._lagged_loaded = self._lagged_loaded, {}
            keep = self.cfg.mode == "sync" and self.cfg.staleness > 0
            self.versions = {v: held for v, held in lagged.items() if keep and step - self.cfg.staleness <= v < step}
            self.push(step, chunks)
            if keep and not self.versions and self.rank == 0:
                say(f"[{self.exp.label}] the checkpoint holds no lagged versions (it was saved in async mode or at "
                    f"staleness 0): sampling restarts with the checkpoint's weights (lag 0), back to "
                    f"rollout.staleness={self.cfg.staleness} after {self.cfg.staleness} steps")

    def lagged_shards(self) -> dict:
        """{version: per chunk {parameter name: this rank's shard}} of the versions older than the live
        one, on the ranks that keep them (rollout.sync=stream, sync mode, staleness > 0); else {}."""
        if self.cfg.sync != "stream" or self.cfg.mode != "sync":
            return {}
        return {v: held for v, held in self.versions.items() if held is not None and v != self.live}

    def holds_lagged(self) -> bool:
        """Whether this run keeps lagged shards, so loads a checkpoint's (each rank those it sends: sends_param)."""
        return self.cfg.sync == "stream" and self.cfg.mode == "sync" and self.cfg.staleness > 0

    def load_lagged(self, versions: dict) -> None:
        """The checkpoint's lagged versions ({version: shards, or None on a rank that keeps none}), taken
        up by resumed()."""
        self._lagged_loaded = dict(versions)

    def _share(self, box: list) -> Batch:
        """Collective: rank 0's batch (or its failure's line, then RolloutFailed on every rank) to every rank."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            on_host = self.wait_group is not None or str(self.device) == "cpu"
            dist.broadcast_object_list(box, src=0, group=self.wait_group,
                                       device=None if on_host else torch.device(self.device))
        if isinstance(box[0], str):
            if self.rank == 0:
                say(box[0])
            raise RolloutFailed(box[0])
        return box[0]
