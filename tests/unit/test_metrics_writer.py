"""MetricsWriter beyond the basics: the console line shows what is active (corrections' drops,
the mismatch, MoE balance), a warning when the corrections drop everything, and a metrics.jsonl
whose last line a full disk tore never blocks a resume."""
import io
import json
import tempfile

import pytest

from megatron_cispo.runner import metrics as M


def _rec(step, **kw):
    return {"step": step, "reward_mean": 0.5, "policy_version_lag": 1, "loss": 0.1, "clip_frac": 0.01,
            "ratio_min": 0.25, "ratio_max": 4.0, **kw}


def _line(**kw) -> str:
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as d:
        w = M.MetricsWriter(d, label="x", total_steps=1, log_interval=1, tensorboard=False, stream=out)
        w.log(_rec(1, **kw))
        w.close()
    return out.getvalue().strip()


def _writer(tmp_path, total=10, start=0, **kw):
    return M.MetricsWriter(tmp_path, label="x", total_steps=total, log_interval=1, start_step=start,
                           tensorboard=False, stream=io.StringIO(), **kw)


def test_console_line_shows_only_what_the_record_has():
    plain = _line()
    assert "| ratio [0.250, 4.000] |" in plain
    for absent in ("drop", "moe", "mismatch"):
        assert absent not in plain, plain


def test_console_line_shows_each_active_correction_and_the_total_drop():
    line = _line(**{"correction/dropped_token_frac": 0.25, "correction/mis_masked_frac": 0.125,
                    "correction/geo_rs_dropped_token_frac": 0.2, "correction/geo_rs_dropped_frac": 0.5})
    assert "| drop 0.250 (mis 0.125, geo_rs 0.200) |" in line, line
    assert "opsm" not in line and "m2po" not in line
    single = _line(**{"correction/dropped_token_frac": 0.5, "correction/m2po_masked_frac": 0.5})
    assert "| drop 0.500 (m2po) |" in single, single


def test_console_line_shows_the_old_rollout_mismatch_when_measured():
    assert "| mismatch k3 0.00123 |" in _line(**{"mismatch/k3_kl": 0.00123})


def test_console_line_shows_moe_aux_z_loss_and_expert_balance():
    line = _line(**{"moe/aux_loss": 0.0102, "moe/z_loss": 0.000312, "moe/expert_tokens_max": 130.0,
                    "moe/expert_tokens_min": 98.0})
    assert "| moe aux 0.0102 z 0.000312 tokens/expert 98..130 |" in line, line
    no_z = _line(**{"moe/aux_loss": 0.5, "moe/expert_tokens_max": 3.0, "moe/expert_tokens_min": 1.0})
    assert "| moe aux 0.5 tokens/expert 1..3 |" in no_z, no_z


def test_warns_once_when_the_corrections_drop_everything(tmp_path, capsys):
    w = _writer(tmp_path, total=10)
    everything = {"correction/dropped_token_frac": 1.0, "correction/mis_masked_frac": 1.0}
    for step in range(1, M.DROP_ALL_STEPS):
        w.log(_rec(step, **everything))
    assert capsys.readouterr().err == ""  # not yet N steps in a row
    w.log(_rec(M.DROP_ALL_STEPS, **{**everything, "correction/dropped_token_frac": 0.5}))  # the run recovers
    for step in range(M.DROP_ALL_STEPS + 1, 2 * M.DROP_ALL_STEPS + 3):
        w.log(_rec(step, **everything))
    w.close()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert "dropped 100.0% of the trained tokens" in err[0] and "loss.correction.mis" in err[0], err[0]


def test_a_short_run_that_drops_everything_still_warns(tmp_path, capsys):
    w = _writer(tmp_path, total=4, start=3)  # one step left in this run
    w.log(_rec(4, **{"correction/dropped_token_frac": 1.0, "correction/opsm_dropped_token_frac": 1.0}))
    w.close()
    assert "loss.correction.opsm" in capsys.readouterr().err


def test_no_warning_below_the_threshold_or_without_corrections(tmp_path, capsys):
    w = _writer(tmp_path)
    for step in range(1, 9):
        w.log(_rec(step, **({"correction/dropped_token_frac": 0.9} if step % 2 else {})))
    w.close()
    assert capsys.readouterr().err == ""


def _write_steps(path, steps):
    path.write_text("".join(json.dumps(_rec(s)) + "\n" for s in steps))


def test_resume_cuts_a_torn_last_line_with_one_warning(tmp_path, capsys):
    f = tmp_path / M.METRICS_FILE
    _write_steps(f, [1, 2, 3])
    with f.open("a") as h:
        h.write('{"step": 4, "reward_mea')  # ENOSPC in the middle of a write
    _writer(tmp_path, start=3).close()
    assert [r["step"] for r in M.read_metrics(tmp_path)] == [1, 2, 3]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and str(f) in err[0] and "line 4" in err[0], err


def test_read_metrics_names_the_file_and_line_of_a_bad_line_in_the_middle(tmp_path):
    f = tmp_path / M.METRICS_FILE
    _write_steps(f, [1, 2])
    f.write_text(f.read_text() + "{not json\n" + json.dumps(_rec(3)) + "\n")
    with pytest.raises(M.MetricsFileError, match=rf"{f}:3: .*not a JSON record"):
        M.read_metrics(tmp_path)


def test_read_metrics_leaves_out_a_torn_last_line_with_a_warning(tmp_path, capsys):
    f = tmp_path / M.METRICS_FILE
    _write_steps(f, [1, 2])
    f.write_text(f.read_text() + '{"step": 3, "rew')
    assert [r["step"] for r in M.read_metrics(tmp_path)] == [1, 2]
    assert f"{f}:3" in capsys.readouterr().err

