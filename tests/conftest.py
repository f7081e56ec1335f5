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
    (`make_tiny_hf --family F [--option V ...] DIR`), made once per set of options in a tmp dir; {} for
    the others."""
    made = {}

    def env_for(path: Path) -> dict:
        header = re.search(r"make_tiny_hf (--family \w+(?: --[\w-]+ \S+)*) \S+", path.read_text())
        if header is None:
            return {}
        args = header[1].split()
        if header[1] not in made:
            from megatron_cispo.tools.make_tiny_hf import main

            out = tmp_path_factory.mktemp("tiny_hf") / args[1]
            assert main([*args, str(out)]) in (0, None), args
            made[header[1]] = str(out)
        return {"HF_MODEL": made[header[1]]}
    return env_for
