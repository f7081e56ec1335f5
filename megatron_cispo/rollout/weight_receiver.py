"""The receiving end of the weight stream (weight_stream.py): full tensors assembled from blocks, handed on
only when every tensor of the manifest is complete, so an engine never loads a mix of two versions.

    staging = Staging({"model.norm.weight": (64,), ...})       # name -> full shape (the manifest)
    staging.add(bucket.blocks, bucket.data)                    # per bucket; ValueError for a stray block
    weights = staging.complete()                               # {name: tensor}; ValueError if any is short

It holds one model's tensors in the blocks' dtype while a push is under way: the engine's side of the
price of an all-or-nothing update (the trainer's side stays at about two buckets).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .weight_stream import Block


class Staging:
    def __init__(self, manifest: dict[str, tuple[int, ...]]):
        self.manifest = {k: tuple(v) for k, v in manifest.items()}
        self.tensors: dict[str, Tensor] = {}
        self.filled: dict[str, int] = {}
        self.popped: set[str] = set()

    def add(self, blocks: list[Block], data: Tensor) -> list[str]:
        """Copy each block out of `data` (its bucket's bytes) into its full tensor; the names this
        completed (pop() hands one over and frees it here)."""
        done = []
        for b in blocks:
            want = self.manifest.get(b.name)
            if want is None:
                raise ValueError(f"weight stream: block of {b.name}, which the engine's model does not have")
            if tuple(b.shape) != want:
                raise ValueError(f"weight stream: {b.name} has shape {tuple(b.shape)}, the engine's model {want}")
            src = b.view(data)
            dst = self.tensors.get(b.name)
            if dst is None:
                dst = self.tensors[b.name] = torch.empty(want, dtype=src.dtype)
            rows = slice(b.row, b.row + src.shape[0])
            if src.dim() == 1:
                dst[rows].copy_(src)
            else:
                dst[rows, b.col:b.col + src.shape[1]].copy_(src)
            self.filled[b.name] = self.filled.get(b.name, 0) + src.numel()
            if self.filled[b.name] > dst.numel():
                raise ValueError(f"weight stream: {b.name} received more elements than its shape {want} holds")
            if self.filled[b.name] == dst.numel():
                done.append(b.name)
        return done

    def pop(self, name: str) -> Tensor:
        """Complete tensor `name`, handed over: this staging keeps only that it arrived."""
        self.popped.add(name)
        return self.tensors.pop(name)

    def complete(self) -> dict[str, Tensor]:
        """Every manifest tensor, fully written; ValueError naming the first one missing or short."""
        for name, shape in self.manifest.items():
            if name in self.popped:
                continue
            got, want = self.filled.get(name, 0), self.tensors[name].numel() if name in self.tensors else None
            if want is None or got != want:
                raise ValueError(f"weight stream ended with {name} {'missing' if want is None else f'at {got}/{want} elements'}"
                                 f" (shape {shape}): none of it is used: the engine keeps its previous weights, an export"
                                 " is not written")
        return self.tensors
