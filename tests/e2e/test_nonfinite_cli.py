"""The CLI under a non-finite fault: it stops after run.max_consecutive_skips skipped steps with
exit code 3 and one line from rank 0, metrics.jsonl stays strict JSON, and an infinite learning
rate is refused by --check."""
import json
import subprocess
import sys

from e2e_helpers import DEMO, ROOT, TINY, env, ranks

from megatron_cispo.train import EXIT_CONFIG, EXIT_NONFINITE

STOP = "optimizer steps in a row were skipped because of non-finite"


def _strict(line: str) -> dict:
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name} in metrics.jsonl")
    return json.loads(line, parse_constant=refuse)


def test_nonfinite_model_stops_after_max_consecutive_skips_with_exit_3(tmp_path):
    # init_std=1e30 overflows the first forward: every step is non-finite, from step 1 on
    proc = ranks(2, [DEMO, *TINY, "run.steps=6", f"run.run_dir={tmp_path}", "model.init_std=1e30",
                     "run.max_consecutive_skips=2"], check=False, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_NONFINITE, out[-3000:]
    assert out.count(STOP) == 1, out[-3000:]
    stop = next(line for line in out.splitlines() if STOP in line)
    expected = ("[cispo:rollout] stopped at step 2: 2 optimizer steps in a row were skipped because of "
                "non-finite logits (run.max_consecutive_skips=2); the weights are the initial ones")
    assert stop.startswith(expected), stop
    # no rank printed a traceback
    assert "NonFiniteStop" not in out and "megatron_cispo/" not in out.replace(DEMO, "")
    recs = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["step/skipped_nonfinite"] == 1.0 and r["step/optimizer_steps"] == 0.0
        assert r["step/grad_norm"] is None and "step/grad_norm" in r["nonfinite"]
        assert all(r[k] is None for k in r["nonfinite"])


def test_infinite_learning_rate_fails_check_with_exit_2():
    proc = subprocess.run([sys.executable, "-m", "megatron_cispo.train", "--check", DEMO, "--world-size", "2",
                           "optimizer.lr=.inf"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    assert "optimizer: optimizer.lr must be finite, got inf" in proc.stderr
    assert "Traceback" not in proc.stderr
