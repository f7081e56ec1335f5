"""Per-step metrics of a run: metrics.jsonl, a progress line with an ETA, TensorBoard events.

    writer = MetricsWriter(run_dir, label=..., total_steps=60, log_interval=5, start_step=0)
    writer.log(record); writer.close()

Only rank 0 makes one (the metrics are global and identical on every rank). On resume the
jsonl is cut back to the checkpoint's step, so it always holds one line per step; a last line
that a write left incomplete (disk full) is cut with one warning, never a reason to refuse. Every
line is strict JSON: a NaN or infinite value is written as null and its key listed in the line's
"nonfinite" field (absent when there is none). The progress line adds, when the record has them,
the corrections' drop fractions, the old/rollout mismatch and the MoE router's balance; when the
corrections drop (nearly) every token for DROP_ALL_STEPS steps in a row, one warning says so.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from ..base.console import say

METRICS_FILE = "metrics.jsonl"
# Flat names required in every record, from policy_step's namespaced keys ({loss} = policy_loss).
HEADLINE = {
    "loss": "policy/loss", "grad_norm": "step/grad_norm", "tokens": "policy/tokens",
    "entropy": "policy/entropy", "ratio_mean": "{loss}/ratio_mean", "ratio_min": "{loss}/ratio_min",
    "ratio_max": "{loss}/ratio_max", "clip_frac_low": "{loss}/clip_frac_low",
    "clip_frac_high": "{loss}/clip_frac_high", "weight_mean": "{loss}/weight_mean",
}
# Wall-clock keys: they differ between otherwise identical runs (tests compare runs without them).
TIMING_KEYS = ("tokens_per_s", "step_time_s", "elapsed_s")
# Each correction's dropped share of the trained tokens (losses.corrections, step.m2po), by config key.
CORRECTION_DROPS = {"mis": "correction/mis_masked_frac", "geo_rs": "correction/geo_rs_dropped_token_frac",
                    "opsm": "correction/opsm_dropped_token_frac", "m2po": "correction/m2po_masked_frac"}
DROPPED = "correction/dropped_token_frac"  # all corrections together
# "The corrections drop everything": at least this share of the trained tokens, this many steps in a
# row (or every step of a shorter run). One step can drop most tokens by chance; several cannot.
DROP_ALL_FRAC = 0.99
DROP_ALL_STEPS = 3


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


class MetricsFileError(ValueError):
    """A line of metrics.jsonl that is not a JSON record (not the last one), named by file and line."""


def _parse(path: Path) -> tuple[list[dict], list[int], int]:
    """(records, 1-based numbers of the lines that are not a JSON object with a "step", line count)."""
    recs, bad = [], []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict) and "step" in rec:
            recs.append(rec)
        else:
            bad.append(i)
    return recs, bad, len(lines)


def _warn(text: str) -> None:
    say(f"warning: {text}")


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of metrics.jsonl; values that were non-finite are None (null). A torn last line
    (a write cut short, e.g. by a full disk) is left out with a warning; any other line that is not a
    JSON record raises MetricsFileError naming the file and the line."""
    path = Path(run_dir) / METRICS_FILE
    recs, bad, last = _parse(path)
    if bad and bad[0] != last:
        raise MetricsFileError(f"{path}:{bad[0]}: not a JSON record (every line of {METRICS_FILE} is one "
                               f"step's JSON object); fix or delete that line")
    if bad:
        _warn(f"{path}:{last}: the last line is incomplete (a write cut short, e.g. disk full); left out")
    return recs


def _resumed_records(path: Path, start_step: int) -> list[dict]:
    """The records of steps <= start_step; lines that do not parse are dropped with one warning, so a
    damaged log never blocks a restart (a torn last line is the usual case: disk full mid-write)."""
    recs, bad, last = _parse(path)
    if bad:
        which = f"line {last} (the last) is" if bad == [last] else f"lines {', '.join(map(str, bad))} are"
        _warn(f"{path}: {which} not a complete JSON record, probably a write cut short (disk full); "
              f"dropped, the resumed run rewrites the steps after {start_step}")
    return [r for r in recs if r["step"] <= start_step]


def _rewrite(path: Path, recs: list[dict]) -> None:
    """Replace the file in one rename, so a failed rewrite (disk full again) leaves the old one whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json_line(r) for r in recs))
    os.replace(tmp, path)


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
        _rewrite(path, _resumed_records(path, start_step) if path.exists() and start_step else [])
        self.file = path.open("a")
        self.start_step, self.t0 = start_step, time.perf_counter()
        self.tb = _tensorboard(self.dir / "tb", start_step) if tensorboard else None
        self._dropping_all, self._warned_drop = 0, False

    def log(self, record: dict) -> None:
        self.file.write(json_line(record))
        self.file.flush()
        step = record["step"]
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if "reward_mean" not in record:  # step 0: the evaluation of the weights training starts from
            say(f"[{self.label}] before step 1 | {_eval_part(record)}", self.stream)
            return
        self._check_drops(record)
        if step % self.interval == 0 or step == self.total or "eval/accuracy" in record:
            done = step - self.start_step
            per_step = (time.perf_counter() - self.t0) / max(done, 1)
            nan = float("nan")
            parts = [f"[{self.label}] step {step}/{self.total}", f"reward {record['reward_mean']:.3f}",
                     f"loss {record.get('loss', nan):+.4f}", f"clip {record.get('clip_frac', 0.0):.3f}",
                     f"ratio [{record.get('ratio_min', nan):.3f}, {record.get('ratio_max', nan):.3f}]",
                     *active_parts(record), f"lag {record['policy_version_lag']}",
                     *([_eval_part(record)] if "eval/accuracy" in record else []), f"{per_step:.2f} s/step",
                     f"ETA {_duration(per_step * (self.total - step))}"]
            say(" | ".join(parts), self.stream)

    def _check_drops(self, record: dict) -> None:
        """Warn once (stderr) when the corrections drop >= DROP_ALL_FRAC of the trained tokens on
        DROP_ALL_STEPS steps in a row, or on every step of a run shorter than that."""
        frac = record.get(DROPPED)
        full = isinstance(frac, (int, float)) and frac >= DROP_ALL_FRAC
        self._dropping_all = self._dropping_all + 1 if full else 0
        if self._warned_drop or not full or self._dropping_all < min(DROP_ALL_STEPS, self.total - self.start_step):
            return
        self._warned_drop = True
        drops = {k: record.get(v) for k, v in CORRECTION_DROPS.items() if isinstance(record.get(v), (int, float))}
        worst = max(drops, key=drops.get) if drops else None
        cause = f"; loss.correction.{worst} alone drops {drops[worst]:.1%}" if worst else ""
        _warn(f"[{self.label}] the corrections dropped {frac:.1%} of the trained tokens on each of the last "
              f"{self._dropping_all} steps (>= {DROP_ALL_FRAC:.0%}){cause}: the policy trains on almost nothing. "
              f"Widen the correction's band or raise its threshold")

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _eval_part(record: dict) -> str:
    """The progress line's evaluation field: held-out accuracy (and pass@k) of the step's weights."""
    passk = next((f" pass@{k.split('@')[1]} {v:.3f}" for k, v in record.items() if k.startswith("eval/pass@")), "")
    return f"eval acc {record['eval/accuracy']:.3f}{passk}"


def _num(record: dict, key: str) -> float | None:
    v = record.get(key)
    return float(v) if isinstance(v, (int, float)) else None


def active_parts(record: dict) -> list[str]:
    """Progress-line fields for what this run has on: the old/rollout mismatch (k3 KL estimate of
    KL(pi_rollout || pi_old), present when both logprobs are; under the rollout anchor the line's
    ratio [min, max] is the mismatch itself), the corrections' dropped token share
    (total, then each correction's), the MoE aux / z loss and tokens per expert (min..max over the
    global batch). A key the record lacks shows nothing."""
    parts = []
    if (k3 := _num(record, "mismatch/k3_kl")) is not None:
        parts.append(f"mismatch k3 {k3:.3g}")
    if (dropped := _num(record, DROPPED)) is not None:
        each = {k: v for k in CORRECTION_DROPS if (v := _num(record, CORRECTION_DROPS[k])) is not None}
        detail = ", ".join(f"{k} {v:.3f}" for k, v in each.items()) if len(each) > 1 else "".join(each)
        parts.append(f"drop {dropped:.3f}" + (f" ({detail})" if detail else ""))
    moe = [f"{name} {v:.3g}" for name, key in (("aux", "moe/aux_loss"), ("z", "moe/z_loss"))
           if (v := _num(record, key)) is not None]
    lo, hi = _num(record, "moe/expert_tokens_min"), _num(record, "moe/expert_tokens_max")
    if lo is not None and hi is not None:
        moe.append(f"tokens/expert {lo:.0f}..{hi:.0f}")
    if moe:
        parts.append("moe " + " ".join(moe))
    return parts


def _tensorboard(path: Path, start_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # noqa: BLE001 - tensorboard is optional; any import failure means "absent"
        return None
    return SummaryWriter(str(path), purge_step=start_step + 1 if start_step else None)
