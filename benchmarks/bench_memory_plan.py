"""The memory plan (runner/memory_plan.py, what `train --check` prints) against torch's own accounting of
the shipped CPU configs, per rank, through the real runner.

    python benchmarks/bench_memory_plan.py                                # every CPU config (~10 min, 2 cores)
    python benchmarks/bench_memory_plan.py --configs demo_cpu moe_cpu     # some of them

Each config runs rollout.staleness + 2 steps under torchrun at the world size its header launches
(runner.loop.run, as `train` runs it; no checkpoint, export or TensorBoard), inside torch.profiler with
profile_memory=True. The live bytes over time are torch's CPU allocator's own total (c10's
ProfiledCPUMemoryReporter, which with FLAGS_caffe2_report_cpu_memory_usage set counts the allocations and
frees of every thread) as each recorded allocation event carries it, from before the model is built. Not the
running sum of the events: the profiler records only the threads it profiles, and a tensor freed on a gloo
worker thread (an all-reduced activation whose collective outlives the caller's reference: about half of
them) has no free event, so that sum grows by the hidden-sized outputs of every TP all-reduce, step after
step. Measured per rank, in the last step (the lagged versions and Adam's state are complete by then):
- train: the peak of live bytes during policy_step (weights, gradients, optimizer state, activations, the
  head's workspace, and what the sampler keeps: lagged versions, rank 0's in-process engine);
- sync: the peak during the sampler's rollouts() (the weight stream into the engine, its buckets, generation);
- static: the bytes of the parameters, megatron's gradient buffers and the optimizer's own tensors, summed
  from the objects themselves after the step (unique storages).
The plan's train figure is its resident parts + its train parts (activations, the rollout batch), its sync
figure resident + its sync parts (weight-sync buckets, the batch broadcast, engine update); an engine in its
own process (vLLM) has its share on rank 0 left out, as the shared bucket file is mapped, not allocated by
torch. vllm_qwen2_tiny runs with data.max_prompt_tokens set to its files' longest prompt (which refuses no
prompt), so the plan bounds its rows as the run has them instead of by model.seq_length. Also printed: the
peak resident-set growth of the whole run (VmHWM minus VmRSS before the run), which counts only touched pages
plus what is not a tensor (gloo, megatron's set-up, Python objects); after the table, for a prompt-file config
the last step's widest row against the plan's bound on it (memory_parts.row_tokens), and for an MoE config
whose ranks form one EP group, the routed copies each rank's experts received in every MoE layer call of the
last step, as a multiple of their balanced share (the EP group's tokens x top-k / ep), which is what the plan
takes (runner/memory_parts.expert_skew: the dropless dispatcher has no bound below ep x min(top-k, local
experts) / top-k). Not a test: nothing here is asserted.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MIB = 2**20
# config -> world size its header launches; the hf ones need their tiny model (made here when missing)
CONFIGS = {"demo_cpu": 4, "cispo_old": 4, "cispo_rollout": 4, "cp2_cpu": 2, "moe_cpu": 2, "hf_qwen2_tiny": 4,
           "hf_qwen3_moe_tiny": 2, "vllm_qwen2_tiny": 2}
TINY = {"hf_qwen2_tiny": ("qwen2", "runs/models/tiny_qwen2"), "hf_qwen3_moe_tiny": ("qwen3_moe", "runs/models/tiny_qwen3_moe")}
QUIET = ["run.checkpoint_interval=0", "run.export_hf=false", "run.tensorboard=false", "run.log_interval=1000",
         "run.eval_interval=0"]


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _count_every_thread() -> None:
    """Have c10's CPU allocator keep its live-bytes total for every thread, the profiled one or not."""
    import ctypes

    import torch

    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def _allocator_totals(prof) -> list[tuple[int, int]]:
    """[(time ns, the CPU allocator's live bytes just after)] of every CPU allocation and free recorded."""
    from torch._C._profiler import _EventType

    out, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            out.append((node.start_time_ns, node.typed[1].total_allocated))
    return sorted(out)


def _count_routing(calls: list) -> None:
    """Append (time ns, "in", tokens) for every MoE layer call (the tokens this rank routes) and (time ns,
    "experts", rows) for every call of its local experts (the routed copies they receive: megatron's
    SequentialMLP input, which the alltoall dispatcher fills without a capacity)."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    def counted(kind, fn, rows):
        def wrapped(self, x, *a, **k):
            calls.append((time.time_ns(), kind, rows(x)))
            return fn(self, x, *a, **k)
        return wrapped
    MoELayer.forward = counted("in", MoELayer.forward, lambda x: x.shape[0] * x.shape[1])
    SequentialMLP.forward = counted("experts", SequentialMLP.forward, lambda x: x.shape[0])


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _static(chunks, optimizer) -> dict:
    """Bytes of the parameters, the DDP gradient buffers, and the optimizer's own tensors (state, main copies)."""
    import torch

    params = [p for c in chunks for p in c.parameters()]
    buffers = [b for c in chunks for b in (*c.buffers, *c.expert_parallel_buffers)]
    grads = _storage_bytes([b.grad_data for b in buffers])
    model = {p.untyped_storage().data_ptr() for p in params} | {b.grad_data.untyped_storage().data_ptr() for b in buffers}
    own = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        for st in sub.optimizer.state.values():
            own += [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        own += [p for g in sub.optimizer.param_groups for p in g["params"]]
    own = [t for t in own if t.untyped_storage().data_ptr() not in model]
    return {"weights": _storage_bytes(params), "gradients": grads, "optimizer state": _storage_bytes(own)}


def worker(config: str, out: str, overrides: list[str]) -> None:
    """One rank under torchrun: the run inside the profiler; writes out/rank<r>.json."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from megatron_cispo import step as step_pkg
    from megatron_cispo.rollout.prompt_sampler import PromptSampler
    from megatron_cispo.rollout.task_sampler import TaskSampler
    from megatron_cispo.runner import model as model_mod
    from megatron_cispo.runner.experiment import load_experiment
    from megatron_cispo.runner.loop import run

    cfg = load_experiment(ROOT / "yaml_configs" / f"{config}.yaml", overrides)
    windows, held, static = [], {}, {}

    def timed(label, fn):
        def wrapped(*a, **k):
            gc.collect()  # the previous step's autograd cycles: unreachable, freed late by Python's collector
            t0 = time.time_ns()
            try:
                return fn(*a, **k)
            finally:
                windows.append((label, t0, time.time_ns()))
        return wrapped

    def keep(name, fn):
        def wrapped(*a, **k):
            held[name] = fn(*a, **k)
            return held[name]
        return wrapped

    policy_step = step_pkg.policy_step

    def stepped(*a, **k):
        res = timed("train", policy_step)(*a, **k)
        static.update(_static(held["chunks"], held["optimizer"]))
        static["row"] = a[2].tokens.shape[1] - 1  # the batch's widest row, in targets (its rows are padded to it)
        return res

    step_pkg.policy_step = stepped
    model_mod.build_model = keep("chunks", model_mod.build_model)
    model_mod.build_optimizer = keep("optimizer", model_mod.build_optimizer)
    for cls in (TaskSampler, PromptSampler):
        cls.rollouts = timed("sync", cls.rollouts)
    routing: list = []
    _count_routing(routing)
    rss0 = _status_kib("VmRSS")
    _count_every_thread()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(cfg)
    hwm = _status_kib("VmHWM")
    timeline = _allocator_totals(prof)

    def peak(label):  # the last window of that kind: the last step's
        _, t0, t1 = [w for w in windows if w[0] == label][-1]
        before = [v for t, v in timeline if t < t0][-1:] or [0]
        return max([v for t, v in timeline if t0 <= t <= t1] + before)

    rank = int(os.environ["RANK"])
    _, t0, t1 = [w for w in windows if w[0] == "train"][-1]
    routed = {kind: [n for t, k, n in routing if k == kind and t0 <= t <= t1] for kind in ("in", "experts")}
    result = {"rank": rank, "train": peak("train"), "sync": peak("sync"), "whole": max(v for _, v in timeline),
              "static": static, "rss_growth": (hwm - rss0) * 1024, "routed": routed}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def measure(config: str, world: int, extra: list[str]) -> list[dict]:
    from megatron_cispo.runner.experiment import load_experiment

    steps = load_experiment(ROOT / "yaml_configs" / f"{config}.yaml", extra).rollout.staleness + 2
    with tempfile.TemporaryDirectory(prefix="bench_memory_plan_") as tmp:
        overrides = [*QUIET, f"run.steps={steps}", f"run.run_dir={tmp}/run", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RUN_DIR": f"{tmp}/run"}
        cmd = [str(ROOT / ".venv/bin/torchrun"), "--standalone", "--nproc-per-node", str(world),
               __file__, "--worker", config, "--out", tmp, *overrides]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{config}: torchrun exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def _prompt_bound(config: str, overrides: list[str]) -> list[str]:
    """[data.max_prompt_tokens=<the longest prompt of data.prompts and data.eval_prompts, in tokens>] for a
    prompt-file config without one (that limit refuses no prompt of these files), else []."""
    from megatron_cispo.rollout.prompts import PromptStream
    from megatron_cispo.runner.experiment import load_experiment

    cfg = load_experiment(ROOT / "yaml_configs" / f"{config}.yaml", overrides)
    d = cfg.data
    if d.prompts is None or d.max_prompt_tokens is not None:
        return []
    longest = max(max(len(ids) for ids in PromptStream(path, tokenizer_path=cfg.model.hf_path, seed=0,
                                                        prompt_key=d.prompt_key, chat_template=d.chat_template)._ids)
                  for path in (d.prompts, d.eval_prompts) if path is not None)
    return [f"data.max_prompt_tokens={longest}"]


def _make_tiny(config: str) -> None:
    family, path = TINY[config]
    if not (ROOT / path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "megatron_cispo.tools.make_tiny_hf", "--family", family, path],
                       cwd=ROOT, check=True, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args, overrides = ap.parse_known_args(argv)
    if args.worker:
        worker(args.worker, args.out, overrides)
        return 0
    from megatron_cispo.runner.experiment import load_experiment
    from megatron_cispo.rollout.engine import engine_spec
    from megatron_cispo.runner.memory_parts import row_tokens
    from megatron_cispo.runner.memory_plan import PHASE, memory_plan

    print("| config | ranks | part | predicted MiB | measured MiB | measured / predicted |")
    print("|---|---|---|---:|---:|---:|")
    notes = []
    for config in args.configs:
        if config in TINY:
            _make_tiny(config)
        world, extra = CONFIGS[config], [*overrides, *_prompt_bound(config, overrides)]
        try:
            measured = measure(config, world, extra)
        except RuntimeError as e:
            print(f"| {config} | - | not run: {str(e).splitlines()[0]} | | | |")
            continue
        cfg = load_experiment(ROOT / "yaml_configs" / f"{config}.yaml", extra)
        mapped = engine_spec(cfg.rollout.engine).overlaps  # its share on rank 0: a mapped file, not torch's
        for g in memory_plan(cfg, world, device="cpu"):
            parts = {k: v for k, v in g.parts.items() if not (mapped and k == "rollout engine")}
            by = {ph: sum(v for k, v in parts.items() if PHASE[k] == ph) for ph in ("resident", "train", "sync")}
            total = by["resident"] + max(by["train"], by["sync"])
            rows = [(k, g.parts[k], [m["static"][k] for m in measured if m["rank"] in g.ranks])
                    for k in ("weights", "gradients", "optimizer state")]
            rows += [("train peak", by["resident"] + by["train"], [m["train"] for m in measured if m["rank"] in g.ranks]),
                     ("sync peak", by["resident"] + by["sync"], [m["sync"] for m in measured if m["rank"] in g.ranks]),
                     ("whole run", total, [m["whole"] for m in measured if m["rank"] in g.ranks]),
                     ("RSS growth", total, [m["rss_growth"] for m in measured if m["rank"] in g.ranks])]
            for part, want, got in rows:
                lo, hi = min(got), max(got)
                span = f"{lo / MIB:.3f}" if hi - lo < 0.0005 * MIB else f"{lo / MIB:.3f}-{hi / MIB:.3f}"
                ratio = f"{lo / want:.3f}" + ("" if hi == lo else f"-{hi / want:.3f}") if want else "-"
                ranks = ",".join(map(str, g.ranks))
                print(f"| {config} | {ranks} | {part} | {want / MIB:.3f} | {span} | {ratio} |", flush=True)
        if cfg.data.prompts is not None:  # rows as long as the completions: the plan takes the longest possible
            notes.append(f"{config}: the last step's widest row {measured[0]['static']['row']} targets; the plan's "
                         f"bound {row_tokens(cfg)} (the longest prompt + rollout.max_new_tokens - 1)")
        if cfg.model.num_moe_experts and cfg.parallelism.ep == world:  # every rank in the one EP group
            notes.append(f"{config}: {_routing_note(measured, cfg.model.moe_router_topk, world)}")
    for note in notes:
        print(note)
    return 0


def _routing_note(measured: list[dict], topk: int, ep: int) -> str:
    """Per rank, the routed copies its experts received in the last step's layer calls (microbatch x layer),
    as a multiple of their balanced share (the EP group's tokens x top-k / ep): the range over the calls."""
    share = [sum(ns) * topk / ep for ns in zip(*(m["routed"]["in"] for m in measured))]
    out = []
    for m in sorted(measured, key=lambda m: m["rank"]):
        ratios = [n / s for n, s in zip(m["routed"]["experts"], share)]
        out.append(f"rank {m['rank']} {min(ratios):.2f}-{max(ratios):.2f}")
    return "routed tokens at each rank's experts / their balanced share, per layer call of the last step: " + \
        ", ".join(out)


if __name__ == "__main__":
    sys.exit(main())
