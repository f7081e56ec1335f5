"""rollout.engines on several nodes (rollout/node_engines.py): 4 gloo ranks as 2 "nodes" of 2 (torchrun's
GROUP_RANK), 3 fake replicas. Replica k runs on node k % 2: 0 and 2 in rank 0's process, 1 in rank 2's (node
1's first rank), reached over its host's socket. Every push reaches all three, bit for bit, a bucket crossing
the socket into the remote engine's own buffer; the prompts are split across them; the share of a remote replica
that dies in a generation goes to the others and a fresh one, started on node 1, joins at the next push
(rollout.on_engine_death: restart); one that refuses
a bucket, or is sent one past the update's bucket_bytes (drained, the connection stays in step), aborts the
push everywhere, named with its node; one that hangs is cut at its call timeout.
tests/e2e/test_vllm_cli.py runs two vLLM replicas on two torchrun "nodes".
"""
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_cispo.rollout.engine import Completion, EngineSpec, EngineStart, Sampling
from megatron_cispo.rollout.weight_stream import Bucket
from megatron_cispo.testing import spawn

FAKE = EngineSpec(name="node_fake", opener="test_node_engines:open_fake", hf_model=False, prompt_files=True,
                  overlaps=True, routes=False, replicas=True)


class Fake:
    """Weights: the sum of the bytes pushed and their count; a completion says which process served it.
    options: die_flag (a file: generate dies, once, while it exists), refuse_bucket (an index it refuses),
    sleep_s (generate sleeps that long first)."""

    def __init__(self, options: dict):
        self.options, self.weights, self.pending, self.dead = options, None, None, False
        self.buffers: list = []  # the data_ptr of each bucket received: one buffer, reused

    def alive(self):
        return not self.dead

    def begin_update(self, manifest, bucket_bytes):
        self.pending = (0, 0)

    def add_bucket(self, bucket, index=0):
        if index == self.options.get("refuse_bucket"):
            raise ValueError(f"bucket {index} refused")
        self.buffers.append(bucket.data.data_ptr())
        self.pending = (self.pending[0] + int(bucket.data.sum()), self.pending[1] + bucket.data.numel())
        return bucket.data.numel()

    def finish_update(self):
        self.weights, self.pending = self.pending, None

    def abort_update(self):
        self.pending = None

    def generate(self, prompts, sampling):
        flag = self.options.get("die_flag")
        if flag and Path(flag).exists():
            Path(flag).unlink()
            self.dead = True
            raise RuntimeError("the engine process died")
        time.sleep(self.options.get("sleep_s", 0))
        return [[Completion([*self.weights, p[0], s, os.getpid(), len(set(self.buffers))], [0.0], "length")]
                for p, s in zip(prompts, sampling.seeds)]

    def kill(self):
        self.dead = True

    def close(self):
        self.dead = True


def open_fake(start):
    return Fake(start.options)


def _buckets(sizes):
    """Buckets of the given sizes, packed one after another into one reused buffer (as the stream does)."""
    buf = torch.empty(max(sizes), dtype=torch.uint8)
    for i, n in enumerate(sizes):
        buf[:n] = torch.arange(n, dtype=torch.int64).add(7 * i).remainder(251).to(torch.uint8)
        yield Bucket([], buf[:n])


def _expected(sizes):
    return sum(int(torch.arange(n).add(7 * i).remainder(251).sum()) for i, n in enumerate(sizes)), sum(sizes)


def worker(tmp):
    from megatron_cispo.rollout.node_engines import NodeHosts, open_node_pool

    os.environ["GROUP_RANK"] = str(int(os.environ["RANK"]) // 2)
    dist.init_process_group("gloo")
    hosts = NodeHosts.open(3)
    out = {"pid": os.getpid(), "hosting": hosts.server is not None, "nodes": hosts.nodes}
    if dist.get_rank() == 0:
        flag = Path(tmp) / "die"
        start = EngineStart(model=None, precision="fp32", seed=0, max_model_len=16, start_timeout_s=60,
                            call_timeout_s=60)
        pool = open_node_pool(FAKE, lambda k: replace(start, options={"die_flag": str(flag)} if k == 1 else {}), 3,
                              hosts, on_death="restart")
        sizes = [64, 1000, 17]
        info = pool.update_weights(_buckets(sizes), manifest={}, bucket_bytes=1000)
        sampling = Sampling(n=1, max_new_tokens=1, seeds=[0, 10, 20, 30, 40, 50])
        first = pool.generate([[i] for i in range(6)], sampling)
        flag.touch()  # replica 1 dies in its next generation: its share goes to 0 and 2, a fresh one starts on node 1
        second = pool.generate([[i] for i in range(6)], sampling)
        served = list(pool.served)
        pool.update_weights(_buckets(sizes), manifest={}, bucket_bytes=1000)  # the fresh replica 1 joins
        third = pool.generate([[i] for i in range(6)], sampling)
        out.update(where=[hosts.where(k) for k in range(3)], sync=info, first=first, second=second, third=third,
                   expected=_expected(sizes), restarts=list(pool.restarts), served=[served, list(pool.served)])
        pool.close()

        refusing = open_node_pool(FAKE, lambda k: replace(start, options={"refuse_bucket": 1} if k == 1 else {}), 2,
                                  hosts)
        refusing.update_weights(_buckets([8]), manifest={}, bucket_bytes=8)
        try:
            refusing.update_weights(_buckets([8, 8]), manifest={}, bucket_bytes=8)
        except RuntimeError as e:
            out["refused"] = str(e)
        try:  # a bucket past the update's bucket_bytes: the host drains it and the connection stays in step
            refusing.update_weights(_buckets([4000]), manifest={}, bucket_bytes=8)
        except RuntimeError as e:
            out["too_big"] = str(e)
        out["after_refusal"] = refusing.generate([[0], [1]], Sampling(n=1, max_new_tokens=1, seeds=[0, 5]))
        refusing.close()

        hung = open_node_pool(FAKE, lambda k: replace(start, call_timeout_s=1.0, options={"sleep_s": 30} if k == 1
                                                      else {}), 2, hosts)
        hung.update_weights(_buckets([8]), manifest={}, bucket_bytes=8)
        t0 = time.monotonic()
        try:
            hung.generate([[0], [1]], Sampling(n=1, max_new_tokens=1, seeds=[0, 5]))
        except RuntimeError as e:
            out["hung"], out["hung_s"] = str(e), time.monotonic() - t0
        hung.close()
    dist.barrier()
    hosts.close()
    return out


def test_three_replicas_on_two_nodes_get_every_push_serve_their_share_and_fail_in_one_line(tmp_path):
    ranks = spawn(worker, 4, args=(str(tmp_path),), timeout_s=180)
    assert [r["hosting"] for r in ranks] == [False, False, True, False]  # node 1's first rank hosts replica 1
    assert {r["nodes"] for r in ranks} == {2}
    r0 = ranks[0]
    assert r0["where"] == ["node 0 (rank 0)", "node 1 (rank 2)", "node 0 (rank 0)"]
    assert r0["sync"]["sync/bytes"] == 1081 and r0["sync"]["sync/buckets"] == 3
    here, there = ranks[0]["pid"], ranks[2]["pid"]
    for batch, pids in ((r0["first"], [here] * 2 + [there] * 2 + [here] * 2), (r0["second"], [here] * 6),
                        (r0["third"], [here] * 2 + [there] * 2 + [here] * 2)):
        rows = [c[0].token_ids for c in batch]
        assert [row[:4] for row in rows] == [[*r0["expected"], i, 10 * i] for i in range(6)]  # every replica: the push
        assert [row[4] for row in rows] == pids  # shares of 2 prompts: replica 0, 1, 2 (second: 1's went to 0 and 2)
        if pids[2] == there:  # the remote replica read each bucket in one place: its own buffer, reused
            assert rows[2][5] == 1
    assert r0["restarts"] == [0, 1, 0] and r0["served"] == [[5, 2, 5], [7, 4, 7]]
    assert r0["refused"].startswith("engine replica 1: receiving weight bucket 1 failed on node 1 (rank 2): "
                                    "ValueError: bucket 1 refused"), r0["refused"]
    assert r0["too_big"].startswith("engine replica 1: receiving weight bucket 0 failed on node 1 (rank 2): no weight "
                                    "update begun, or a bucket past its bucket_bytes"), r0["too_big"]
    assert [c[0].token_ids[:2] for c in r0["after_refusal"]] == [[sum(range(8)), 8]] * 2  # both on the last push
    assert r0["hung"].startswith("engine replica 1: generating 1 prompts x 1 took more than 1 s on node 1 (rank 2)")
    assert r0["hung_s"] < 20, r0["hung_s"]
