"""Per-step metrics of a run: metrics.jsonl, a progress line with an ETA, TensorBoard events.

    writer = MetricsWriter(run_dir, label=..., total_steps=60, log_interval=5, start_step=0)
    writer.log(record); writer.close()

Only rank 0 makes one (the metrics are global and identical on every rank). On resume the
jsonl is cut back to the checkpoint's step, so it always holds one line per step. Every line is
strict JSON: a NaN or infinite value is written as null and its key listed in the line's
"nonfinite" field (absent when there is none).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
# Flat names required in every record, from policy_step's namespaced keys ({loss} = policy_loss).
HEADLINE = {
    "loss": "policy/loss", "grad_norm": "step/grad_norm", "tokens": "policy/tokens",
    "entropy": "policy/entropy", "ratio_mean": "{loss}/ratio_mean", "ratio_min": "{loss}/ratio_min",
    "ratio_max": "{loss}/ratio_max", "clip_frac_low": "{loss}/clip_frac_low",
    "clip_frac_high": "{loss}/clip_frac_high", "weight_mean": "{loss}/weight_mean",
}
# Wall-clock keys: they differ between otherwise identical runs.
TIMING_KEYS = ("tokens_per_s", "step_time_s", "elapsed_s")


def headline(metrics: dict[str, float], policy_loss: str) -> dict[str, float]:
    out = {k: metrics[v.format(loss=policy_loss)] for k, v in HEADLINE.items() if v.format(loss=policy_loss) in metrics}
    out["clip_frac"] = out.get("clip_frac_low", 0.0) + out.get("clip_frac_high", 0.0)
    return out


NONFINITE_KEY = "nonfinite"


def finite_record(record: dict) -> dict:
    """`record` as strict JSON can hold it: non-finite floats -> None, their keys under "nonfinite"."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: None if k in bad else v for k, v in record.items()}, NONFINITE_KEY: bad}


def json_line(record: dict) -> str:
    return json.dumps(finite_record(record), allow_nan=False) + "\n"


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of metrics.jsonl; values that were non-finite are None (null)."""
    path = Path(run_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class MetricsWriter:
    def __init__(self, run_dir: str | Path, *, label: str, total_steps: int, log_interval: int,
                 start_step: int = 0, tensorboard: bool = True, stream=sys.stdout):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.label, self.total, self.interval, self.stream = label, total_steps, log_interval, stream
        path = self.dir / METRICS_FILE
        kept = [r for r in read_metrics(self.dir) if r["step"] <= start_step] if path.exists() and start_step else []
        path.write_text("".join(json_line(r) for r in kept))
        self.file = path.open("a")
        self.start_step, self.t0 = start_step, time.perf_counter()
        self.tb = _tensorboard(self.dir / "tb", start_step) if tensorboard else None

    def log(self, record: dict) -> None:
        self.file.write(json_line(record))
        self.file.flush()
        step = record["step"]
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if step % self.interval == 0 or step == self.total:
            done = step - self.start_step
            per_step = (time.perf_counter() - self.t0) / max(done, 1)
            print(f"[{self.label}] step {step}/{self.total} | reward {record['reward_mean']:.3f} "
                  f"| loss {record.get('loss', float('nan')):+.4f} | clip {record.get('clip_frac', 0.0):.3f} "
                  f"| ratio [{record.get('ratio_min', float('nan')):.3f}, {record.get('ratio_max', float('nan')):.3f}] "
                  f"| lag {record['policy_version_lag']} | {per_step:.2f} s/step "
                  f"| ETA {_duration(per_step * (self.total - step))}", file=self.stream, flush=True)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _tensorboard(path: Path, start_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # noqa: BLE001 - tensorboard is optional; any import failure means "absent"
        return None
    return SummaryWriter(str(path), purge_step=start_step + 1 if start_step else None)
