"""vLLM's weight-transfer API on CPU: a shared-memory engine registered under vLLM's WeightTransferEngine,
so the CPU build takes the trainer's weights through the same init_weight_transfer_engine /
start_weight_update / update_weights / finish_weight_update calls a GPU run makes with vLLM's nccl engine.

    register()                          # in the vLLM process, before vllm.LLM(weight_transfer_config=...)
    LLM(..., weight_transfer_config={"backend": BACKEND})

The trainer writes each bucket (weight_stream.Bucket) into one file in /dev/shm that both processes map;
update_weights carries the block list. Blocks are staged (weight_receiver.Staging) and loaded at
finish_weight_update through vLLM's in-place reload (reload_weights with a weights iterator), which
reruns the post-load processing that repacks the CPU linear kernels: a plain model.load_weights into the
packed weights was wrong in fp32. A push that ends short, or is aborted, loads nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from .weight_receiver import Staging
from .weight_stream import Block

BACKEND = "cispo_shm"


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    path: str  # the shared file the trainer writes each bucket into
    nbytes: int  # its size: rollout.sync_bucket_mb
    manifest: dict = field(default_factory=dict)  # HF name -> full shape: what a complete push holds


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    blocks: list = field(default_factory=list)  # weight_stream.Block fields, as tuples
    nbytes: int = 0  # the bucket's bytes at the start of the shared file


class SharedMemoryEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self.buf = torch.from_file(init_info.path, shared=True, size=init_info.nbytes, dtype=torch.uint8)
        self.manifest = dict(init_info.manifest)
        self.staging: Staging | None = None

    def start_weight_update(self) -> None:
        self.staging = Staging(self.manifest)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing to synchronize

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        if self.staging is None:
            raise RuntimeError("update_weights without start_weight_update")
        self.staging.add([Block(*b) for b in update_info.blocks], self.buf[:update_info.nbytes])

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        staging, self.staging = self.staging, None
        if staging is None:
            raise RuntimeError("finish_weight_update without start_weight_update")
        weights = staging.complete()  # ValueError before anything is loaded
        reload_weights(self.vllm_config, self.model, weights_iterator=iter(weights.items()), weights_path=None,
                       is_checkpoint_format=True)

    def abort(self) -> None:
        """Drop a push under way: nothing of it was loaded."""
        self.staging = None

    def shutdown(self) -> None:
        self.buf = self.staging = None


def register() -> None:
    """Register BACKEND with vLLM's weight-transfer factory (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, SharedMemoryEngine)


def abort_update(worker) -> None:
    """Run on vLLM's worker (collective_rpc): end a push that failed partway, keeping the loaded weights."""
    worker = getattr(worker, "worker", worker)  # collective_rpc hands over the wrapper, which only reads through
    engine = worker.weight_transfer_engine
    if engine is not None:
        engine.abort()
        engine.reset_weight_update_target()
    worker._weight_update_active = False
