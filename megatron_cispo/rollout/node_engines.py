"""rollout.placement: local on several nodes: engine replica k runs on node k % nodes (rollout/placement.py), a
child process of that node's first trainer rank, which serves it to rank 0's pool (engine_pool.EnginePool) over a
socket (node_host.py).

    hosts = NodeHosts.open(rollout.engines)                    # collective, every rank: the nodes, who hosts what
    pool = open_node_pool(spec, start_of, n, hosts, on_death="stop")   # rank 0: local and remote replicas
    hosts.close()                                              # every rank, at the end

Replicas on rank 0's node are rank 0's child processes, as on one node. A replica on node j > 0 is a NodeEngine
here: a connection to node j's NodeHost (multiprocessing.connection, authenticated by a key the host makes and
sends to rank 0 in the set-up's all_gather), which opens the engine there and answers each call. A weight
bucket crosses the socket as raw bytes, read on node j straight into the engine's shared bucket file, so no
node holds more than a bucket beyond the engine. Every call waits at most the engine's timeout; a dead engine,
node or connection is one ReplicaError line, never a hang. model.hf_path and run.run_dir must be on a file
system every node sees (the engine opens the one and logs to the other).
"""
from __future__ import annotations

import socket
from multiprocessing.connection import Client
from typing import Callable, Optional

import torch.distributed as dist

from .child import cause
from .engine import push_in_parts
from .engine_pool import open_pool
from .node_host import NodeHost, node_key, raw_socket
from .placement import replica_node
from .ray_engines import ReplicaError


class NodeEngine:
    """Replica k on another node, through its NodeHost: the engine protocol, each call waited for at most its
    timeout; a lost connection or a timeout closes it and raises ReplicaError (alive() false)."""

    def __init__(self, k: int, where: str, address, key: bytes, spec, start):
        """Connects and asks the host to open the engine; returns at once: wait_started() waits for it."""
        self.k, self.where = k, where
        self.call_timeout_s, self.start_timeout_s = start.call_timeout_s, start.start_timeout_s
        self._conn, self._alive, self.start_seconds = Client(address, authkey=key), True, 0.0
        self._raw = raw_socket(self._conn)  # the buckets' bytes (raw_socket says why)
        self._conn.send((spec, start))

    def wait_started(self) -> "NodeEngine":
        self.start_seconds = self._reply("starting", self.start_timeout_s)
        return self

    def alive(self) -> bool:
        return self._conn is not None and self._alive

    def _reply(self, what: str, timeout_s: float):
        try:
            if not self._conn.poll(timeout_s):
                self.kill()
                raise ReplicaError(f"{what} took more than {timeout_s:.0f} s on {self.where}; closed it")
            got = self._conn.recv()
        except (EOFError, OSError) as e:
            self.kill()
            raise ReplicaError(f"the connection to {self.where} was lost while {what} ({cause(e)}): the trainer "
                               "process hosting it died or closed it") from None
        if got[0] == "error":
            self._alive = got[2]
            raise ReplicaError(f"{what} failed on {self.where}: {got[1]}")
        return got[1]

    def _call(self, method: str, what: str, *args, payload=None):
        if self._conn is None:
            raise ReplicaError(f"{what} on a closed replica on {self.where} (it failed earlier or was closed)")
        try:
            self._conn.send((method, args))
            if payload is not None:
                self._raw.sendall(payload)
        except OSError as e:
            self.kill()
            raise ReplicaError(f"the connection to {self.where} was lost while {what} ({cause(e)})") from None
        return self._reply(what, self.call_timeout_s)

    def begin_update(self, manifest: dict, bucket_bytes: int) -> None:
        self._call("begin_update", "starting a weight update", manifest, bucket_bytes)

    def add_bucket(self, bucket, index: int = 0):
        """The bucket's bytes go over the socket as they are (a CUDA bucket through one host copy)."""
        data = memoryview(bucket.data.detach().reshape(-1).cpu().numpy())
        return self._call("add_bucket", f"receiving weight bucket {index}", bucket.blocks, index, len(data),
                          payload=data)

    def finish_update(self) -> None:
        self._call("finish_update", "loading the streamed weights")

    def abort_update(self) -> None:
        if self._conn is not None:
            self._call("abort_update", "aborting a weight update")

    def update_weights(self, buckets, *, manifest: dict, bucket_bytes: int) -> dict:
        """The protocol's one-call push (the pool uses the parts): every bucket, all or nothing."""
        return push_in_parts(self, buckets, manifest=manifest, bucket_bytes=bucket_bytes)

    def generate(self, prompts, sampling):
        return self._call("generate", f"generating {len(prompts)} prompts x {sampling.n}", prompts, sampling)

    def kill(self) -> None:
        """Cut the connection from any thread (a call waiting on it raises); the host then ends the engine."""
        conn, self._alive = self._conn, False
        if conn is not None:
            try:
                self._raw.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.send(("close", ()))
            if conn.poll(30):  # the host closed its engine (or the connection is already gone)
                conn.recv()
        except (EOFError, OSError):
            pass
        conn.close()
        self._raw.close()
        self._alive = False


class NodeHosts:
    """The job's nodes (ordered by their first rank: node 0 is rank 0's) and, for each node j > 0 that gets a
    replica (k % nodes == j), the rank hosting it and its address. Rank 0 opens the replicas; a hosting rank
    keeps its NodeHost until close()."""

    def __init__(self, nodes: int, hosts: dict, server: Optional[NodeHost]):
        self.nodes, self.hosts, self.server = nodes, hosts, server

    @classmethod
    def open(cls, engines: int) -> "NodeHosts":
        """Collective (every rank, two all_gather_object): which ranks share a node, then the hosts' addresses."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return cls(1, {}, None)
        keys: list = [None] * dist.get_world_size()
        dist.all_gather_object(keys, node_key())
        first: dict[str, int] = {}
        for rank, key in enumerate(keys):
            first.setdefault(key, rank)
        order = sorted(first, key=first.get)
        nodes, me = len(order), dist.get_rank()
        mine = order.index(keys[me])
        hosting = mine > 0 and first[keys[me]] == me and any(replica_node(k, nodes) == mine for k in range(engines))
        server = NodeHost(mine) if hosting else None
        infos: list = [None] * len(keys)
        dist.all_gather_object(infos, (mine, server.address, server.key) if server else None)
        hosts = {info[0]: (rank, info[1], info[2]) for rank, info in enumerate(infos) if info is not None}
        return cls(nodes, hosts, server)

    def node_of(self, k: int) -> int:
        return replica_node(k, self.nodes)

    def where(self, k: int) -> str:
        node = self.node_of(k)
        return f"node {node} (rank {self.hosts[node][0] if node else 0})"

    def engine(self, k: int, spec, start) -> NodeEngine:
        """Rank 0: replica k on its node's host, starting (wait_started() waits)."""
        rank, address, key = self.hosts[self.node_of(k)]
        return NodeEngine(k, self.where(k), address, key, spec, start)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def open_node_pool(spec, start_of: Callable[[int], object], n: int, hosts: NodeHosts, *, on_death: str = "stop"):
    """Rank 0: an EnginePool of n replicas, replica k on node hosts.node_of(k): rank 0's own children on node 0,
    NodeEngines elsewhere. The remote ones start at once, each on its node, while rank 0 starts its own."""
    early = {k: hosts.engine(k, spec, start_of(k)) for k in range(n) if hosts.node_of(k)}

    def open_one(k: int):  # also a restart: a fresh connection, so a fresh engine, on the same node
        if not hosts.node_of(k):
            return spec.open(start_of(k))
        return (early.pop(k, None) or hosts.engine(k, spec, start_of(k))).wait_started()

    try:
        return open_pool(open_one, n, on_death=on_death)
    except BaseException:
        for e in early.values():
            e.close()
        raise

