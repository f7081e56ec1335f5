"""What a weight push to an engine replica on another node costs (rollout/node_engines.py), against the same push
to a replica beside rank 0: time, and each process's peak memory beyond the engine's own bucket buffer.

    python benchmarks/bench_node_push.py                        # 1 GiB in 64 and 256 MiB buckets (~1 min)
    python benchmarks/bench_node_push.py --gib 4 --bucket-mb 512

Two gloo ranks as two "nodes" (torchrun's GROUP_RANK 0 and 1) on this machine: rank 1 hosts the remote replica,
reached over its host's socket on 127.0.0.1. The replica is a sink with vLLM's shape: a shared bucket buffer of
bucket_bytes allocated at its first update (VLLMEngine.buffer), each bucket received into it and read once
(a checksum). Local: rank 0's own sink, each bucket copied into its buffer (VLLMEngine.add_bucket's copy).
The buckets come from one reused buffer on rank 0, made before the push, as the weight stream packs them. Per process: seconds
(after one untimed warm-up push) and the peak RSS increase over the push (VmHWM reset before), in MiB. The
loopback measures the host's copies and Python's framing, not a network. Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_logprobs import _release_freed_memory, _reset_peak, _status_kib  # noqa: E402

MIB = 2 ** 20


class Sink:
    """An engine that takes buckets into its own buffer, as vLLM's shared bucket file does."""

    def __init__(self):
        self.buf, self.total = None, 0

    def buffer(self, manifest, bucket_bytes):
        import torch

        if self.buf is None or self.buf.numel() != bucket_bytes:
            self.buf = torch.zeros(bucket_bytes, dtype=torch.uint8)  # touched: resident, as a written file is
        return self.buf

    def begin_update(self, manifest, bucket_bytes):
        self.buffer(manifest, bucket_bytes)

    def add_bucket(self, bucket, index=0):
        n = bucket.data.numel()
        if bucket.data.data_ptr() != self.buf.data_ptr():  # not received in place: copied, as VLLMEngine does
            self.buf[:n].copy_(bucket.data)
        self.total += int(self.buf[:n:4096].sum())
        return n

    def finish_update(self):
        pass

    def abort_update(self):
        pass

    def generate(self, prompts, sampling):
        return []

    def alive(self):
        return True

    def close(self):
        self.buf = None


def open_sink(start):
    return Sink()


def _buckets(total: int, buf):
    """total bytes as buckets of buf (the stream's own packing buffer, made before the push)."""
    from megatron_cispo.rollout.weight_stream import Bucket

    for at in range(0, total, buf.numel()):
        yield Bucket([], buf[:min(buf.numel(), total - at)])


def worker(total: int, bucket: int) -> dict:
    import torch.distributed as dist

    from megatron_cispo.rollout.engine import EngineSpec, EngineStart
    from megatron_cispo.rollout.engine_pool import EnginePool
    from megatron_cispo.rollout.node_engines import NodeHosts

    _release_freed_memory()
    os.environ["GROUP_RANK"] = os.environ["RANK"]
    dist.init_process_group("gloo")
    hosts = NodeHosts.open(2)
    spec = EngineSpec(name="sink", opener="bench_node_push:open_sink", hf_model=False, prompt_files=True,
                      overlaps=True, routes=False, replicas=True)
    out = {}
    if dist.get_rank() == 0:
        import torch

        src = torch.randint(0, 255, (bucket,), dtype=torch.uint8)
        start = EngineStart(model=None, precision="fp32", seed=0, max_model_len=1)
        for name, one in (("local", Sink()), ("remote", hosts.engine(1, spec, start).wait_started())):
            engine = EnginePool([one])  # the pool drives both, as a run's does
            engine.update_weights(_buckets(total, src), manifest={}, bucket_bytes=bucket)  # warm-up: buffers made
            dist.barrier()
            rss0 = _status_kib("VmRSS")
            _reset_peak()
            t0 = time.perf_counter()
            engine.update_weights(_buckets(total, src), manifest={}, bucket_bytes=bucket)
            out[name] = (time.perf_counter() - t0, (_status_kib("VmHWM") - rss0) / 1024)
            dist.barrier()  # rank 1 measured meanwhile (remote)
            engine.close()
    else:
        for name in ("local", "remote"):
            dist.barrier()
            rss0 = _status_kib("VmRSS")
            _reset_peak()
            dist.barrier()
            out[name] = (0.0, (_status_kib("VmHWM") - rss0) / 1024)
    dist.barrier()
    hosts.close()
    return out


def main() -> None:
    from megatron_cispo.testing import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="bytes pushed, GiB")
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[64.0, 256.0])
    args = ap.parse_args()
    total = int(args.gib * 2**30)
    print(f"{args.gib:g} GiB pushed; seconds and peak RSS increase (MiB) over the push, after a warm-up push")
    print(f"{'bucket MiB':>10} {'replica':>8} {'seconds':>8} {'GiB/s':>6} {'rank 0 MiB':>10} {'rank 1 MiB':>10}")
    for mb in args.bucket_mb:
        res = spawn(worker, 2, (total, int(mb * MIB)), timeout_s=1800)
        for name in ("local", "remote"):
            s, m0 = res[0][name]
            m1 = res[1][name][1]
            print(f"{mb:10g} {name:>8} {s:8.2f} {total / 2**30 / s:6.2f} {m0:10.1f} {m1:10.1f}", flush=True)


if __name__ == "__main__":
    main()
