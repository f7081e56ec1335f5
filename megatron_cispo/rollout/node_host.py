"""The node side of rollout.placement: local on several nodes (node_engines.py): on each node j > 0 that gets a
replica, its first rank runs a NodeHost, a thread that takes rank 0's connections and, for each, opens one engine
(in a child process of this trainer process: it dies with the connection's thread and with the trainer) and
answers its calls until rank 0 closes it.

    host = NodeHost(node=1)     # a listening socket on this node's interface toward MASTER_ADDR, and its key
    host.address, host.key      # sent to rank 0 in NodeHosts.open's all_gather_object
    host.close()                # at the end: every engine it serves is killed

A weight bucket's bytes follow its add_bucket message raw on the same socket and are read straight into the
engine's shared bucket file (VLLMEngine.buffer): the host holds no copy of a bucket.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from multiprocessing.connection import Listener
from typing import Optional

import torch
import torch.distributed as dist

from .child import cause
from .ray_engines import EngineHost
from .weight_stream import Bucket

KEY_BYTES = 32  # each host's authentication key: only rank 0, which got it in the set-up's all_gather, connects
DRAIN_BYTES = 1 << 20  # a bucket no engine can take is read through a buffer this small


def raw_socket(conn) -> socket.socket:
    """A socket on conn's connection, for a bucket's raw bytes: multiprocessing's Connection frames every
    message and reads it whole into a BytesIO first (a second copy of the bucket), so the bytes that follow
    an add_bucket message go around it. Connection neither buffers what it writes nor reads ahead."""
    return socket.socket(fileno=os.dup(conn.fileno()))


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Exactly len(view) bytes from sock into view; EOFError when the peer closed first."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the connection closed in the middle of a bucket")
        got += k


def node_key() -> str:
    """This process's node: torchrun's node rank (GROUP_RANK), else Slurm's (SLURM_NODEID), else the host name."""
    for name in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return socket.gethostname()


def reachable_ip() -> str:
    """The address of this node's interface toward MASTER_ADDR (the one its peers reach it on), else its host name's."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master, 9))  # a UDP "connect" sends nothing: it only picks the route
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


class NodeHost:
    """Serves engines of this node to rank 0: one thread per connection, each opening one engine and answering
    its calls (EngineHost's ("ok", value) | ("error", line, alive)) until rank 0 closes it."""

    def __init__(self, node: int):
        self.node, self.rank, self.key = node, dist.get_rank() if dist.is_initialized() else 0, os.urandom(KEY_BYTES)
        self._listener = Listener((reachable_ip(), 0), authkey=self.key)
        self.address = self._listener.address
        self._engines: list[EngineHost] = []
        self._lock, self._closed = threading.Lock(), False
        threading.Thread(target=self._accept, daemon=True, name="cispo-engine-host").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:  # noqa: BLE001 - closed (the loop ends) or a peer that failed the key (ignored)
                time.sleep(0.05)
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="cispo-engine-conn").start()

    def _serve(self, conn) -> None:
        host, update, raw = None, None, None
        try:
            spec, start = conn.recv()
            try:
                _check_gpu(start.gpu)
                host = EngineHost(spec, start)
            except Exception as e:  # noqa: BLE001 - answered as a line: rank 0 decides
                conn.send(("error", cause(e), False))
                return
            with self._lock:
                self._engines.append(host)
            conn.send(("ok", host.start_seconds))
            raw = raw_socket(conn)
            while True:
                method, args = conn.recv()
                if method == "begin_update":
                    update = [*args, None]  # (manifest, bucket_bytes, the bucket buffer of an engine without one)
                elif method == "add_bucket":
                    args = self._received(raw, host.engine, update, *args)
                no = ("error", "no weight update begun, or a bucket past its bucket_bytes", True)
                conn.send(host.call(method, *args) if args is not None else no)
                if method == "close":
                    return
        except (EOFError, OSError):  # rank 0 closed the connection, or is gone: the engine goes too
            pass
        finally:
            if host is not None:
                with self._lock:
                    if host in self._engines:
                        self._engines.remove(host)
                host.close()
            if raw is not None:
                raw.close()
            conn.close()

    @staticmethod
    def _received(raw: socket.socket, engine, update: Optional[list], blocks, index: int, n: int) -> Optional[tuple]:
        """The n bytes that follow an add_bucket call, read from the socket straight into the engine's shared
        bucket file (VLLMEngine.buffer), or into one bucket of host memory kept for the update for an engine
        without one: add_bucket's args. None (the bytes drained) when no update was begun, the engine cannot
        give its buffer (dead) or the bucket is larger than the update's bucket_bytes."""
        buf = None
        if update is not None and n <= update[1]:
            manifest, bucket_bytes, own = update
            packed = getattr(engine, "buffer", None)
            try:
                buf = packed(manifest, bucket_bytes) if packed else own
                if buf is None:
                    buf = update[2] = torch.empty(bucket_bytes, dtype=torch.uint8)
            except Exception:  # noqa: BLE001 - a dead engine: its own error comes from the call
                buf = None
        if buf is None:
            scratch = memoryview(bytearray(min(n, DRAIN_BYTES)))
            for at in range(0, n, DRAIN_BYTES):  # so that the next message starts where it should
                recv_into(raw, scratch[:min(DRAIN_BYTES, n - at)])
            return None
        recv_into(raw, memoryview(buf.numpy())[:n])
        return Bucket(blocks, buf[:n]), index

    def close(self) -> None:
        """Stop accepting and end every engine served (their processes are killed: rank 0 is done with them)."""
        self._closed = True
        self._listener.close()
        with self._lock:
            engines, self._engines = self._engines, []
        for host in engines:
            kill = getattr(host.engine, "kill", None)
            if kill is not None:
                kill()


def _check_gpu(gpu: Optional[int]) -> None:
    """rollout.engine_gpus on a host node: the GPU must be one of this node's (vllm_engine.gpus_here)."""
    from .vllm_engine import gpus_here

    gpus_here([gpu], [0], node="its node")
