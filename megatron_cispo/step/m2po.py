"""M2PO: one global, deterministic token selection per policy step, made before any microbatch runs.

    keep, metrics = m2po_keep(old_lp, rollout_lp, valid, tau, row_ids=dp_shard_row_ids(...), group=dp_group)

rho_t = pi_old / pi_rollout is known once pi_old is, so the valid tokens with the largest
(log rho)^2 are masked over the whole global batch (every DP rank) until the mean of (log rho)^2
over the kept valid tokens is <= tau. Ties are broken by (global sequence index, position), so
every layout masks the same tokens. The [n, s] keep mask travels with the rows into the
microbatches (step.packing) and reaches per_token_policy_loss(keep=...): masked tokens get no
loss and no gradient but stay in the denominator.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..losses.metrics import Metrics

_PAD = -1.0  # fills the fixed-size gather; every real (log rho)^2 is >= 0, so a pad never sorts first


def dp_shard_row_ids(n: int, mini_local: int, dp_rank: int, dp: int, device) -> Tensor:
    """[n] int64 global sequence index of each local row under Rollouts.dp_shard: local minibatch
    j (rows j*mini_local ...) is DP rank dp_rank's share of global minibatch j, which holds global
    rows j*mini_local*dp + dp_rank*mini_local + r. One minibatch (mini_local = n): dp_rank*n + r."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    return (i // mini_local) * (mini_local * dp) + dp_rank * mini_local + i % mini_local


def mask_count(m2_sorted: Tensor, tau: float) -> Tensor:
    """Smallest k such that mean(m2_sorted[k:]) <= tau, for m2_sorted [N] fp64 in descending order:
    0-dim int64 tensor, no host sync. k = N (every token masked) when even the smallest value is
    above tau: the mean over no token is taken as within the budget, so the bound always holds."""
    n = m2_sorted.numel()
    suffix = m2_sorted.flip(0).cumsum(0).flip(0)  # suffix[k] = sum(m2_sorted[k:]), smallest first
    rest = torch.arange(n, 0, -1, dtype=torch.float64, device=m2_sorted.device)
    ok = torch.cat([suffix / rest <= tau, torch.ones(1, dtype=torch.bool, device=m2_sorted.device)])
    return ok.to(torch.int8).argmax()  # argmax returns the first maximal index


def total_order(values: Tensor, keys: Tensor) -> tuple[Tensor, bool]:
    """(permutation sorting by value descending, ties by key ascending; whether two keys are equal).
    Two sorts: by key, then a stable sort by value keeps the key order within ties."""
    by_key = torch.sort(keys)
    duplicate = bool((by_key.values.diff() == 0).any())  # host sync
    return by_key.indices[torch.sort(values[by_key.indices], descending=True, stable=True).indices], duplicate


def _gather(t: Tensor, group, world: int) -> Tensor:
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts)


def m2po_keep(old_logprobs: Tensor, rollout_logprobs: Tensor, valid: Tensor, tau: float, *,
              row_ids: Tensor, group=None) -> tuple[Tensor, Metrics]:
    """The global M2PO selection for this rank's rows; identical bits on every rank of `group`.

    old_logprobs, rollout_logprobs: [n, s] fp32 (pi_old, pi_rollout). valid: [n, s] bool, the
    tokens the loss trains (tokens with a non-finite old or rollout logprob are left out too).
    row_ids: [n] int64, the global sequence index of each row, unique over the group (the
    tie-break's first key; the position in the row is the second). group: the pure data-parallel
    group (None: this process alone); TP / CP / PP ranks of one DP rank hold the same rows and
    compute the same selection. Returns (keep [n, s] bool, False on masked tokens; Metrics of
    global sums: correction/m2po_masked_frac (tokens), correction/m2po_m2_before / _after (mean
    (log rho)^2 over valid / kept tokens), correction/m2po_kept_m2_max). Collectives, equal-sized
    as NCCL needs: all_gather of [count, s] int64, then all_gather of the values (fp64) and the
    keys (int64) padded to the largest count. Host syncs: the counts, the duplicate-key check, the cut.
    Every rank sorts the same global tokens in the same total order, so the prefix sums (fp64)
    and the cut are the same bits everywhere. Cost: O(N log N) in the global valid-token count.
    """
    n, s = valid.shape
    dev = valid.device
    if tuple(row_ids.shape) != (n,) or row_ids.dtype.is_floating_point or row_ids.dtype == torch.bool:
        raise ValueError(f"M2PO row_ids must be an int [n] = {(n,)} tensor of global sequence indices, got "
                         f"{row_ids.dtype} {tuple(row_ids.shape)}")
    valid = valid & torch.isfinite(old_logprobs) & torch.isfinite(rollout_logprobs)
    m2 = (old_logprobs.double() - rollout_logprobs.double()).square()
    world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    sizes = _gather(torch.stack([valid.sum(), torch.tensor(s, device=dev)]).to(torch.int64), group, world)
    counts, widths = sizes.view(world, 2).unbind(1)
    counts, width, top = counts.tolist(), int(widths.max()), int(counts.max())
    keys = row_ids.to(dev, torch.int64)[:, None] * width + torch.arange(s, device=dev)  # (row, position)
    local_v, local_k = m2[valid], keys[valid]
    pad = top - local_v.numel()
    all_v = _gather(torch.cat([local_v, local_v.new_full((pad,), _PAD)]), group, world).view(world, top)
    all_k = _gather(torch.cat([local_k, local_k.new_full((pad,), -1)]), group, world).view(world, top)
    real = torch.arange(top, device=dev)[None, :] < torch.tensor(counts, device=dev)[:, None]
    all_v, all_k = all_v[real], all_k[real]
    order, duplicate = total_order(all_v, all_k)
    v_sorted, k_sorted = all_v[order], all_k[order]
    if duplicate:  # every rank sees the same keys, so every rank raises
        raise ValueError("M2PO needs a unique global sequence index per row across data-parallel ranks; two "
                         "rows share one: pass policy_step(row_ids=...) or shard with Rollouts.dp_shard")
    k, total = int(mask_count(v_sorted, tau)), len(v_sorted)
    # A token is masked iff it comes before the first kept one (v_sorted[k], k_sorted[k]) in the order.
    cut_v = float(v_sorted[k]) if k < total else float("-inf")
    cut_k = int(k_sorted[k]) if k < total else torch.iinfo(torch.int64).max
    masked = valid & ((m2 > cut_v) | ((m2 == cut_v) & (keys < cut_k)))
    met = Metrics()
    f64 = dict(dtype=torch.float64, device=dev)
    met.sums["correction/m2po_masked_frac"] = (torch.tensor(k, **f64), torch.tensor(total, **f64))
    met.sums["correction/m2po_m2_before"] = (v_sorted.sum(), torch.tensor(total, **f64))
    met.sums["correction/m2po_m2_after"] = (v_sorted[k:].sum(), torch.tensor(total - k, **f64))
    met.maxs["correction/m2po_kept_m2_max"] = torch.tensor(max(cut_v, 0.0), **f64)
    return ~masked, met


def step_selection(old_logprobs: Tensor, rollout_logprobs: Tensor, valid: Tensor, tau: float, *,
                   row_ids: Tensor, group) -> tuple[Tensor, dict[str, float]]:
    """policy_step's adapter: the keep mask and the global metric values as floats (one host sync),
    less correction/m2po_masked_frac, which the loss reports from the keep mask it applies."""
    keep, met = m2po_keep(old_logprobs, rollout_logprobs, valid, tau, row_ids=row_ids, group=group)
    met.sums.pop("correction/m2po_masked_frac")
    return keep, {k: float(v) for k, v in met.values().items()}
