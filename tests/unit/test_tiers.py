"""tests/tiers.py: which test files reach megatron-core (tier 2 runs them). Each rule on a small tree
written here, then the checkout's own split, and the block .ci/run puts on the files called free."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiers import MCORE, ROOT, Graph

MC = "megatron" + ".core"  # spelled apart so that this file's own strings import nothing


def _tree(tmp_path: Path, files: dict[str, str]) -> Graph:
    base = {"megatron_cispo/__init__.py": "from .light import x\n_EXPORTS = {'Heavy': 'megatron_cispo.heavy'}\n",
            "megatron_cispo/light.py": "x = 1\n",
            "megatron_cispo/heavy.py": f"import {MC}\n",
            "megatron_cispo/train.py": "def main():\n    from .heavy import thing\n"}
    for name, text in {**base, **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    return Graph(tmp_path)


def _reaches(g: Graph, name: str) -> bool:
    return g.chain(g.root / name) is not None


@pytest.mark.parametrize("body, reaches", [
    ("import megatron_cispo\n", False),  # the package's own imports only
    ("from megatron_cispo import Heavy\n", True),  # the lazy export table, to the module defining Heavy
    ("from megatron_cispo.light import x\n", False),
    ("def test():\n    from megatron_cispo import train\n", True),  # inside a function; and train's own
    ("CMD = ['python', '-m', 'megatron_cispo.train']\n", True),  # a launched module
    ("import subprocess\nsubprocess.run(['python', '-c', 'from megatron_cispo.heavy import h'])\n", True),
    (f'"""Tests that {MC} is never imported."""\n', False),  # a docstring is prose
    (f"import sys\nassert sys.modules.get('{MC}.parallel_state') is None\n", False),  # a lookup
    (f"import importlib.util\nassert importlib.util.find_spec('megatron')\n", False),
    (f"MESSAGE = 'needs {MC}'\n", False),  # a message, not an argument or a list element
    ("SCRIPT = 'launch/run.sh'\n", True),  # a script the test runs, which runs the trainer
    ("from helper_mod import f\n", True),  # a test helper, imported by bare name
], ids=["package", "lazy_export", "light_module", "in_function", "dash_m", "python_c", "docstring", "lookup",
        "find_spec", "message", "script", "helper"])
def test_each_import_rule(tmp_path, body, reaches):
    g = _tree(tmp_path, {"tests/unit/test_x.py": body, "launch/run.sh": "torchrun -m megatron_cispo.train \"$@\"\n",
                         "tests/unit/helper_mod.py": "import megatron_cispo.heavy\n"})
    assert _reaches(g, "tests/unit/test_x.py") is reaches, g.chain(g.root / "tests/unit/test_x.py")


def test_a_conftest_above_the_file_counts_and_why_names_the_chain(tmp_path):
    g = _tree(tmp_path, {"tests/e2e/conftest.py": "def fixture():\n    import megatron_cispo.train\n",
                         "tests/e2e/test_y.py": "def test():\n    pass\n", "tests/unit/test_z.py": "pass\n"})
    assert g.chain(g.root / "tests/e2e/test_y.py") == [
        "tests/e2e/test_y.py", "tests/e2e/conftest.py", "megatron_cispo.train", "megatron_cispo.heavy", MCORE]
    assert g.split() == (["tests/e2e/test_y.py"], ["tests/unit/test_z.py"])


def test_the_checkouts_split_keeps_every_layout_test_on_tier_2():
    reach, free = Graph().split()
    every = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    assert sorted(reach + free) == every and not set(reach) & set(free)
    assert all(f in reach for f in every if f.startswith(("tests/distributed/", "tests/e2e/")))
    assert "tests/unit/test_config.py" in free and "tests/unit/test_policy_step_unit.py" in reach
    assert "tests/tiers.py --free" in (ROOT / ".ci" / "run").read_text()  # .ci/run takes its split from here


def test_the_block_makes_megatron_unimportable_and_leaves_the_package_importable():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "tiers_block"), str(ROOT)])}
    blocked = subprocess.run([sys.executable, "-c", "import " + MC], env=env, capture_output=True, text=True)
    assert blocked.returncode == 1 and "megatron-core is blocked here" in blocked.stderr, blocked.stderr[-2000:]
    ok = subprocess.run([sys.executable, "-c", "import megatron_cispo, megatron_cispo.config"], env=env,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr[-2000:]
