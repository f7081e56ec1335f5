"""What one weight sync costs the trainer, per rank: the bucket stream (rollout.sync=stream) against the
disk path (rollout.sync=disk) and against the floor, one copy of the same bytes into the same transport.

    python benchmarks/bench_weight_sync.py                               # 0.1B, 0.5B, 1.5B; 6 layouts (~20 min)
    python benchmarks/bench_weight_sync.py --sizes 0.1B --layouts tp2 pp2 --bucket-mb 64

Qwen2-shaped models (config.json only: megatron-core's own init, bf16 parameters as a bf16 trainer
holds them) on gloo processes (megatron_cispo.testing.spawn), one launch per size and layout:
- stream: rollout/weight_stream.stream_buckets with hf_namer, rank 0 packing (and receiving the other
  stages' buckets) straight into a shared-memory file of one bucket, as the vLLM sampler does;
- floor: the same bytes moved once over the same links, a bucket at a time: rank 0 copies its own
  parameters into that file, every other rank with DP = CP = 0 sends its parameters there over gloo;
- disk: today's fallback up to the engine: base.weights.gather_full_state on every rank (fp32, TP
  all-gather, all_gather_object over the world), then rank 0 writes to_hf's tensors as an fp32 HF
  directory (hf/export.write_hf_dir, fsynced). Skipped where it would not fit in this machine's memory.
Per rank: wall time (between barriers) and the peak resident-set increase (VmHWM reset before, minus
VmRSS before), in MiB; the stream after one untimed warm-up sync (a run's second and later syncs). The engine's side (vLLM staging and reloading the weights) is the same work on
both paths and is not in these figures. Not a test: nothing here is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_logprobs import _release_freed_memory, _reset_peak, _status_kib  # noqa: E402

MIB = 2 ** 20
# Qwen2-shaped: (hidden, layers, heads, kv heads, ffn, vocab); 0.5B and 1.5B are Qwen2-0.5B's and -1.5B's
SIZES = {"0.1B": (768, 12, 12, 2, 2048, 32000), "0.5B": (896, 24, 14, 2, 4864, 151936),
         "1.5B": (1536, 28, 12, 2, 8960, 151936)}
LAYOUTS = {"single": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "dp2": {"dp": 2}, "tp2_pp2": {"tp": 2, "pp": 2},
           "tp2_dp2": {"tp": 2, "dp": 2}}
DISK_LIMIT_GB = 20  # the disk path peaked at 6.5 fp32 models per rank (0.1B); 0.5B on 2 ranks was OOM-killed at 12 GB


def write_config(out: Path, size: str) -> str:
    import transformers

    h, n, heads, kv, ffn, vocab = SIZES[size]
    cfg = transformers.Qwen2Config(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
                                   num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab,
                                   tie_word_embeddings=True, max_position_embeddings=512, torch_dtype="bfloat16")
    cfg.save_pretrained(out)
    return str(out)


def _measure(fn) -> tuple[float, float]:
    """(seconds, peak RSS increase in MiB) of fn() on this rank, between barriers."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    rss0 = _status_kib("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0, (_status_kib("VmHWM") - rss0) / 1024


def worker(layout: dict, path: str, bucket_mb: float, disk: bool, tmp: str) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_cispo.hf.export import write_hf_dir
    from megatron_cispo.hf.mapping import to_hf
    from megatron_cispo.rollout.weight_stream import hf_namer, stream_buckets
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model
    from megatron_cispo.base.param_names import canonical_names
    from megatron_cispo.base.weights import gather_full_state

    _release_freed_memory()
    torch.set_num_threads(1)
    tp, pp = layout.get("tp", 1), layout.get("pp", 1)
    distributed.init_distributed(tp=tp, pp=pp)
    cfg = ModelConfig(hf_path=path, dtype="bf16")
    chunks = build_model(cfg, tp=tp, pp=pp, wrap_ddp=False, load_weights=False)
    arch, nbytes = cfg.arch, int(bucket_mb * MIB)
    rank = dist.get_rank()
    params = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    shm = None
    if rank == 0:
        f = Path("/dev/shm") / f"bench_weight_sync_{os.getpid()}"
        f.write_bytes(b"")
        os.truncate(f, nbytes)
        shm = (f, torch.from_file(str(f), shared=True, size=nbytes, dtype=torch.uint8))
    sent = [0, 0]  # bytes, buckets (rank 0)

    def stream():  # rank 0 packs and receives in the shared file (stream_buckets(buffer=)), as the sampler does
        for b in stream_buckets(chunks, namer=hf_namer(arch), bucket_bytes=nbytes,
                                buffer=shm[1] if shm is not None else None):
            sent[0] += b.data.numel()
            sent[1] += 1

    out = {"rank": rank, "param_mib": params / MIB}
    stream()  # warm-up: the shared file's pages and the buffers of later syncs are there already
    sent[:] = [0, 0]
    out["stream_s"], out["stream_mib"] = _measure(stream)
    from megatron.core import parallel_state as mpu
    holds = mpu.get_data_parallel_rank(with_context_parallel=True) == 0  # the ranks whose bytes the stream sends
    mine = torch.cat([p.detach().reshape(-1).view(torch.uint8) for c in chunks for p in c.parameters()]) if holds \
        else torch.empty(0, dtype=torch.uint8)
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, mine.numel())

    def floor():  # every byte once over the same links: rank 0's own copied, the others' sent over gloo
        if rank == 0:
            for s in range(0, mine.numel(), nbytes):
                n = min(nbytes, mine.numel() - s)
                shm[1][:n].copy_(mine[s:s + n])
            for src, size in enumerate(sizes[1:], 1):
                for s in range(0, size, nbytes):
                    dist.recv(shm[1][:min(nbytes, size - s)], src=src)
        else:
            for s in range(0, mine.numel(), nbytes):
                dist.send(mine[s:s + nbytes], dst=0)

    out["floor_s"], _ = _measure(floor)
    del mine
    if disk:
        def via_disk():
            full = gather_full_state(chunks)
            if rank == 0:
                write_hf_dir(to_hf(canonical_names(full), arch), arch, Path(tmp) / "hf", dtype=torch.float32)

        out["disk_s"], out["disk_mib"] = _measure(via_disk)
    if shm is not None:
        shm[0].unlink()
        out.update(bytes=sent[0], buckets=sent[1])
    return out


def main() -> None:
    from megatron_cispo.testing import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    rows = []
    print(f"bucket {args.bucket_mb:g} MiB; per rank: seconds / peak RSS increase MiB; 'max rank' = the worst rank")
    print(f"{'size':5} {'layout':8} {'params/rank':>11} {'bytes':>9} {'buckets':>7} {'floor s':>8} {'stream s':>9} "
          f"{'x floor':>7} {'stream MiB':>10} {'disk s':>8} {'disk MiB':>9} {'disk/stream':>11}")
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as tmp:
            path = write_config(Path(tmp) / "model", size)
            for name in args.layouts:
                layout = LAYOUTS[name]
                world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
                h, n, heads, kv, ffn, vocab = SIZES[size]
                fp32_gb = 4 * (vocab * h + n * (4 * h * h + 3 * h * ffn)) / 1e9
                disk = 6.5 * fp32_gb * world <= DISK_LIMIT_GB
                res = spawn(worker, world, (layout, path, args.bucket_mb, disk, tmp), timeout_s=3600)
                r0 = res[0]
                row = {"size": size, "layout": name, "world": world, "bucket_mb": args.bucket_mb,
                       "param_mib_max": max(r["param_mib"] for r in res), "bytes": r0["bytes"], "buckets": r0["buckets"],
                       "floor_s": r0["floor_s"], "stream_s": r0["stream_s"],
                       "stream_mib_max": max(r["stream_mib"] for r in res),
                       "disk_s": r0.get("disk_s"), "disk_mib_max": max(r.get("disk_mib", 0) for r in res) if disk else None}
                rows.append(row)
                d = (f"{row['disk_s']:8.2f} {row['disk_mib_max']:9.0f} {row['disk_s'] / row['stream_s']:10.1f}x"
                     if disk else f"{'-':>8} {'-':>9} {'(no room)':>11}")
                print(f"{size:5} {name:8} {row['param_mib_max']:8.0f}MiB {row['bytes'] / MIB:6.0f}MiB {row['buckets']:7d} "
                      f"{row['floor_s']:8.2f} {row['stream_s']:9.2f} {row['stream_s'] / row['floor_s']:6.1f}x "
                      f"{row['stream_mib_max']:10.0f} {d}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
