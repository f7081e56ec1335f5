"""Compare demo runs: a table of reward, clip fraction and ratio spread, checks, and a figure.

    python -m megatron_cispo.demo.report runs/demo/rollout runs/demo/old [--png runs/demo/comparison.png] [--strict]

Reads each run's metrics.jsonl and config.yaml; a null metric (non-finite when it was written)
is left out of means and extremes and is a gap in the figure. The checks are what the demo is
meant to show: the old anchor's ratios are exactly 1 and never clipped; the rollout anchor's are
clipped, and its reward over the last 10% of steps is at least twice that over the first 10%.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import yaml

from ..config import LossConfig, from_dict
from ..runner.experiment import run_label
from .metrics import read_metrics

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


def summarize(run_dir: str | Path) -> dict:
    """Headline numbers of one run (first/last 10% of steps, at least one step each)."""
    run_dir = Path(run_dir)
    recs = read_metrics(run_dir)
    saved = run_dir / "config.yaml"
    cfg = yaml.safe_load(saved.read_text()) if saved.exists() else {}
    loss = cfg.get("loss", {})
    name = cfg.get("run", {}).get("name") or ("" if saved.exists() else run_dir.name)
    label = run_label(from_dict(LossConfig, loss, "loss"), name)
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
        "elapsed_s": _col(recs[-1:], "elapsed_s")[0] if recs else float("nan"),
        "skipped_nonfinite": sum(_finite(_col(recs, "step/skipped_nonfinite", 0.0))),
        "clip_range": (1.0 - cispo["eps_low"], 1.0 + cispo["eps_high"]) if cispo else None,
    }


def checks(s: dict) -> list[tuple[str, bool | None]]:
    """(claim, passed) per run; None marks a number shown for information, not a pass/fail claim."""
    gain = f"reward last10% / first10% = {s['gain']:.2f}"
    if s["anchor"] == "old":
        # The inert anchor: under staleness its batches go uncorrected, so its gain is no claim.
        return [("old anchor: ratio exactly 1 and clip fraction exactly 0 on every step",
                 s["ratio_min"] == 1.0 and s["ratio_max"] == 1.0 and s["clip_frac_max"] == 0.0), (gain, None)]
    out = [(f"{gain} >= {MIN_GAIN}", s["gain"] >= MIN_GAIN)]
    if s["anchor"] == "rollout":
        out.append(("rollout anchor: clip fraction > 0", s["clip_frac_mean"] > 0.0))
    return out


def table(summaries: list[dict]) -> str:
    head = f"{'run':<16} {'steps':>5} {'reward first10%':>15} {'last10%':>8} {'gain':>6} " \
           f"{'clip frac':>10} {'ratio min':>10} {'ratio max':>10} {'lag':>4} {'time':>6}"
    rows = [head, "-" * len(head)]
    for s in summaries:
        rows.append(f"{s['label']:<16} {s['steps']:>5} {s['reward_first']:>15.3f} {s['reward_last']:>8.3f} "
                    f"{s['gain']:>5.2f}x {s['clip_frac_mean']:>10.4f} {s['ratio_min']:>10.6f} "
                    f"{s['ratio_max']:>10.6f} {s['lag_max']:>4} {s['elapsed_s']:>5.0f}s")
    return "\n".join(rows)


def plot_runs(run_dirs: list[str | Path], out_png: str | Path) -> Path | None:
    """Reward, clip fraction and ratio spread per step; one column per run. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - plotting is optional (the `plot` extra)
        return None
    runs = [(summarize(d), read_metrics(d)) for d in run_dirs]
    fig, axes = plt.subplots(3, len(runs), figsize=(4.5 * len(runs), 8), sharex="col", sharey="row", squeeze=False)
    for col, (s, recs) in enumerate(runs):
        x = [r["step"] for r in recs]
        ax = axes[0][col]
        ax.plot(x, _col(recs, "reward_mean"), color="tab:green")
        ax.set_title(f"{s['label']} (lag {s['lag_max']})")
        axes[1][col].plot(x, _col(recs, "clip_frac_low", 0.0), label="below 1-eps_low")
        axes[1][col].plot(x, _col(recs, "clip_frac_high", 0.0), label="above 1+eps_high")
        axes[1][col].legend(fontsize=7)
        ax = axes[2][col]
        ax.fill_between(x, _col(recs, "ratio_min", 1.0), _col(recs, "ratio_max", 1.0), alpha=0.3, label="min..max")
        ax.plot(x, _col(recs, "ratio_mean", 1.0), label="mean")
        if s["clip_range"]:
            for bound in s["clip_range"]:
                if bound > 0:
                    ax.axhline(bound, color="gray", linestyle="--", linewidth=0.8)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.set_xlabel("step")
    for row, name in enumerate(("reward mean", "clip fraction", "ratio pi/pi_anchor")):
        axes[row][0].set_ylabel(name)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    ap.add_argument("--png", help="figure path (default: comparison.png next to the first run)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a check fails")
    args = ap.parse_args(argv)
    summaries = [summarize(d) for d in args.runs]
    print(table(summaries))
    ok = True
    for s in summaries:
        for text, passed in checks(s):
            ok &= passed is not False
            print(f"  [{'info' if passed is None else 'PASS' if passed else 'FAIL'}] {s['label']}: {text}")
    png = plot_runs(args.runs, args.png or Path(args.runs[0]).parent / "comparison.png")
    print(f"figure: {png}" if png else "figure: skipped (pip install matplotlib)")
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
