"""Metrics: the one metric type of megatron_cispo, pure data with no process groups.

A loss records detached parts that reduce exactly: means as (sum, count), min, max and plain
totals. `Metrics.merge` combines microbatches on one rank; `step.reduce_metrics` reduces over a
process group; `values()` forms the final numbers (each mean once, after all sums).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Metrics:
    """Detached 0-dim fp32 parts: `sums` key -> (sum, count); `mins`, `maxs`, `totals` key -> value.

    Keys are namespaced ("cispo/ratio_mean", "policy/tokens"). Every rank of a reduction must
    hold the same keys; a min or max over no valid token is +inf / -inf, so it never wins.
    """

    sums: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    mins: dict[str, Tensor] = field(default_factory=dict)
    maxs: dict[str, Tensor] = field(default_factory=dict)
    totals: dict[str, Tensor] = field(default_factory=dict)

    def mean(self, key: str, values: Tensor, mask: Tensor) -> None:
        values = torch.where(mask, values.detach().float(), 0.0)
        self.sums[key] = (values.sum(), mask.sum().float())

    def weighted_mean(self, key: str, values: Tensor, weights: Tensor, mask: Tensor) -> None:
        """Mean of `values` where each masked element weighs `weights` (e.g. 1/len: per sequence)."""
        w = torch.where(mask, weights.detach().float(), 0.0)
        self.sums[key] = ((values.detach().float() * w).sum(), w.sum())

    def frac(self, key: str, hit: Tensor, mask: Tensor) -> None:
        self.mean(key, hit.float(), mask)

    def min_max(self, key: str, values: Tensor, mask: Tensor) -> None:
        v = values.detach().float().reshape(-1)
        m = mask.reshape(-1)
        inf = torch.tensor(float("inf"), device=v.device)
        self.mins[f"{key}_min"] = torch.where(m, v, inf).amin() if v.numel() else inf
        self.maxs[f"{key}_max"] = torch.where(m, v, -inf).amax() if v.numel() else -inf

    def total(self, key: str, value: Tensor) -> None:
        self.totals[key] = value.detach().float()

    def update(self, other: Metrics, prefix: str = "") -> Metrics:
        """Add `other`'s keys (prefixed) to this one, replacing equal keys."""
        for mine, theirs in ((self.sums, other.sums), (self.mins, other.mins),
                             (self.maxs, other.maxs), (self.totals, other.totals)):
            mine.update({prefix + k: v for k, v in theirs.items()})
        return self

    def keys(self) -> list[str]:
        return sorted([*self.sums, *self.mins, *self.maxs, *self.totals])

    def device(self) -> torch.device | None:
        """Device of the recorded tensors (None when empty); reductions build their buffers here."""
        for t in (*(s for s, _ in self.sums.values()), *self.mins.values(), *self.maxs.values(),
                  *self.totals.values()):
            return t.device
        return None

    @staticmethod
    def merge(parts: Iterable[Metrics]) -> Metrics:
        """Microbatches on one rank -> one Metrics: sums and totals add, mins min, maxs max."""
        out = Metrics()
        for m in parts:
            for k, (s, c) in m.sums.items():
                s0, c0 = out.sums.get(k, (0.0, 0.0))
                out.sums[k] = (s + s0, c + c0)
            for k, v in m.totals.items():
                out.totals[k] = v + out.totals[k] if k in out.totals else v.clone()
            for k, v in m.mins.items():
                out.mins[k] = torch.minimum(out.mins[k], v) if k in out.mins else v.clone()
            for k, v in m.maxs.items():
                out.maxs[k] = torch.maximum(out.maxs[k], v) if k in out.maxs else v.clone()
        return out

    def values(self) -> dict[str, Tensor]:
        """Final values: sum / max(count, 1), min, max, total (0-dim tensors, detached)."""
        out = {k: s / c.clamp(min=1.0) for k, (s, c) in self.sums.items()}
        return {**out, **self.mins, **self.maxs, **self.totals}
