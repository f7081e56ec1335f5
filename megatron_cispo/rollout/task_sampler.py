"""The synthetic task's sampler in a run: rank 0's engine (rollout.engine torch or hf) on the trainer's
weights streamed in named buckets, the batch broadcast to every rank.

    sampler = TaskSampler(cfg, rank=env.rank, device=env.device)   # every rank
    sampler.push(version, chunks)                                    # after each step: the new version
    batch = sampler.rollouts(step)                                   # collective: rank 0 samples, all get it

Step t samples with policy version max(0, t - rollout.staleness), streamed into the engine
(prompt_weights.EngineWeights, as for vLLM) whenever it differs from the engine's: nothing is gathered,
and with staleness k > 0 each rank keeps only its own shards of the last k versions, which checkpoints
save sharded like the model. The batch is Sampler's (sampler.py): the same keyed draws, so every layout
gets the same batch. Sampler itself (full states through sync()) is what the unit tests drive.
"""
from __future__ import annotations

import torch

from .prompt_weights import EngineWeights
from .sampler import Batch, Sampler


class TaskSampler(EngineWeights, Sampler):
    def __init__(self, cfg, *, rank: int, device: torch.device | str = "cpu"):
        super().__init__(cfg.model, cfg.rollout, seed=cfg.run.seed, device=device)
        self._init_weights(cfg, rank)

    def _start_engine(self, model_dir, stream: bool) -> dict:
        """Rank 0: rollout.engine in this process, fed by update_weights."""
        from .engine import EngineStart, engine_spec

        self.engine_ = engine_spec(self.cfg.engine).open(EngineStart(
            model=self.model_cfg, precision=self.cfg.precision, seed=self.seed, max_model_len=self.task.total_len,
            device=self.device))
        return {}

    def rollouts(self, step: int) -> Batch:
        """Collective: the global batch of 0-based `step`, sampled on rank 0 and broadcast."""
        version = self._held_version(step)
        error = None
        if self.loaded != version:
            _, error = self._stream_to_engine(version)
        box: list = [None]
        if self.rank == 0:
            try:
                if error:
                    raise RuntimeError(error)
                box[0] = self._batch(step, version, self.engine_)
            except Exception as e:  # noqa: BLE001 - the engine failed: every rank must stop, not wait
                box[0] = f"[{self.exp.label}] rollout at step {step + 1} failed: {e}"
        return self._share(box)

    def state_dict(self) -> dict:
        """No weights: the lagged versions go into the checkpoint sharded (lagged_shards)."""
        return {"versions": {}}

    def load_state_dict(self, state: dict) -> None:
        self.versions = {}
        self._versions_in_checkpoint = False
        self.loaded = None  # the engine gets the checkpoint's weights before it samples again

    def close(self) -> None:
        if self.engine_ is not None:
            self.engine_.close()
        self.engine_ = None
        super().close()
