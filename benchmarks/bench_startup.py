"""Start-up of the real CLI: time from launch to step 1, split by phase, and `--check` alone.

    python benchmarks/bench_startup.py                     # torchrun, 2 processes, 5 tiny steps, 3 reps
    python benchmarks/bench_startup.py --nproc 4 --reps 1  # the demo's layout (TP=2 x DP=2)
    python benchmarks/bench_startup.py --tensorboard false # without the TensorBoard writer

Each repetition launches torchrun with this file as the rank program: it stamps the wall clock
when the interpreter reaches it, imports what the CLI imports, wraps the loop's phases
(init_distributed and its first megatron-core import, build_model/build_optimizer, Sampler,
MetricsWriter, policy_step, the end's plot) with timestamps, then calls megatron_cispo.train.main
unchanged. Rank 0's stamps, against the launcher's clock taken before it started torchrun, give
the phases. Two modes alternate, repetition by repetition: megatron-core imported as the CLI does
it now (runner.cpu_compat.import_megatron_core: without CUDA its fused kernels are not compiled)
and, as before, a plain `import megatron.core`, which compiles them with torch.compile at import.
Timings depend on the machine's load: read the split and the ratios, not the seconds.
"""
from __future__ import annotations

import time

T_START = time.time()  # first thing: the interpreter is up and this rank's program starts

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ["run.steps=5", "rollout.prompts_per_step=8", "rollout.group_size=4", "parallelism.micro_batch_size=8",
        "run.log_interval=1"]
# (label, from stamp, to stamp) in timeline order; "launch" is the launcher's clock.
PHASES = [("torchrun + interpreter start", "launch", "start"),
          ("import torch, megatron_cispo.train", "start", "imported_train"),
          ("import demo loop, runner, step", "imported_train", "imported_rest"),
          ("config load + checks", "imported_rest", "init_dist"),
          ("import megatron-core", "import_mcore", "import_mcore_end"),
          ("megatron init (process groups)", "import_mcore_end", "init_dist_end"),
          ("run_dir claim", "init_dist_end", "build_model"),
          ("model + optimizer build", "build_model", "sampler"),
          ("sampler build + weight sync 0", "sampler", "writer"),
          ("metrics writer (tensorboard import)", "writer", "writer_end"),
          ("first step (sample, policy_step, sync)", "writer_end", "log_1")]


def _stamp(stamps: dict, name: str) -> None:
    stamps.setdefault(name, time.time())


def _timed(stamps: dict, name: str, fn):
    def wrapper(*a, **k):
        _stamp(stamps, name)
        try:
            return fn(*a, **k)
        finally:
            _stamp(stamps, name + "_end")
    return wrapper


def worker(out_dir: str, compile_at_import: bool, argv: list[str]) -> int:
    """One rank: the CLI's main with timestamps around its phases; rank 0's go to out_dir."""
    stamps = {"start": T_START}
    import megatron_cispo.train as train
    _stamp(stamps, "imported_train")
    from megatron_cispo import step
    from megatron_cispo.runner import loop
    from megatron_cispo.runner import distributed, model
    _stamp(stamps, "imported_rest")
    stamps["megatron_before_init"] = float("megatron.core" in sys.modules)  # 0: the CLI's import order held

    def plain_import():
        import megatron.core  # noqa: F401 - as before runner.cpu_compat.import_megatron_core
    distributed.import_megatron_core = _timed(stamps, "import_mcore",
                                              plain_import if compile_at_import else distributed.import_megatron_core)
    distributed.init_distributed = _timed(stamps, "init_dist", distributed.init_distributed)
    model.build_model = _timed(stamps, "build_model", model.build_model)
    model.build_optimizer = _timed(stamps, "build_optimizer", model.build_optimizer)
    loop.Sampler = _timed(stamps, "sampler", loop.Sampler)
    loop._finish = _timed(stamps, "finish", loop._finish)
    steps: list[tuple[float, float]] = []
    policy_step = step.policy_step

    def timed_step(*a, **k):
        t0 = time.time()
        try:
            return policy_step(*a, **k)
        finally:
            steps.append((t0, time.time()))
    step.policy_step = timed_step

    class Writer(loop.MetricsWriter):
        def __init__(self, *a, **k):
            _stamp(stamps, "writer")
            super().__init__(*a, **k)
            _stamp(stamps, "writer_end")

        def log(self, record):
            super().log(record)
            _stamp(stamps, f"log_{record['step']}")
    loop.MetricsWriter = Writer
    rc = train.main(argv)
    stamps["exit"] = time.time()
    stamps["dynamo_imported"] = float("torch._dynamo" in sys.modules)
    if os.environ.get("RANK", "0") == "0":
        Path(out_dir, "stamps.json").write_text(json.dumps({"stamps": stamps, "policy_steps": steps}))
    return rc


def _launch(nproc: int, overrides: list[str], port: int, compile_at_import: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(port), __file__, "--worker", d, str(int(compile_at_import)),
               str(ROOT / "yaml_configs/demo_cpu.yaml"), f"run.run_dir={d}/run", *overrides]
        if nproc < 2:
            cmd.append("parallelism.tp=1")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        launch = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        done = time.time()
        if proc.returncode != 0:
            sys.exit(f"the run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        out = json.loads(Path(d, "stamps.json").read_text())
    out["stamps"]["launch"], out["stamps"]["done"] = launch, done
    return out


def _check_time() -> float:
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "megatron_cispo.train", "--check", str(ROOT / "yaml_configs/demo_cpu.yaml"),
                    "--world-size", "4"], cwd=ROOT, capture_output=True, check=True, timeout=300,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    return time.time() - t0


def _rows(runs: list[dict]) -> list[tuple[str, list[float]]]:
    """(phase, seconds per repetition), timeline order, then the totals."""
    st = [r["stamps"] for r in runs]
    rows = [(label, [s[b] - s[a] for s in st]) for label, a, b in PHASES]
    rows.append(("(of which policy_step 1)", [r["policy_steps"][0][1] - r["policy_steps"][0][0] for r in runs]))
    rows.append(("**launch -> step 1**", [s["log_1"] - s["launch"] for s in st]))
    rows.append(("later steps (each, median)",
                 [statistics.median(b - a for a, b in r["policy_steps"][1:]) for r in runs]))
    rows.append(("end: summary.json + metrics.png (rank 0)", [s["finish_end"] - s["finish"] for s in st]))
    rows.append(("end: shutdown (rank 0's main returns)", [s["exit"] - s["finish_end"] for s in st]))
    rows.append(("end: interpreter exit + torchrun", [s["done"] - s["exit"] for s in st]))
    rows.append(("launch -> torchrun exits", [s["done"] - s["launch"] for s in st]))
    return rows


def _cell(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f} - {max(xs):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tensorboard", default="true", choices=["true", "false"])
    ap.add_argument("--port", type=int, default=29731)
    args = ap.parse_args()
    overrides = [*TINY, f"run.tensorboard={args.tensorboard}"]
    modes = {"compiled at import (megatron's default)": True, "eager on CPU (runner)": False}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    loads = []
    for i in range(args.reps):  # interleaved, so both see the same load
        for j, (mode, compile_at_import) in enumerate(modes.items()):
            runs[mode].append(_launch(args.nproc, overrides, args.port + 2 * i + j, compile_at_import))
            loads.append(os.getloadavg()[0])
    checks = [_check_time() for _ in range(args.reps)]
    for mode, rs in runs.items():
        assert all(r["stamps"]["megatron_before_init"] == 0 for r in rs), "megatron.core was imported before init"
    before, now = (_rows(rs) for rs in runs.values())
    total = statistics.median(dict(now)["**launch -> step 1**"])
    print(f"demo_cpu.yaml {' '.join(overrides)}; {args.nproc} processes; rank 0's clock; median (min - max) of "
          f"{args.reps} interleaved repetitions; 1-min load average {min(loads):.1f}-{max(loads):.1f} on "
          f"{os.cpu_count()} cores")
    print(f"| phase | {' s | '.join(modes)} s | now / before | share of launch -> step 1 (now) |")
    print("|---|---|---|---|---|")
    for (label, b), (_, n) in zip(before, now):
        ratio = statistics.median(n) / statistics.median(b) if statistics.median(b) > 0.05 else float("nan")
        print(f"| {label} | {_cell(b)} | {_cell(n)} | {ratio:.2f}x | {statistics.median(n) / total:.0%} |")
    dyn = [r["stamps"]["dynamo_imported"] for r in runs["eager on CPU (runner)"]]
    print(f"`python -m megatron_cispo.train --check` alone: {_cell(checks)} s; TorchDynamo imported by the end of "
          f"an eager run: {'yes' if all(dyn) else 'no' if not any(dyn) else 'sometimes'}")


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], sys.argv[3] == "1", sys.argv[4:]))
    main()
