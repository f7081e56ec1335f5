"""What one weight sync of the hf sampler (rollout.engine: hf) costs: rollout/hf_engine.HFEngine on a full state.

    python benchmarks/bench_hf_sync.py                       # the tiny models of tools/make_tiny_hf, ~1 minute
    python benchmarks/bench_hf_sync.py --families qwen2 --repeats 20

Per family and rollout.precision: the wall time of HFEngine.from_state(full, arch, dtype) (to_hf, write_hf_dir
of a fp32 model.safetensors into a temporary directory, AutoModelForCausalLM.from_pretrained) and,
of that, the write_hf_dir alone; median and range over --repeats syncs after one warm-up. `full` is
the source model mapped to megatron names (hf.mapping.from_hf), as gather_full_state returns it.
One process on the CPU; the figures scale with the model's size and the machine's load.
Not a test: nothing here is asserted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _ms(f, repeats: int) -> list[float]:
    f()  # warm-up: imports, transformers' first model class lookup
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        out.append(1e3 * (time.perf_counter() - t))
    return out


def main() -> None:
    from safetensors.torch import load_file

    from megatron_cispo.hf.arch import read_arch
    from megatron_cispo.rollout.hf_engine import HFEngine
    from megatron_cispo.hf.export import write_hf_dir
    from megatron_cispo.hf.mapping import from_hf, to_hf
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", nargs="+", default=["llama", "qwen2", "qwen3", "qwen3_moe"])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'family':<10} {'precision':<9} {'sync ms (median, min..max)':<28} {'of which write_hf_dir ms':<24}")
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            path = make_tiny_hf(family, Path(tmp) / family, seed=0)
            arch = read_arch(path)
            full = from_hf(load_file(str(path / "model.safetensors")), arch)
            hf = to_hf(full, arch)
            n = iter(range(10**6))
            write = _ms(lambda: write_hf_dir(hf, arch, Path(tmp) / f"w{next(n)}", dtype=torch.float32), args.repeats)
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                sync = _ms(lambda: HFEngine.from_state(full, arch, dtype=dtype), args.repeats)
                print(f"{family:<10} {name:<9} {statistics.median(sync):6.1f} ({min(sync):.1f}..{max(sync):.1f}){'':<12}"
                      f"{statistics.median(write):6.1f} ({min(write):.1f}..{max(write):.1f})", flush=True)


if __name__ == "__main__":
    main()
