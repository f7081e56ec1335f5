"""Memory and disk reads per rank while a Hugging Face checkpoint loads into megatron-core (hf/load.py).

    python benchmarks/bench_hf_load.py                 # llama, hidden 512, 8 layers, vocab 32000 (~1 minute)
    python benchmarks/bench_hf_load.py --layouts tp1 tp2 --hidden 256 --vocab 8000   # smaller

Writes one random model (tools/make_tiny_hf, fp32, untied, in ~50 MB safetensors shards) and, for
each layout, builds runner.model.build_model from it on that many gloo processes
(megatron_cispo.testing.spawn). The ranks take turns inside load_hf_weights (a barrier between
turns): each drops the checkpoint's pages from the page cache (posix_fadvise DONTNEED), then loads.
Per rank: the bytes of the checkpoint rows its slices cover (a column slice, of a row-parallel
weight, covers whole rows), bytes read from disk during its load (/proc/self/io read_bytes: the safetensors mmap's
page faults, readahead included), the peak resident-set increase during the load (VmHWM, reset
via /proc/self/clear_refs, minus VmRSS before), and the bytes of this rank's parameters. The
baseline row is one process reading every tensor of the checkpoint (safetensors.torch.load_file).
Both the disk reads and the resident set count the checkpoint's pages that the safetensors mmap
touched (resident while its handle is open, reclaimable: clean file pages).
Not a test: nothing here is asserted.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_logprobs import _release_freed_memory, _reset_peak, _status_kib  # noqa: E402

LAYOUTS = {"tp1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "tp2_pp2": {"tp": 2, "pp": 2}}
MIB = 2 ** 20


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def _drop_page_cache(path: str) -> None:
    os.sync()  # the previous rank's unmapped pages: written back and off the per-CPU lists
    time.sleep(0.2)
    for f in Path(path).glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a file just written) stay cached otherwise
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _measure(load, *args) -> dict:
    """Run load(*args) with a cold page cache for the checkpoint; what it read and held at peak."""
    import gc

    gc.collect()
    _drop_page_cache(args[-1].path if hasattr(args[-1], "path") else args[-1])
    rss0, io0 = _status_kib("VmRSS"), _read_bytes()
    _reset_peak()
    load(*args)
    return {"read": _read_bytes() - io0, "peak": (_status_kib("VmHWM") - rss0) * 1024}


class _CountingSlice:
    def __init__(self, sl, spans: list):
        self.sl, self.spans = sl, spans

    def __getattr__(self, name):  # get_shape, get_dtype
        return getattr(self.sl, name)

    def __getitem__(self, key):
        t = self.sl[key]
        shape = self.sl.get_shape()
        self.spans.append(t.shape[0] * t.element_size() * (math.prod(shape[1:]) if len(shape) > 1 else 1))
        return t


class _CountingHandle:
    """A safe_open handle whose slices add to `spans` the bytes of the whole rows they cover: what
    the loader asks the mmap for (a column slice spans every row), before readahead. Header reads
    (keys, shapes) are not counted. Plain classes (no cycles): the mmap closes with the last reference."""

    def __init__(self, handle, spans: list):
        self.handle, self.spans = handle, spans

    def get_slice(self, name):
        return _CountingSlice(self.handle.get_slice(name), self.spans)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)


def worker(layout: dict, path: str) -> dict:
    import safetensors
    import torch.distributed as dist

    from megatron_cispo.hf import load
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model

    _release_freed_memory()
    tp, pp = layout.get("tp", 1), layout.get("pp", 1)
    distributed.init_distributed(tp=tp, pp=pp)
    real, seen, spans = load.load_hf_weights, {}, []

    def load_in_turn(chunk, arch):  # build_model calls it once per chunk, on every rank together
        for turn in range(dist.get_world_size()):
            if turn == dist.get_rank():
                seen.update(_measure(real, chunk, arch))
            dist.barrier()

    load.load_hf_weights, opener = load_in_turn, safetensors.safe_open
    # load_hf_weights imports safe_open at each call
    safetensors.safe_open = lambda *a, **k: _CountingHandle(opener(*a, **k), spans)
    try:
        chunks = build_model(ModelConfig(hf_path=path), tp=tp, pp=pp, wrap_ddp=False)
    finally:
        load.load_hf_weights, safetensors.safe_open = real, opener
    seen["spans"] = sum(spans)
    seen["params"] = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    return seen


def _full_read(path: str) -> dict:
    from safetensors.torch import load_file

    _release_freed_memory()
    def read_all(p):  # touch every tensor: load_file's tensors may be lazily mapped pages
        return [float(t.sum()) for f in sorted(Path(p).glob("*.safetensors")) for t in load_file(f).values()]
    return _measure(read_all, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()

    import transformers

    from megatron_cispo.testing import spawn
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    with tempfile.TemporaryDirectory() as tmp:
        one = make_tiny_hf("llama", Path(tmp) / "one", seed=0, vocab=args.vocab, hidden=args.hidden,
                           layers=args.layers, heads=8, kv_heads=4, ffn=4 * args.hidden, max_positions=512)
        path = str(Path(tmp) / "sharded")
        transformers.AutoModelForCausalLM.from_pretrained(one).save_pretrained(path, max_shard_size="50MB")
        files = sorted(Path(path).glob("*.safetensors"))
        total = sum(f.stat().st_size for f in files)
        print(f"checkpoint: llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, fp32, "
              f"{len(files)} files, {total / MIB:.1f} MiB")
        print("| layout | rank | rows sliced (MiB) | read from disk (MiB) | read / checkpoint "
              "| peak RSS increase (MiB) | rank's parameters (MiB) |")
        print("|---|---|---|---|---|---|---|")
        def row(layout: str, rank: str, spans: float, r: dict, params: str) -> None:
            print(f"| {layout} | {rank} | {spans / MIB:.1f} | {r['read'] / MIB:.1f} | {r['read'] / total:.2f} "
                  f"| {r['peak'] / MIB:.1f} | {params} |")

        row("load_file (whole checkpoint)", "-", total, spawn(_full_read, 1, (path,))[0], "-")
        for name in args.layouts:
            layout = LAYOUTS[name]
            world = layout.get("tp", 1) * layout.get("pp", 1)
            for rank, r in enumerate(spawn(worker, world, (layout, path), timeout_s=900)):
                row(name, str(rank), r["spans"], r, f"{r['params'] / MIB:.1f}")


if __name__ == "__main__":
    main()
