"""`train --check` (and so the launch scripts' preflight) refuses a run_dir that a fresh run would refuse at
start-up, with the same one line, and touches nothing: no lock, no directory, nothing moved."""
import pytest

from megatron_cispo.config import ConfigError
from megatron_cispo.runner.rundir import LOCK, check_run_dir, claim_run_dir
from megatron_cispo.train import EXIT_CONFIG, main

CONFIG = "yaml_configs/demo_cpu.yaml"


def _check(run_dir, *overrides):
    return main(["--check", CONFIG, "--world-size", "4", f"run.run_dir={run_dir}", *overrides])


def test_check_refuses_a_run_dir_holding_a_run_with_the_line_a_fresh_run_gives(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "checkpoints").mkdir()
    assert _check(tmp_path) == EXIT_CONFIG
    err = capsys.readouterr().err
    with pytest.raises(ConfigError) as refused:  # what rank 0 raises at start-up
        claim_run_dir(tmp_path, resume=False, overwrite=False)
    assert err == f"config error in {CONFIG}: {refused.value}\n"
    assert "already holds a run (checkpoints, metrics.jsonl); set run.resume=true" in err


@pytest.mark.parametrize("overrides", [["run.resume=true"], ["run.overwrite=true"],
                                       ["run.resume=true", "run.overwrite=true"]])
def test_check_accepts_what_a_run_would_accept_and_changes_nothing(tmp_path, capsys, overrides):
    # resume=true without a checkpoint starts fresh (the earlier files are moved aside at start-up)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert _check(tmp_path, *overrides) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no .lock, nothing moved
    assert "# ok: 4 processes" in capsys.readouterr().out


def test_check_of_a_new_or_lock_only_run_dir_creates_nothing(tmp_path):
    assert _check(tmp_path / "new") == 0
    assert not (tmp_path / "new").exists()
    (tmp_path / LOCK).write_text("pid 1 on host h\n")  # left by an earlier job: not a run
    assert check_run_dir(tmp_path, resume=False, overwrite=False) == []
