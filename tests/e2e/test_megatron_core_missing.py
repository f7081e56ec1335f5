"""A megatron-core that lacks a name the package uses is refused in one line, by rank 0 only, before
any process group exists: through the launch script, exit 2 and that line alone. The lack is made real for the launched
processes by a sitecustomize that points megatron_cispo.mcore at a names list with one name no
megatron-core has: the same code path a release that dropped a function takes."""
import subprocess
import textwrap

from e2e_helpers import DEMO, ROOT, TINY, env


def test_a_megatron_core_missing_a_needed_name_is_one_line_from_rank_0_and_exit_2(tmp_path, monkeypatch):
    names = tmp_path / "names.txt"
    names.write_text("megatron.core.parallel_state.get_data_parallel_group required:library step/forward.py\n"
                     "megatron.core.parallel_state.dropped_in_a_future_release required:runner runner/model.py\n")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import pathlib
        import megatron_cispo.mcore as mcore
        mcore.NAMES_FILE = pathlib.Path({str(names)!r})
    """))
    monkeypatch.setenv("PYTHONPATH", str(hook))
    proc = subprocess.run(["bash", "launch/single_node.sh", DEMO, *TINY, f"run.run_dir={tmp_path / 'run'}"],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    line = "megatron.core.parallel_state.dropped_in_a_future_release, which megatron_cispo uses (tested: 0.16.1, 0.19.2)"
    assert out.count(line) == 1, out[-3000:]
    assert "Traceback" not in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
