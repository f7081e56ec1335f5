"""One config across ranks: every rank hashes its resolved config and the job refuses to start
when any two differ (a `${SEED}` or `${RUN_DIR}` that is not the same on every node).

    check_same_config(dump_yaml(cfg), device=env.device)   # init_distributed does this

Collectives: one MAX all-reduce of a 16-int64 digest on the world group; on a mismatch only,
one all_gather_object of the configs, so that every rank can name the differing keys.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import yaml

from ..config import ConfigError

_PIECES = 8  # sha256 as 8 x 32-bit pieces: they fit int64 with their negation
_MAX_KEYS = 10  # keys named in the message; the rest are counted


def flatten(tree, prefix: str = "") -> dict[str, object]:
    """{"run": {"seed": 1}} -> {"run.seed": 1}; lists and scalars are leaves."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, object] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2,5"."""
    spans, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            spans.append(f"{start}-{a}" if a > start else str(start))
            start = b
    return ("ranks " if len(ranks) > 1 else "rank ") + ",".join(spans)


def describe_mismatch(configs: list[dict[str, object]]) -> str:
    """One line naming each key whose value differs, with the ranks that hold each value."""
    keys = sorted(set().union(*configs))
    parts = []
    for key in keys:
        values = [c.get(key, "<missing>") for c in configs]
        if all(v == values[0] for v in values):
            continue
        groups: dict[str, list[int]] = {}
        for rank, v in enumerate(values):
            groups.setdefault(repr(v), []).append(rank)
        parts.append(f"{key}: " + ", ".join(f"{_ranks(r)}: {v}" for v, r in groups.items()))
    more = f"; and {len(parts) - _MAX_KEYS} more keys" if len(parts) > _MAX_KEYS else ""
    return "; ".join(parts[:_MAX_KEYS]) + more


def check_same_config(text: str, *, device: torch.device) -> None:
    """Collective over the world: raise ConfigError on every rank alike when the config `text`
    (the resolved YAML, environment values included) is not the same on every rank."""
    digest = hashlib.sha256(text.encode()).digest()
    pieces = [int.from_bytes(digest[4 * i:4 * i + 4], "little") for i in range(_PIECES)]
    t = torch.tensor(pieces + [-p for p in pieces], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # max of the pieces and -min of the pieces
    if torch.equal(t[:_PIECES], -t[_PIECES:]):
        return
    configs: list = [None] * dist.get_world_size()
    dist.all_gather_object(configs, flatten(yaml.safe_load(text)))
    raise ConfigError("the resolved config differs across ranks (an ${ENV} value or override that is not the "
                      "same on every node); set it alike everywhere: " + describe_mismatch(configs))
