"""Summarise runs: a table of reward, clip fraction and ratio spread, a figure, and the demo's checks.

    python -m megatron_cispo.demo.report RUN_DIR                     # any run: table + RUN_DIR/metrics.png
    python -m megatron_cispo.demo.report runs/demo/rollout runs/demo/old [--png runs/demo/comparison.png] [--strict]
    python -m megatron_cispo.demo.report --seeds runs/demo_vllm/seed_*/* --png runs/demo_vllm/seeds.png

Reads each run's metrics.jsonl and config.yaml; a null metric (non-finite when it was written)
is left out of means and extremes and is a gap in the figure. The figure goes to --png, else to
RUN_DIR/metrics.png for one run or comparison.png in the runs' common parent folder for several;
the path is printed. The checks are what the demo is meant to show, so they run only for the
demo's pair: two CISPO runs whose configs differ only in loss.cispo.anchor (rollout and old) and
the run: section. The old anchor's ratios are exactly 1 and never clipped; the rollout anchor's
are clipped, and its reward over the last 10% of steps is at least twice that over the first 10%.
--strict exits 1 when a check fails (and 2 when the runs are not the demo's pair). --seeds compares
runs of several seeds by their held-out accuracy (data.eval_prompts): each run's first and last, and per
anchor the gain's mean, min and max, with one eval curve per seed in the figure.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import yaml

from ..config import LossConfig, from_dict
from ..runner.experiment import run_label
from ..runner.metrics import MetricsFileError, finite_record, read_metrics, say

MIN_GAIN = 2.0


def _col(recs: list[dict], key: str, missing: float = float("nan")) -> list[float]:
    """`key` of every record; null (a value that was non-finite) reads as NaN, a plot's gap."""
    return [float("nan") if v is None else float(v) for v in (r.get(key, missing) for r in recs)]


def _finite(xs: list[float]) -> list[float]:
    return [x for x in xs if math.isfinite(x)]


def _mean(xs: list[float]) -> float:
    """Mean of the finite values (a skipped step's null metrics do not poison a run's summary)."""
    xs = _finite(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def _min(xs: list[float]) -> float:
    return min(_finite(xs), default=float("nan"))


def _max(xs: list[float]) -> float:
    return max(_finite(xs), default=float("nan"))


def _config(run_dir: Path) -> dict:
    saved = run_dir / "config.yaml"
    return yaml.safe_load(saved.read_text()) if saved.exists() else {}


def summarize(run_dir: str | Path) -> dict:
    """Headline numbers of one run (first/last 10% of steps, at least one step each)."""
    run_dir = Path(run_dir)
    every = read_metrics(run_dir)
    recs = [r for r in every if "reward_mean" in r]  # the steps (step 0 holds only the evaluation before them)
    evals = [r for r in every if r.get("eval/accuracy") is not None]
    cfg = _config(run_dir)
    loss = cfg.get("loss", {})
    name = cfg.get("run", {}).get("name") or ("" if cfg else run_dir.name)
    loss_cfg = from_dict(LossConfig, loss, "loss")
    label = run_label(loss_cfg, name)
    cispo = loss.get("cispo") if loss.get("policy_loss", "cispo") == "cispo" else None
    anchor = cispo.get("anchor", "?") if cispo else "-"
    k = max(1, len(recs) // 10)
    first, last = _mean(_col(recs[:k], "reward_mean")), _mean(_col(recs[-k:], "reward_mean"))
    return {
        "run": str(run_dir), "label": label,
        "anchor": anchor, "steps": len(recs), "reward_first": first, "reward_last": last,
        "gain": last / first if first > 0 else float("inf"),
        "clip_frac_mean": _mean(_col(recs, "clip_frac", 0.0)),
        "clip_frac_max": _max(_col(recs, "clip_frac", 0.0)),
        "ratio_min": _min(_col(recs, "ratio_min")), "ratio_max": _max(_col(recs, "ratio_max")),
        "lag_max": max((r.get("policy_version_lag", 0) for r in recs), default=0),
        # KL(pi_rollout || pi_old) per token (k3), where the run computed pi_old (the old anchor's recompute)
        "mismatch_k3": _mean(_col(recs, "mismatch/k3_kl")),
        "elapsed_s": _col(recs[-1:], "elapsed_s")[0] if recs else float("nan"),
        "skipped_nonfinite": sum(_finite(_col(recs, "step/skipped_nonfinite", 0.0))),
        "clip_range": loss_cfg.cispo.bounds() if cispo else None,  # (floor, cap) of the CISPO weight
        "prompts": (cfg.get("data") or {}).get("prompts"),  # the prompt file, None for the synthetic task
        # held-out accuracy (data.eval_prompts) of the first and the last weights evaluated, NaN without
        "eval_first": evals[0]["eval/accuracy"] if evals else float("nan"),
        "eval_last": evals[-1]["eval/accuracy"] if evals else float("nan"),
        "seed": cfg.get("run", {}).get("seed"),
    }


def is_demo_pair(run_dirs: list[str | Path]) -> bool:
    """Whether the runs are the demo's comparison: two CISPO runs, anchors rollout and old, whose
    saved configs are otherwise equal (the run: section, i.e. name, run_dir, steps, seed, aside)."""
    if len(run_dirs) != 2:
        return False
    cfgs = [_config(Path(d)) for d in run_dirs]
    anchors, rest = set(), []
    for cfg in cfgs:
        loss = cfg.get("loss", {})
        if not cfg or loss.get("policy_loss") != "cispo":
            return False
        anchors.add(loss.get("cispo", {}).get("anchor"))
        rest.append({**{k: v for k, v in cfg.items() if k != "run"},
                     "loss": {**loss, "cispo": {**loss["cispo"], "anchor": None}}})
    return anchors == {"rollout", "old"} and rest[0] == rest[1]


def checks(s: dict) -> list[tuple[str, bool | None]]:
    """(claim, passed) per run; None marks a number shown for information, not a pass/fail claim."""
    gain = f"reward last10% / first10% = {s['gain']:.2f}"
    if s["anchor"] == "old":
        # The inert anchor: under staleness its batches go uncorrected, so its gain is no claim.
        return [("old anchor: ratio exactly 1 and clip fraction exactly 0 on every step",
                 s["ratio_min"] == 1.0 and s["ratio_max"] == 1.0 and s["clip_frac_max"] == 0.0), (gain, None)]
    # The synthetic task's dense reward learns within the demo; a prompt file's reward (data.prompts,
    # e.g. an exact match from a random model) need not, so there the gain is shown, not claimed.
    out = [(gain, None) if s["prompts"] else (f"{gain} >= {MIN_GAIN}", s["gain"] >= MIN_GAIN)]
    if math.isfinite(s["eval_first"]):
        out.append((f"held-out accuracy {s['eval_first']:.3f} -> {s['eval_last']:.3f} "
                    f"({100 * (s['eval_last'] - s['eval_first']):+.1f} points)", None))
    if s["anchor"] == "rollout":
        out.append(("rollout anchor: clip fraction > 0", s["clip_frac_mean"] > 0.0))
    return out


def _k3(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2e}"


def table(summaries: list[dict]) -> str:
    w = max([16, *(len(s["label"]) for s in summaries)])  # the label column fits the longest label
    head = f"{'run':<{w}} {'steps':>5} {'reward first10%':>15} {'last10%':>8} {'gain':>6} " \
           f"{'clip frac':>10} {'ratio min':>10} {'ratio max':>10} {'lag':>4} {'k3 mismatch':>11} {'time':>6}"
    held_out = any(math.isfinite(s["eval_first"]) for s in summaries)
    if held_out:
        head += f" {'eval first':>10} {'eval last':>9}"
    rows = [head, "-" * len(head)]
    for s in summaries:
        rows.append(f"{s['label']:<{w}} {s['steps']:>5} {s['reward_first']:>15.3f} {s['reward_last']:>8.3f} "
                    f"{s['gain']:>5.2f}x {s['clip_frac_mean']:>10.4f} {s['ratio_min']:>10.6f} "
                    f"{s['ratio_max']:>10.6f} {s['lag_max']:>4} {_k3(s['mismatch_k3']):>11} {s['elapsed_s']:>5.0f}s"
                    + (f" {s['eval_first']:>10.3f} {s['eval_last']:>9.3f}" if held_out else ""))
    return "\n".join(rows)


def figure(run_dirs: list[str | Path]):
    """Reward, clip fraction and ratio spread per step, one column per run (a matplotlib Figure).
    The CISPO clamp's bounds are dashed lines in the legend; below a floor of 0 nothing can be
    clipped, so that curve is replaced by a legend note. ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(summarize(d), read_metrics(d)) for d in run_dirs]
    held_out = any(math.isfinite(s["eval_first"]) for s, _ in runs)
    n_rows = 4 if held_out else 3
    fig, axes = plt.subplots(n_rows, len(runs), figsize=(4.5 * len(runs), 2.7 * n_rows), sharex="col", sharey="row",
                             squeeze=False)
    for col, (s, every) in enumerate(runs):
        recs = [r for r in every if "reward_mean" in r]
        if held_out:
            evals = [r for r in every if r.get("eval/accuracy") is not None]
            axes[3][col].plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], marker="o",
                              color="tab:purple")
            axes[3][col].set_xlabel("step")
        x = [r["step"] for r in recs]
        floor, cap = s["clip_range"] or (None, None)
        ax = axes[0][col]
        ax.plot(x, _col(recs, "reward_mean"), color="tab:green")
        ax.set_title(f"{s['label']} (lag {s['lag_max']})")
        ax = axes[1][col]
        if floor is not None and floor <= 0.0:  # a ratio is never below 0: the curve is 0 by construction
            ax.plot([], [], " ", label="below the floor: none (floor 0)")
        else:
            ax.plot(x, _col(recs, "clip_frac_low", 0.0), label="below the floor" + (f" {floor:g}" if floor else ""))
        ax.plot(x, _col(recs, "clip_frac_high", 0.0), label="above the cap" + (f" {cap:g}" if cap else ""))
        ax.legend(fontsize=7)
        ax = axes[2][col]
        ax.fill_between(x, _col(recs, "ratio_min", 1.0), _col(recs, "ratio_max", 1.0), alpha=0.3, label="min..max")
        ax.plot(x, _col(recs, "ratio_mean", 1.0), label="mean")
        for bound, name in ((cap, "cap"), (floor, "floor")):
            if bound is not None and bound > 0:  # a floor of 0 has no place on a log axis
                ax.axhline(bound, color="gray", linestyle="--", linewidth=0.8, label=f"clamp {name} {bound:g}")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.set_xlabel("step")
    for row, name in enumerate(("reward mean", "clip fraction", "ratio pi/pi_anchor", "held-out accuracy")[:n_rows]):
        axes[row][0].set_ylabel(name)
    fig.tight_layout()
    return fig


def seeds_table(summaries: list[dict]) -> str:
    """Each run's held-out accuracy first and last (points gained), then per anchor the gain's mean, min, max."""
    head = f"{'anchor':<8} {'seed':>6} {'eval first':>10} {'eval last':>9} {'gain (points)':>13}"
    rows = [head, "-" * len(head)]
    by_anchor: dict[str, list[float]] = {}
    for s in sorted(summaries, key=lambda s: (s["anchor"], str(s["seed"]))):
        gain = 100 * (s["eval_last"] - s["eval_first"])
        by_anchor.setdefault(s["anchor"], []).append(gain)
        rows.append(f"{s['anchor']:<8} {str(s['seed']):>6} {s['eval_first']:>10.3f} {s['eval_last']:>9.3f} {gain:>+13.1f}")
    rows.append("")
    for anchor, gains in by_anchor.items():
        rows.append(f"{anchor:<8} gain over {len(gains)} seeds: mean {_mean(gains):+.1f}, min {_min(gains):+.1f}, "
                    f"max {_max(gains):+.1f} points")
    return "\n".join(rows)


def seeds_figure(run_dirs: list[str | Path]):
    """Held-out accuracy per step, one panel per anchor, one curve per seed (a matplotlib Figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(summarize(d), read_metrics(d)) for d in run_dirs]
    anchors = sorted({s["anchor"] for s, _ in runs})
    fig, axes = plt.subplots(1, len(anchors), figsize=(4.5 * len(anchors), 3.5), sharey=True, squeeze=False)
    for ax, anchor in zip(axes[0], anchors):
        for s, recs in runs:
            if s["anchor"] == anchor:
                evals = [r for r in recs if r.get("eval/accuracy") is not None]
                ax.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], marker="o", label=f"seed {s['seed']}")
        ax.set_title(f"anchor: {anchor}")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("held-out accuracy")
    fig.tight_layout()
    return fig


def plot_runs(run_dirs: list[str | Path], out_png: str | Path, seeds: bool = False) -> Path | None:
    """`figure(run_dirs)` (seeds: `seeds_figure`) saved to out_png; None without matplotlib (the `plot` extra)."""
    try:
        fig = seeds_figure(run_dirs) if seeds else figure(run_dirs)
    except ImportError:
        return None
    import matplotlib.pyplot as plt

    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def default_png(run_dirs: list[str | Path]) -> Path:
    """One run: its own folder's metrics.png; several: comparison.png in their common parent folder,
    or in the first run's folder when that parent is the filesystem root or not writable."""
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "metrics.png"
    parent = Path(os.path.commonpath([os.path.abspath(d) for d in run_dirs]))
    if parent == Path(parent.anchor) or not os.access(parent, os.W_OK):  # unrelated runs: keep it with them
        parent = Path(run_dirs[0])
    return parent / "comparison.png"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    ap.add_argument("--png", help="figure path (default: RUN_DIR/metrics.png for one run, else comparison.png "
                                  "in the runs' common parent folder)")
    ap.add_argument("--strict", action="store_true", help="the demo's pair only: exit 1 when a check fails")
    ap.add_argument("--seeds", action="store_true", help="runs of several seeds: held-out accuracy per anchor")
    args = ap.parse_args(argv)
    try:
        for d in args.runs:
            if not (Path(d) / "metrics.jsonl").is_file():
                raise MetricsFileError(f"{d}: no metrics.jsonl here; give a run directory (run.run_dir of a run)")
        summaries = [summarize(d) for d in args.runs]
    except MetricsFileError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    if args.seeds:
        if not all(math.isfinite(s["eval_first"]) for s in summaries):
            print("report: --seeds compares held-out accuracy: every run needs data.eval_prompts", file=sys.stderr)
            return 2
        print(seeds_table(summaries))
        png = plot_runs(args.runs, args.png or default_png(args.runs), seeds=True)
        print(f"figure: wrote {png}" if png else "figure: skipped (pip install matplotlib)")
        return 0
    demo = is_demo_pair(args.runs)
    if args.strict and not demo:
        print("report: --strict checks the demo's pair (two CISPO runs whose configs differ only in "
              "loss.cispo.anchor, rollout and old); these runs are not one", file=sys.stderr)
        return 2
    print(table(summaries))
    ok = True
    for s in summaries if demo else []:
        for text, passed in checks(s):
            ok &= passed is not False
            print(f"  [{'info' if passed is None else 'PASS' if passed else 'FAIL'}] {s['label']}: {text}")
    png = plot_runs(args.runs, args.png or default_png(args.runs))
    print(f"figure: wrote {png}" if png else "figure: skipped (pip install matplotlib)")
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())


def finish_run(cfg, run_dir: Path, seconds: float) -> None:
    """Rank 0, at the end of a run that trained (train.py passes it to runner.loop.run): summary.json and
    this run's figure, and the closing line."""
    import json

    summary = summarize(run_dir)
    summary["train_seconds"] = seconds
    (run_dir / "summary.json").write_text(json.dumps(finite_record(summary), indent=1, allow_nan=False) + "\n")
    png = plot_runs([run_dir], run_dir / "metrics.png")
    say(f"[{cfg.label}] done in {seconds:.0f}s: reward {summary['reward_first']:.3f} -> "
        f"{summary['reward_last']:.3f}; wrote {run_dir}/metrics.jsonl" + (f", {png}" if png else ""), sys.stdout)
