"""Name the rank that stopped answering (gloo only).

A gloo collective that waits longer than run.dist_timeout_s raises "Timed out waiting ...ms",
which names no rank. The runner passes any RuntimeError of its run to `explain_lost_peer`. For
a gloo transport error (a timeout, or a peer's connection gone) every live rank meets in a
monitored barrier on a separate gloo group (`health_group`); rank 0 learns which ranks did not
come, prints one line naming them and posts it in the job's store, where the other live ranks
read it and stay silent. When rank 0 itself did not answer, the first live rank to notice says
so. Any other error, or every rank at the barrier, and the caller re-raises the error as it was.
NCCL has no monitored barrier: there the error passes through unchanged.
"""
from __future__ import annotations

import datetime
import re
import sys

import torch.distributed as dist

_VERDICT = "megatron_cispo/peer_lost"  # rank 0's message, in the job's key-value store
_SPEAKER = "megatron_cispo/peer_lost_speaker"  # the first live rank to claim it reports rank 0
_FAILED = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")
# What gloo's transport raises (its messages carry the source path third_party/gloo/...); any
# other error, such as one rank's own bug, is re-raised at once instead of waiting for a barrier.
_TRANSPORT = re.compile(r"gloo/|Timed out waiting|Connection (?:closed|reset) by peer")


class PeerLost(RuntimeError):
    """A rank stopped answering; raised on every live rank after one of them printed why."""


def health_group(backend: str, timeout_s: float):
    """Collective over the world: a gloo group for `explain_lost_peer`, apart from the groups the
    step uses (a timed-out collective leaves those unusable), or None on NCCL."""
    if backend != "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def explain_lost_peer(err: BaseException, group, *, rank: int, timeout_s: float) -> None:
    """After `err`, a gloo transport error in a collective: raise PeerLost when some rank does not
    reach a monitored barrier on `group` within `timeout_s`. Return at once for any other error
    or when `group` is None (NCCL), and after the barrier when every rank reached it."""
    if group is None or not _TRANSPORT.search(str(err)):
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
        return
    except RuntimeError as e:
        barrier_error = str(e)
    setting = f"run.dist_timeout_s ({timeout_s:g} s)"
    store = dist.distributed_c10d._get_default_store()  # under torchrun the agent holds it, not rank 0
    if rank == 0:
        found = _FAILED.search(barrier_error)
        ranks = found.group(1).strip() if found else ""
        who = f"ranks {ranks}" if "," in ranks else f"rank {ranks}" if ranks else "a rank"
        message = (f"{who} stopped answering: a collective waited longer than {setting} and {who} did not "
                   f"reach the health check in as long again (stopped, hung or gone); check that rank's host "
                   f"and log, or raise run.dist_timeout_s if a step legitimately takes that long")
        _say(message)
        try:
            store.set(_VERDICT, message)
        except Exception:  # noqa: BLE001 - the store may be gone with the job; the line is printed
            pass
        raise PeerLost(message)
    try:
        store.wait([_VERDICT], timeout)
        verdict = store.get(_VERDICT).decode()
    except dist.DistNetworkError:  # the store lived in rank 0's process, and it has exited
        raise PeerLost("rank 0 exited while the ranks checked which rank stopped answering") from None
    except dist.DistStoreError:  # no verdict in time: rank 0 is the one that stopped
        verdict = None
    if verdict is not None:  # rank 0 answered and has said who
        raise PeerLost(verdict)
    message = (f"rank 0 stopped answering (seen by rank {rank}): a collective waited longer than {setting} and "
               f"rank 0 did not reach the health check in as long again; check rank 0's host and log")
    try:
        first = store.add(_SPEAKER, 1) == 1
    except Exception:  # noqa: BLE001 - the store lived in rank 0's process (no torchrun agent)
        first = True
    if first:
        _say(message)
    raise PeerLost(message)
