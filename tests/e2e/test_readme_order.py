"""The README's commands work one after another in a fresh clone, and the demo tables in README.md and
docs/launch.md are what `bash launch/demo.sh` prints (every column but the wall time).

Both read the session's `readme_run` (tests/e2e/conftest.py): one demo run serves every check.
"""
import re
import shlex
import warnings

import torch

from e2e_helpers import ROOT
from readme_helpers import README, SHORT, doc_commands

ROW = re.compile(r"^(cispo:\S+)((?:\s+\S+){9})\s+\d+s$", re.M)  # a table row; the last column is the time
# docs/launch.md names the torch build and CPU capability the table was measured with
MEASURED = re.compile(r"measured with\s+torch (\S+) on CPU capability (\w+)")
STEPS, LAG, CLIP, RMIN, RMAX = 0, 7, 4, 5, 6  # column indices (after the run label, without the time)


def _rows(text: str) -> dict[str, list[str]]:
    """{run label: every column but the time} of each demo table row in `text`."""
    return {m[1]: m[2].split() for m in ROW.finditer(text)}


def test_the_readme_lists_the_commands_this_test_runs():
    commands = doc_commands(README.read_text())
    assert commands[0] == "bash launch/demo.sh", commands  # the main job comes first
    assert any("megatron_cispo.train" in c for c in commands) and any("single_node.sh" in c for c in commands)


def test_doc_commands_run_in_readme_order_each_into_its_own_default_run_dir(readme_run):
    assert len(readme_run.ran) >= 3, (readme_run.ran, readme_run.skipped)
    for cmd, proc in readme_run.ran:
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{cmd!r} (run after the ones before it) exited {proc.returncode}:\n{out[-4000:]}"
    runs = readme_run.clone / "runs"
    assert (runs / "demo" / "comparison.png").stat().st_size > 0
    for anchor in ("rollout", "old"):
        assert (runs / "demo" / anchor / "metrics.jsonl").is_file()
    if any(cmd.startswith("bash launch/demo_vllm.sh") for cmd, _ in readme_run.ran):
        assert (runs / "demo_vllm" / "comparison.png").stat().st_size > 0
        for anchor in ("rollout", "old"):
            lines = (runs / "demo_vllm" / anchor / "metrics.jsonl").read_text().splitlines()
            assert len(lines) == 3 and '"eval/accuracy"' in lines[0] and '"eval/accuracy"' in lines[2]  # step 0, 1, 2
    for cmd, _ in readme_run.ran[1:]:  # each YAML run wrote into runs/<its yaml's name>/
        yaml = next((w for w in shlex.split(cmd) if w.startswith("yaml_configs/")), None)
        if yaml is None:
            continue  # a launch script with its own run_dir (demo_vllm.sh: runs/demo_vllm/)
        run_dir = runs / yaml.removeprefix("yaml_configs/").removesuffix(".yaml")
        steps = int(SHORT[0].split("=")[1])
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == steps, (cmd, run_dir)


def test_demo_tables_in_the_docs_are_what_the_demo_prints(readme_run):
    printed = _rows(readme_run.output("bash launch/demo.sh"))
    assert set(printed) == {"cispo:rollout", "cispo:old"}, readme_run.output("bash launch/demo.sh")[-3000:]
    measured = MEASURED.search(" ".join((ROOT / "docs" / "launch.md").read_text().split()))
    assert measured, "docs/launch.md must say which torch build and CPU capability the table was measured with"
    here = (torch.__version__, torch.backends.cpu.get_cpu_capability())
    same_machine = here == measured.groups()
    if not same_machine:  # float summation order differs: the sampled tokens drift after a few steps
        warnings.warn(f"demo table measured with torch {measured[1]} / {measured[2]}, this is {here[0]} / {here[1]}: "
                      "comparing only run, steps, lag and the old anchor's exact clip frac and ratio")
    for doc in (README, ROOT / "docs" / "launch.md"):
        documented = _rows(doc.read_text())
        if same_machine:
            assert documented == printed, (f"{doc.name}'s demo table differs from what the demo printed "
                                           f"(every column but time; docs/launch.md says what changes them)")
            continue
        assert set(documented) == set(printed), (doc.name, documented, printed)
        for run, cols in printed.items():
            exact = (STEPS, LAG) + ((CLIP, RMIN, RMAX) if run == "cispo:old" else ())
            assert [cols[i] for i in exact] == [documented[run][i] for i in exact], (doc.name, run, cols)
