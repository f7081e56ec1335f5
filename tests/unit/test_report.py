"""`python -m megatron_cispo.demo.report`: any run gets its table and its own figure; the demo's
checks run only for the demo's anchor pair; the figure's legend explains its lines."""
import json

import pytest

from megatron_cispo.demo import report


def _run(tmp_path, name, anchor, rewards, *, eps_low=1.0, lr=3e-3, ratio=(1.0, 1.0), clip=0.0, extra=""):
    d = tmp_path / name
    d.mkdir(parents=True)
    cfg = {"loss": {"policy_loss": "cispo", "cispo": {"anchor": anchor, "eps_low": eps_low, "eps_high": 4.0}},
           "optimizer": {"lr": lr}, "run": {"name": name, "run_dir": str(d)}}
    (d / "config.yaml").write_text(json.dumps(cfg))
    recs = [{"step": i + 1, "reward_mean": r, "policy_version_lag": 2, "loss": 0.1, "clip_frac": clip,
             "clip_frac_low": 0.0, "clip_frac_high": clip, "ratio_min": ratio[0], "ratio_max": ratio[1],
             "ratio_mean": 1.0} for i, r in enumerate(rewards)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + extra)
    return d


def _demo(tmp_path, gain=3.0):
    roll = _run(tmp_path / "demo", "rollout", "rollout", [0.1] * 5 + [0.1 * gain] * 5, ratio=(0.5, 6.0), clip=0.01)
    old = _run(tmp_path / "demo", "old", "old", [0.1] * 10)
    return roll, old


def test_one_run_gets_its_table_and_its_own_figure_and_no_demo_checks(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = _run(tmp_path / "runs", "mine", "rollout", [0.3] * 10)  # gain 1x: the demo's check would FAIL
    assert report.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "mine" in out and "[FAIL]" not in out and "[PASS]" not in out, out
    assert f"figure: wrote {run / 'metrics.png'}" in out
    assert (run / "metrics.png").stat().st_size > 0 and not (tmp_path / "runs" / "comparison.png").exists()


def test_the_demo_pair_gets_its_checks_and_the_demo_sh_invocation_works(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    roll, old = _demo(tmp_path)
    png = tmp_path / "demo" / "comparison.png"
    assert report.is_demo_pair([roll, old])
    assert report.main([str(roll), str(old), "--png", str(png), "--strict"]) == 0  # launch/demo.sh's call
    out = capsys.readouterr().out
    assert "[PASS] rollout: reward last10% / first10% = 3.00 >= 2.0" in out and "[PASS] old: old anchor" in out
    assert png.stat().st_size > 0
    roll_flat, _ = _demo(tmp_path / "flat", gain=1.0)
    assert report.main([str(roll_flat), str(old), "--png", str(png), "--strict"]) == 1
    assert "[FAIL] rollout" in capsys.readouterr().out
    assert report.main([str(roll), str(old)]) == 0  # without --png: comparison.png in the common parent
    assert f"figure: wrote {tmp_path / 'demo' / 'comparison.png'}" in capsys.readouterr().out


def test_other_pairs_get_no_checks_and_strict_refuses_them(tmp_path, capsys):
    a = _run(tmp_path, "a", "rollout", [0.1] * 10)
    b = _run(tmp_path, "b", "old", [0.1] * 10, lr=1e-3)  # another experiment, not only the anchor
    c = _run(tmp_path, "c", "rollout", [0.1] * 10)
    assert not report.is_demo_pair([a, b]) and not report.is_demo_pair([a, c])
    assert report.main([str(a), str(b), "--png", str(tmp_path / "x.png")]) == 0
    out = capsys.readouterr().out
    assert "a " in out and "b " in out and not any(tag in out for tag in ("[PASS]", "[FAIL]", "[info]")), out
    assert report.main([str(a), str(b), "--strict"]) == 2
    assert "not one" in capsys.readouterr().err


def test_a_bad_metrics_line_is_one_line_naming_the_file(tmp_path, capsys):
    run = _run(tmp_path, "r", "rollout", [0.1] * 3)
    (run / "metrics.jsonl").write_text("{oops\n" + (run / "metrics.jsonl").read_text())
    assert report.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run / 'metrics.jsonl'}:1:" in err, err
    assert report.main([str(tmp_path / "nothing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_figure_legend_names_the_clamp_lines_and_the_zero_floor_curve(tmp_path):
    pytest.importorskip("matplotlib")
    floor0 = _run(tmp_path, "f0", "rollout", [0.1] * 4)  # eps_low = 1: floor 0
    floor08 = _run(tmp_path, "f08", "rollout", [0.1] * 4, eps_low=0.2)
    fig = report.figure([floor0, floor08])
    axes = fig.get_axes()  # row-major: 3 rows x 2 columns
    clip0, clip08, ratio0, ratio08 = axes[2], axes[3], axes[4], axes[5]
    assert _legend(clip0) == ["below the floor: none (floor 0)", "above the cap 5"]
    assert [line.get_label() for line in clip0.get_lines() if line.get_xdata().size] == ["above the cap 5"]
    assert _legend(clip08) == ["below the floor 0.8", "above the cap 5"]
    assert "clamp cap 5" in _legend(ratio0) and not any("floor" in t for t in _legend(ratio0))
    assert {"clamp cap 5", "clamp floor 0.8"} <= set(_legend(ratio08))
    dashed = [line for line in ratio08.get_lines() if line.get_linestyle() == "--"]
    assert sorted(line.get_ydata()[0] for line in dashed) == [0.8, 5.0]


def test_the_comparison_of_unrelated_runs_goes_into_the_first_runs_folder_not_the_root(tmp_path):
    from megatron_cispo.demo.report import default_png

    (tmp_path / "a" / "x").mkdir(parents=True)
    assert default_png([tmp_path / "a" / "x", tmp_path / "a" / "y"]) == tmp_path / "a" / "comparison.png"
    assert default_png([tmp_path / "x", "/"]) == tmp_path / "x" / "comparison.png"


def test_a_prompt_file_pair_shows_its_gain_as_information_and_the_k3_column(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    roll, old = _demo(tmp_path, gain=0.5)  # a reward that fell: the synthetic demo's check would FAIL
    for d in (roll, old):
        cfg = json.loads((d / "config.yaml").read_text())
        (d / "config.yaml").write_text(json.dumps({**cfg, "data": {"prompts": "/p/add.jsonl"}}))
    with open(old / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 11, "reward_mean": 0.1, "mismatch/k3_kl": 0.25, "ratio_min": 1.0,
                            "ratio_max": 1.0, "clip_frac": 0.0}) + "\n")
    assert report.main([str(roll), str(old), "--png", str(tmp_path / "c.png"), "--strict"]) == 0
    out = capsys.readouterr().out
    assert "[info] rollout: reward last10% / first10% = 0.50" in out and "[FAIL]" not in out, out
    assert "[PASS] rollout: rollout anchor: clip fraction > 0" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("rollout", "old"))}
    assert rows["old"][-2] == "2.50e-01" and rows["rollout"][-2] == "-", rows


def _evaluated(tmp_path, name, anchor, seed, accuracies):
    """A run with held-out accuracy at steps 0, 5, 10 (step 0: the evaluation before training)."""
    d = _run(tmp_path, name, anchor, [0.2] * 10)
    cfg = json.loads((d / "config.yaml").read_text())
    cfg["run"]["seed"] = seed
    (d / "config.yaml").write_text(json.dumps(cfg))
    recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        if r["step"] in (5, 10):
            r["eval/accuracy"] = accuracies[r["step"] // 5]
    recs.insert(0, {"step": 0, "eval/accuracy": accuracies[0], "eval/version": 0.0})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def test_held_out_accuracy_reaches_the_table_the_figure_and_the_seeds_summary(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    runs = [_evaluated(tmp_path / "s1", "r1", "rollout", 1, [0.4, 0.6, 0.9]),
            _evaluated(tmp_path / "s2", "r2", "rollout", 2, [0.4, 0.5, 0.7]),
            _evaluated(tmp_path / "s1", "o1", "old", 1, [0.4, 0.3, 0.5])]
    s = report.summarize(runs[0])
    assert s["steps"] == 10 and (s["eval_first"], s["eval_last"]) == (0.4, 0.9)  # step 0 is not a step
    assert report.main([str(runs[0]), str(runs[2])]) == 0
    out = capsys.readouterr().out
    assert "eval first" in out and "0.900" in out
    fig = report.figure([runs[0]])
    assert fig.axes[3].get_ylabel() == "held-out accuracy" and list(fig.axes[3].lines[0].get_ydata()) == [0.4, 0.6, 0.9]
    assert report.main(["--seeds", *map(str, runs), "--png", str(tmp_path / "seeds.png")]) == 0
    out = capsys.readouterr().out
    assert "rollout  gain over 2 seeds: mean +40.0, min +30.0, max +50.0 points" in out, out
    assert "old      gain over 1 seeds: mean +10.0" in out and (tmp_path / "seeds.png").stat().st_size > 0
    plain = _run(tmp_path, "plain", "rollout", [0.2] * 3)
    assert report.main(["--seeds", str(plain)]) == 2 and "every run needs data.eval_prompts" in capsys.readouterr().err


def test_the_evaluation_before_training_has_its_own_progress_line(tmp_path):
    import io

    from megatron_cispo.runner.metrics import MetricsWriter

    out = io.StringIO()
    w = MetricsWriter(tmp_path, label="x", total_steps=4, log_interval=10, tensorboard=False, stream=out)
    w.log({"step": 0, "eval/accuracy": 0.43, "eval/pass@4": 0.6})
    w.log({"step": 2, "reward_mean": 0.1, "policy_version_lag": 1, "eval/accuracy": 0.5})  # an eval step prints
    w.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[x] before step 1 | eval acc 0.430 pass@4 0.600", lines
    assert len(lines) == 2 and "eval acc 0.500" in lines[1]
