"""run_dir/config_history/ (runner/loop.py _record_config): each start's config is kept under the next
number; a file there that this code did not write never stops a run."""
from megatron_cispo.runner.loop import _record_config


def test_each_start_gets_the_next_number_and_stray_names_are_ignored(tmp_path):
    _record_config(tmp_path, "a: 1\n", 0)
    history = tmp_path / "config_history"
    for stray in ("start_x_at_step_000003.yaml", "start_.yaml", "notes.txt", "start_007_copy.yaml"):
        (history / stray).write_text("stray\n")
    _record_config(tmp_path, "a: 2\n", 5)
    assert (tmp_path / "config.yaml").read_text() == "a: 2\n"
    assert (history / "start_001_at_step_000000.yaml").read_text() == "a: 1\n"
    assert (history / "start_002_at_step_000005.yaml").read_text() == "a: 2\n"
