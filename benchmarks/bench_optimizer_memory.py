"""optimizer.distributed: the optimizer state each rank holds, plain against distributed, by DP size.

    python benchmarks/bench_optimizer_memory.py                        # dp 1, 2, 4 (tp 1), fp32 and bf16
    python benchmarks/bench_optimizer_memory.py --dp 2 4 --hidden 512 --layers 4

Spawns dp gloo ranks per case (megatron_cispo.testing.spawn), builds yaml_configs/demo_cpu.yaml's GPT
with the runner's build_model/build_optimizer (fp32, and bf16 as GPU runs train it; Adam), lets Adam
allocate its state as its first step does, and sums per rank the bytes of the tensors the optimizer
owns beyond the model: Adam's exp_avg and exp_avg_sq, and the fp32 main copies a bf16 model adds.
Prints the largest rank's bytes and the ratio of distributed to plain.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _state_bytes(distributed: bool, bf16: bool, overrides: list[str]) -> int:
    import torch

    from megatron_cispo.runner.distributed import init_distributed
    from megatron_cispo.runner.experiment import load_experiment
    from megatron_cispo.runner.model import build_model, build_optimizer

    cfg = load_experiment(ROOT / "yaml_configs" / "demo_cpu.yaml", ["parallelism.tp=1", *overrides], env={})
    init_distributed(tp=1, seed=cfg.run.seed)
    model_cfg = replace(cfg.model, dtype="bf16") if bf16 else cfg.model
    chunks = build_model(model_cfg, tp=1, pp=1, seed=cfg.run.seed, distributed_optimizer=distributed)
    opt = build_optimizer(chunks, lr=1e-3, distributed=distributed, bf16=bf16)
    for sub in getattr(opt, "chained_optimizers", [opt]):
        inner = sub.optimizer
        for group in inner.param_groups:  # Adam's state appears at its first step: take one at lr 0
            group["lr"] = 0.0
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        inner.step()
    model = {p.data_ptr() for c in chunks for p in c.parameters()}
    total = 0
    for sub in getattr(opt, "chained_optimizers", [opt]):
        for st in sub.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
        for group in sub.optimizer.param_groups:  # main params that are copies, not the model's own
            total += sum(p.numel() * p.element_size() for p in group["params"]
                         if p.untyped_storage().data_ptr() not in model)
    return total


def main(argv: list[str] | None = None) -> int:
    from megatron_cispo.testing import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="data-parallel sizes (tp 1, pp 1)")
    ap.add_argument("--hidden", type=int, default=None, help="model.hidden_size (default: the YAML's)")
    ap.add_argument("--layers", type=int, default=None, help="model.num_layers (default: the YAML's)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], nargs="+", default=["fp32", "bf16"],
                    help="the model's dtype: bf16 (as GPU runs train) adds the optimizer's fp32 main weights")
    args = ap.parse_args(argv)
    overrides = [f"model.hidden_size={args.hidden}"] * (args.hidden is not None) + \
        [f"model.num_layers={args.layers}"] * (args.layers is not None)
    print(f"{'model':>5} {'dp':>3} {'plain MiB/rank':>15} {'distributed MiB/rank':>21} {'ratio':>7}")
    for dtype in args.dtype:
        for dp in args.dp:
            plain = max(spawn(_state_bytes, dp, args=(False, dtype == "bf16", overrides), timeout_s=600))
            sharded = max(spawn(_state_bytes, dp, args=(True, dtype == "bf16", overrides), timeout_s=600))
            print(f"{dtype:>5} {dp:>3} {plain / 2**20:>15.3f} {sharded / 2**20:>21.3f} {sharded / plain:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
