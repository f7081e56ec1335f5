"""The `optimizer:` section of the YAML experiment: megatron-core's optimizer, its LR schedule and
whether its state is sharded over the data-parallel ranks (runner/model.py builds it).

    lr = cfg.optimizer.lr_at(step, total=cfg.run.steps)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..config import check_field_types, config_field


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    name: Literal["adam", "sgd"] = config_field("adam", "Megatron optimizer.")
    lr: float = config_field(1e-3, "Peak learning rate.")
    min_lr: float = config_field(0.0, "Final learning rate of the cosine/linear decay.")
    schedule: Literal["constant", "cosine", "linear"] = config_field(
        "constant", "Decay after warmup, from lr to min_lr over the run.")
    warmup_steps: int = config_field(0, "Linear warmup from 0 to lr over this many steps.")
    weight_decay: float = config_field(0.0, "Decoupled weight decay.")
    clip_grad: float = config_field(1.0, "Global grad-norm clip; 0 disables clipping.")
    adam_beta1: float = config_field(0.9, "Adam beta1.")
    adam_beta2: float = config_field(0.999, "Adam beta2.")
    distributed: bool = config_field(
        False, "megatron-core's distributed optimizer: fp32 master weights and optimizer state sharded over the "
        "data-parallel ranks (DP x CP), gradients reduce-scattered during the backward (overlapped) and parameters "
        "all-gathered after the step; checkpoints resume on another (tp, pp, dp) layout. Adam only.")

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("lr", "min_lr", "weight_decay", "clip_grad", "adam_beta1", "adam_beta2"):
            if not math.isfinite(getattr(self, name)):  # an inf lr trains on NaN from the first step
                raise ValueError(f"optimizer.{name} must be finite, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2"):  # beta >= 1 never forgets; > 1 diverges
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        if not self.lr > 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optimizer.lr={self.lr} must be > 0 and optimizer.min_lr={self.min_lr} in [0, lr]")
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.clip_grad < 0:
            raise ValueError(f"optimizer.clip_grad must be >= 0, got {self.clip_grad}")
        if self.distributed and self.name != "adam":
            raise ValueError(f"optimizer.distributed=true shards Adam's state; megatron-core's distributed optimizer "
                             f"refuses optimizer.name={self.name!r} (its checkpoints need Adam's): use adam, or "
                             "optimizer.distributed: false")

    def lr_at(self, step: int, total: int) -> float:
        """Learning rate of 0-based optimizer step `step` out of `total`."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        frac = (step - self.warmup_steps) / max(1, total - self.warmup_steps)
        decay = 0.5 * (1.0 + math.cos(math.pi * frac)) if self.schedule == "cosine" else 1.0 - frac
        return self.min_lr + (self.lr - self.min_lr) * decay
