"""Every test gets its own default run_dir: the example YAMLs read `run.run_dir: ${RUN_DIR:-runs/<name>}`,
so a test that does not pass run.run_dir (e.g. `train --check`, which refuses a run_dir holding a run)
never reads or writes the checkout's runs/, where the README's commands leave their runs.
`shipped_env` gives a shipped YAML that reads ${HF_MODEL} the tiny model its header makes."""
import itertools
import re
from pathlib import Path

import pytest

_next = itertools.count()


@pytest.fixture(autouse=True)
def _own_default_run_dir(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("RUN_DIR", str(tmp_path_factory.getbasetemp() / "default_run_dirs" / str(next(_next))))


@pytest.fixture(scope="session")
def shipped_env(tmp_path_factory):
    """path -> the environment a shipped YAML runs with: ${HF_MODEL} = the tiny model its header makes
    (`make_tiny_hf --family F`), made once per family in a tmp dir; {} for the others."""
    made = {}

    def env_for(path: Path) -> dict:
        family = re.search(r"make_tiny_hf --family (\w+)", path.read_text())
        if family is None:
            return {}
        if family[1] not in made:
            from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

            made[family[1]] = str(make_tiny_hf(family[1], tmp_path_factory.mktemp("tiny_hf") / family[1]))
        return {"HF_MODEL": made[family[1]]}
    return env_for
