"""A bad config under a 4-rank launch is reported once and exits non-zero, with no traceback per rank; through
the launch scripts it is one line and exit code 2, whether --check finds it or the ranks do."""
import os
import subprocess

from e2e_helpers import DEMO, ROOT, env, torchrun, torchrun_cmd
from megatron_cispo.testing import free_port

MESSAGE = "model.hidden_sise: unknown key"


def test_bad_key_under_torchrun_is_printed_once_and_no_rank_raises():
    proc = torchrun(4, [DEMO, "model.hidden_sise=64"], check=False, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count(MESSAGE) == 1, out[-3000:]
    # torchrun's agent adds its own one-block failure summary; no worker printed a traceback.
    assert "ConfigError" not in out and "megatron_cispo/" not in out.replace(DEMO, "")
    assert "exitcode  : 2" in out


def test_a_lagging_rank_0_still_prints_the_config_error_before_torchrun_stops_the_job(tmp_path):
    """torchrun stops every worker when the first one exits; rank 0 reaching the error 2 s after the
    others (a loaded machine) must still get to say it (train.SPEAK_FIRST_S)."""
    (tmp_path / "lag_rank0.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(2)\n")
    run_env = {**env(), "MEGATRON_CISPO_PLUGINS": "lag_rank0",
               "PYTHONPATH": os.pathsep.join([str(tmp_path), env()["PYTHONPATH"]])}
    proc = subprocess.run(torchrun_cmd(2, [DEMO, "model.hidden_sise=64"], port=free_port()), cwd=ROOT,
                          env=run_env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count(MESSAGE) == 1, out[-3000:]


def test_bad_key_through_launch_script_is_one_line_and_exit_code_2():
    proc = subprocess.run(["bash", "launch/single_node.sh", DEMO, "model.hidden_sise=64"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert (proc.stdout + proc.stderr).count(MESSAGE) == 1
    assert "Traceback" not in proc.stdout + proc.stderr


def test_launch_scripts_are_valid_bash():
    for script in ("common.sh", "single_node.sh", "multi_node.sh", "demo.sh", "slurm.sbatch", "slurm_ray.sbatch"):
        proc = subprocess.run(["bash", "-n", str(ROOT / "launch" / script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"


def _check(*args, extra_env=None):
    import sys

    return subprocess.run([sys.executable, "-m", "megatron_cispo.train", "--check", DEMO, "--world-size", "4",
                           *args], cwd=ROOT, env={**env(), **(extra_env or {})}, capture_output=True, text=True,
                          timeout=120)


def test_unknown_policy_loss_is_a_config_error_listing_known_losses():
    proc = _check("loss.policy_loss=cispoo")
    assert proc.returncode == 2
    assert "loss: LossConfig.policy_loss='cispoo' is not a registered policy loss; known: cispo" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_broken_plugin_module_is_one_clear_line():
    proc = _check(extra_env={"MEGATRON_CISPO_PLUGINS": "no_such_plugin_mod"})
    assert proc.returncode == 2
    assert "MEGATRON_CISPO_PLUGINS: importing plugin module 'no_such_plugin_mod' failed" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_kl_without_a_reference_policy_is_rejected_before_launch():
    proc = _check("loss.kl.coef=0.1")
    assert proc.returncode == 2
    assert "loss.kl.coef: the demo trains without a reference policy, so kl.coef must be 0, got 0.1" in proc.stderr


def _launch(*args, timeout=180):
    return subprocess.run(["bash", "launch/single_node.sh", DEMO, "parallelism.tp=1", *args], cwd=ROOT,
                          env={**env(), "NPROC": "2", "MASTER_PORT": str(free_port())}, capture_output=True,
                          text=True, timeout=timeout)


def test_a_run_dir_holding_a_run_is_refused_by_the_launch_preflight_before_any_rank_starts(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    proc = _launch(f"run.run_dir={tmp_path}")
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2, lines[-30:]
    assert lines == [f"config error in {DEMO}: run.run_dir={tmp_path} already holds a run (metrics.jsonl); set "
                     f"run.resume=true to continue it, run.overwrite=true to move it aside to "
                     f"{tmp_path}/previous_<time>/, or choose another run.run_dir"], lines[-30:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no rank took the lock


def test_a_config_error_raised_on_the_ranks_is_one_line_and_exit_2_through_the_launch_script(tmp_path):
    # ${RANK} differs per rank, so --check passes and the ranks' start-up consistency check refuses it.
    proc = _launch('run.name="r${RANK:-0}"', f"run.run_dir={tmp_path}")
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2, lines[-40:]
    assert len(lines) == 1, lines[-40:]  # no torchrun failure summary, traceback or agent log lines
    assert lines[0].startswith(f"config error in {DEMO}: the resolved config differs across ranks") and \
        "run.name: rank 0: 'r0', rank 1: 'r1'" in lines[0], lines
