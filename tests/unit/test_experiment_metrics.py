"""The demo's metrics writer (jsonl, progress line, TensorBoard hook) and run report, single process."""
import io
import json
import sys
import types

from megatron_cispo.runner import metrics as M
from megatron_cispo.demo.report import checks, summarize, table


def _rec(step, reward, **kw):
    return {"step": step, "reward_mean": reward, "policy_version_lag": 2, "loss": 0.1, "clip_frac": 0.0,
            "ratio_min": 1.0, "ratio_max": 1.0, **kw}


def test_jsonl_progress_line_and_resume_truncation(tmp_path):
    out = io.StringIO()
    w = M.MetricsWriter(tmp_path, label="x", total_steps=4, log_interval=2, tensorboard=False, stream=out)
    for s in range(1, 5):
        w.log(_rec(s, 0.1 * s))
    w.close()
    assert [r["step"] for r in M.read_metrics(tmp_path)] == [1, 2, 3, 4]
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[x] step 2/4 | reward 0.200") and "ETA" in lines[0]
    M.MetricsWriter(tmp_path, label="x", total_steps=4, log_interval=2, start_step=2, tensorboard=False).close()
    assert [r["step"] for r in M.read_metrics(tmp_path)] == [1, 2]  # resumed at 2: steps 3-4 will be rewritten


def test_tensorboard_events_when_installed(tmp_path, monkeypatch):
    seen = []

    class Writer:
        def __init__(self, path, purge_step=None):
            seen.append(("init", path, purge_step))

        def add_scalar(self, k, v, step):
            seen.append((k, v, step))

        def close(self):
            seen.append("close")

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    w = M.MetricsWriter(tmp_path, label="x", total_steps=1, log_interval=1, stream=io.StringIO())
    w.log(_rec(1, 0.5))
    w.close()
    assert ("reward_mean", 0.5, 1) in seen and seen[-1] == "close"


def test_headline_maps_namespaced_metrics():
    h = M.headline({"policy/loss": 2.0, "cispo/clip_frac_low": 0.1, "cispo/clip_frac_high": 0.2}, "cispo")
    assert h["loss"] == 2.0 and abs(h["clip_frac"] - 0.3) < 1e-12


def _run(tmp_path, name, anchor, rewards, ratio=(1.0, 1.0), clip=0.0):
    d = tmp_path / name
    d.mkdir()
    (d / "config.yaml").write_text(json.dumps({"loss": {"policy_loss": "cispo",
                                                        "cispo": {"anchor": anchor, "eps_low": 1.0, "eps_high": 4.0}},
                                               "run": {"name": name}}))
    (d / "metrics.jsonl").write_text("".join(json.dumps(_rec(i + 1, r, ratio_min=ratio[0], ratio_max=ratio[1],
                                                              clip_frac=clip)) + "\n" for i, r in enumerate(rewards)))
    return d


def test_report_checks_the_demo_claims(tmp_path):
    roll = summarize(_run(tmp_path, "r", "rollout", [0.1] * 5 + [0.3] * 5, ratio=(0.5, 6.0), clip=0.01))
    old = summarize(_run(tmp_path, "o", "old", [0.1] * 10))
    assert abs(roll["gain"] - 3.0) < 1e-9 and all(ok for _, ok in checks(roll))
    assert [ok for _, ok in checks(old)] == [True, None]  # exact 1 / 0 passes; its gain is information
    bad = summarize(_run(tmp_path, "b", "old", [0.1] * 10, ratio=(0.999999, 1.0)))
    assert checks(bad)[0][1] is False
    assert "r " in table([roll, old]) and "3.00x" in table([roll, old])
