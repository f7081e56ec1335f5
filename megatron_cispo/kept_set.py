"""Sampling-mask replay: the sampler's kept vocabulary ids per position (what survived top-k,
top-p, min-p...), in the compressed-row form vLLM returns, and this shard's sparse part of the
log-sum-exp over them that token_logprobs and fused_token_logprobs renormalise with.

    keep = KeptSet.from_lists(completion.sampling_mask.token_ids)   # vLLM: list[list[int]]
    lp = token_logprobs(logits, targets, keep=keep)   # x[t] - logsumexp_{v in K_t} x[v], x = logits / T
A position with no kept ids is not replayed: it keeps the whole vocabulary. Memory is O(kept ids).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from .vocab_softmax import EMPTY_MAX, Plan


def _is_int(t: Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


@dataclass(frozen=True, eq=False)
class KeptSet:
    """Kept vocabulary ids of N positions, compressed rows (vLLM's SamplingMaskLists layout).

    ids: [K] int32|int64 global vocabulary ids, strictly ascending within a position.
    offsets: [N+1] int, offsets[0] = 0, non-decreasing, offsets[N] = K: position i keeps
        ids[offsets[i]:offsets[i+1]]. Positions are the row-major flattened [*lead] positions
        of the op's targets. An empty position is not replayed (full vocabulary).
    Construction checks all of this with one host sync.
    """

    ids: Tensor
    offsets: Tensor

    def __post_init__(self):
        ids, off = self.ids, self.offsets
        if ids.dim() != 1 or not _is_int(ids):
            raise ValueError(f"keep.ids: expected a 1-d int tensor of vocabulary ids, found {ids.dtype} "
                             f"of shape {tuple(ids.shape)}")
        if off.dim() != 1 or off.numel() < 1 or not _is_int(off) or off.device != ids.device:
            raise ValueError(f"keep.offsets: expected a 1-d int [N+1] tensor on {ids.device} (ids' device), "
                             f"found {off.dtype} of shape {tuple(off.shape)} on {off.device}")
        k = ids.numel()
        # the row of each id, robust to bad offsets (then only the offsets check below matters)
        row = torch.searchsorted(off[1:].long(), torch.arange(k, device=ids.device), right=True)
        ids64 = ids.long()
        unsorted = (ids64[1:] <= ids64[:-1]) & (row[1:] == row[:-1])
        flags = torch.stack([off[0] != 0, off[-1] != k, (off.diff() < 0).any(), (ids64 < 0).any(),
                             unsorted.any()]).tolist()  # the one host sync
        if any(flags[:3]):
            raise ValueError(f"keep.offsets: expected offsets[0] = 0, non-decreasing, offsets[-1] = "
                             f"{k} (len(ids)), found offsets[0] = {int(off[0])}, offsets[-1] = {int(off[-1])}"
                             f"{', and a decrease' if flags[2] else ''}")
        if flags[3]:
            raise ValueError(f"keep.ids: expected vocabulary ids >= 0, found {int(ids64.min())}")
        if flags[4]:
            j = int(unsorted.nonzero()[0, 0]) + 1
            raise ValueError(f"keep.ids: expected strictly ascending ids within a position (a set, as vLLM "
                             f"returns it), found {int(ids64[j - 1])} then {int(ids64[j])} at position "
                             f"{int(row[j])}; sort each position's ids and drop duplicates")

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]], *, device=None) -> KeptSet:
        """From vLLM's `sampling_mask.token_ids` (list[list[int]], one list per position; [] = no replay).
        Each list is sorted here; ids int32 (as vLLM sends them), offsets int64."""
        counts = torch.tensor([0] + [len(r) for r in rows], dtype=torch.int64)
        ids = torch.tensor([v for r in rows for v in sorted(r)], dtype=torch.int32)
        return cls(ids.to(device), counts.cumsum(0).to(device))

    @classmethod
    def from_mask(cls, mask: Tensor) -> KeptSet:
        """From a dense bool [*lead, V] mask (True = kept); a position with no True is not replayed."""
        flat = mask.reshape(-1, mask.shape[-1])
        offsets = torch.zeros(flat.shape[0] + 1, dtype=torch.int64, device=mask.device)
        torch.cumsum(flat.sum(1), 0, out=offsets[1:])
        return cls(flat.nonzero()[:, 1].to(torch.int32), offsets)  # row-major: ascending per position

    @classmethod
    def trusted(cls, ids: Tensor, offsets: Tensor) -> KeptSet:
        """A KeptSet whose invariants the caller guarantees (derived from a checked one): no host sync."""
        obj = cls.__new__(cls)
        object.__setattr__(obj, "ids", ids)
        object.__setattr__(obj, "offsets", offsets)
        return obj

    @property
    def n(self) -> int:
        return self.offsets.numel() - 1

    def take(self, index: Tensor) -> KeptSet:
        """The kept sets of positions `index` ([*] int, flattened; -1 gives an empty set), in that
        order: a vectorised gather of compressed rows. One host sync (the output's size)."""
        index = index.reshape(-1).to(self.offsets.device, torch.int64)
        present = index >= 0
        i = torch.where(present, index, 0)
        start = self.offsets[i].long()
        counts = torch.where(present, self.offsets[i + 1].long() - start, 0)
        offsets = torch.zeros(index.numel() + 1, dtype=torch.int64, device=index.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        total = int(offsets[-1])
        src = torch.repeat_interleave(start - offsets[:-1], counts, output_size=total)
        return KeptSet.trusted(self.ids[src + torch.arange(total, device=index.device)], offsets)


@dataclass(frozen=True, eq=False)
class Replay:
    """One op call's part of a KeptSet on this TP shard: the kept ids that fall in this shard's
    valid columns, of replayed positions only, in compressed-row order ([E] each, E <= K).

    The op reads their logits once (kv); reduce_stats (vocab_softmax.py) then packs their max into
    its MAX all-reduce and their sums into its SUM all-reduce, so replay adds no collective."""

    row: Tensor   # [E] int64 flattened position
    col: Tensor   # [E] int64 column in this shard
    hit: Tensor   # [E] bool: the id is its position's target
    rows: Tensor  # [N] bool: replayed positions (not ignored, non-empty kept set)
    kv: Optional[Tensor] = None  # [E] fp32 raw logits of the entries, once the forward read them

    def local_max(self) -> Tensor:
        """[N] fp32: the largest kept logit of each position in this shard (EMPTY_MAX if none)."""
        mk = torch.full(self.rows.shape, EMPTY_MAX, dtype=torch.float32, device=self.rows.device)
        return mk.scatter_reduce_(0, self.row, self.kv, "amax")

    def sums(self, mk: Tensor, tx: Tensor, owned: Tensor, temperature: float) -> list[Tensor]:
        """[sk, tdk], [N] fp32 each, this shard's parts of the SUM all-reduce: sk = sum over kept
        ids of exp((x_v - mk) / T) and tdk = (x_target - mk) / T on the target's owner. mk is the
        kept max over all shards, so sk >= exp(0) = 1 after the sum: no underflow, whatever the
        distance from the full-vocabulary max."""
        e = torch.exp((self.kv - mk[self.row]) / temperature)
        sk = torch.zeros_like(mk).index_add_(0, self.row, e)
        return [sk, torch.where(owned, (tx - mk) / temperature, 0.0)]

    def finish(self, lp: Tensor, mk: Tensor, sk: Tensor, tdk: Tensor, temperature: float):
        """(lp with replayed positions over their kept set, pk [E] fp32 the kept probabilities)."""
        pk = torch.exp((self.kv - mk[self.row]) / temperature) / sk[self.row]
        return torch.where(self.rows, tdk - sk.log(), lp), pk

    def dense_part(self, g_lp: Optional[Tensor]) -> Optional[Tensor]:
        """g_lp with the replayed positions zeroed: their logprob gradient is sparse (coef)."""
        return None if g_lp is None else torch.where(self.rows.view(g_lp.shape), 0.0, g_lp)

    def coef(self, g_lp: Optional[Tensor], pk: Tensor, temperature: float) -> Tensor:
        """[E] fp32 d loss / d logit of each entry: g (1[v = target] - p^K_v) / T."""
        if g_lp is None:
            return torch.zeros_like(pk)
        return g_lp.reshape(-1).float()[self.row] * (self.hit.float() - pk) / temperature

    def by_chunk(self, rows: Optional[Tensor], chunk_rows: int):
        """Entries grouped by the op's row chunks. rows: [R] ascending positions the op loops over
        (None: all N). Returns (pos [E] each entry's place in rows, -1 if absent; sel: the present
        entries in order; bounds: chunk c holds sel[bounds[c]:bounds[c+1]]). Host syncs: 1-2."""
        n = self.rows.numel() if rows is None else rows.numel()
        if rows is None:
            pos, sel = self.row, torch.arange(self.row.numel(), device=self.row.device)
        else:
            where = torch.full(self.rows.shape, -1, dtype=torch.int64, device=rows.device)
            where[rows] = torch.arange(n, device=rows.device)
            pos = where[self.row]
            sel = (pos >= 0).nonzero().squeeze(1)
        starts = torch.tensor(list(range(0, n, chunk_rows)) + [n], device=pos.device)
        return pos, sel, torch.searchsorted(pos[sel], starts).tolist()


def check_targets(keep: KeptSet, targets: Tensor, valid: Tensor, vocab: Optional[int] = None):
    """(row [K] each id's position, hit [K] bool, rows [N] bool replayed) after checking that keep
    has one set per position of targets ([*lead] int, valid: [*lead] bool), on their device, that
    every valid target is in its non-empty set (it was sampled from it), and ids < vocab if given.
    One host sync."""
    if not isinstance(keep, KeptSet):
        raise ValueError(f"keep: expected a KeptSet or None, found {type(keep).__name__}")
    t, n = targets.reshape(-1).long(), targets.numel()
    if keep.n != n or keep.ids.device != t.device:
        raise ValueError(f"keep: expected kept sets of {n} positions (targets {tuple(targets.shape)}, "
                         f"flattened) on {t.device}, found {keep.n} positions on {keep.ids.device}")
    ids, counts = keep.ids.long(), keep.offsets.diff()
    row = torch.repeat_interleave(torch.arange(n, device=t.device), counts, output_size=ids.numel())
    hit = ids == t[row]
    found = torch.zeros(n, dtype=torch.int32, device=t.device).index_add_(0, row, hit.int()) > 0
    rows = valid.reshape(-1) & (counts > 0)
    missing = rows & ~found
    big = torch.zeros((), dtype=torch.bool, device=t.device) if vocab is None else (ids >= vocab).any()
    flags = torch.stack([big, missing.any()]).tolist()  # the host sync
    if flags[0]:
        raise ValueError(f"keep.ids: expected ids in [0, {vocab}) (vocab_size), found {int(ids.max())}")
    if flags[1]:
        i = int(missing.nonzero()[0, 0])
        pos = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), targets.shape))
        raise ValueError(f"keep: the target {int(t[i])} at position {pos} is not in its kept set of "
                         f"{int(counts[i])} ids, so the sampler cannot have drawn it; align keep with the "
                         "targets (one set per target, after the shift) or mask the position")
    return row, hit, rows


def plan_replay(keep: Optional[KeptSet], targets: Tensor, valid: Tensor, plan: Plan) -> Optional[Replay]:
    """This shard's Replay of `keep` for targets ([*lead] int, valid: [N] bool not ignored), or
    None without keep. Host syncs: one for check_targets, one to select this shard's entries."""
    if keep is None:
        return None
    row, hit, rows = check_targets(keep, targets, valid, plan.vocab)
    ids = keep.ids.long()
    local = (ids >= plan.start) & (ids < plan.start + plan.n_valid) & rows[row]
    sel = local.nonzero().squeeze(1)  # host sync: this shard's entries
    return Replay(row[sel], ids[sel] - plan.start, hit[sel], rows)
