"""Every test gets its own default run_dir: the example YAMLs read `run.run_dir: ${RUN_DIR:-runs/<name>}`,
so a test that does not pass run.run_dir (e.g. `train --check`, which refuses a run_dir holding a run)
never reads or writes the checkout's runs/, where the README's commands leave their runs.
`shipped_env` gives a shipped YAML that reads ${HF_MODEL} the tiny model its header makes, and the
repository files its header's `--check` command sets (MATH_PROMPTS=yaml_configs/data/math_sample.jsonl)."""
import itertools
import re
from pathlib import Path

import pytest

_next = itertools.count()
ROOT = Path(__file__).resolve().parents[1]
# a header's check command: `#   VAR=value ... python -m megatron_cispo.train --check ...`
_CHECK_ENV = re.compile(r"^#\s+((?:[A-Z_]+=\S+\s+)+)python -m megatron_cispo\.train --check", re.M)


@pytest.fixture(autouse=True)
def _own_default_run_dir(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("RUN_DIR", str(tmp_path_factory.getbasetemp() / "default_run_dirs" / str(next(_next))))


@pytest.fixture(scope="session")
def shipped_env(tmp_path_factory):
    """path -> the environment a shipped YAML runs with: ${HF_MODEL} = the tiny model its header makes
    (`make_tiny_hf --family F [--option V ...] DIR`), made once per set of options in a tmp dir; the
    variables its header's --check command sets to files of this repository (absolute); {} for the others."""
    made = {}

    def env_for(path: Path) -> dict:
        text = path.read_text()
        env = {k: str(ROOT / v) for m in _CHECK_ENV.finditer(text) for k, v in (w.split("=", 1) for w in m[1].split())
               if (ROOT / v).exists()}
        header = re.search(r"make_tiny_hf (--family \w+(?: --[\w-]+ \S+)*) \S+", text)
        if header is None:
            return env
        args = header[1].split()
        if header[1] not in made:
            from megatron_cispo.tools.make_tiny_hf import main

            out = tmp_path_factory.mktemp("tiny_hf") / args[1]
            assert main([*args, str(out)]) in (0, None), args
            made[header[1]] = str(out)
        return {**env, "HF_MODEL": made[header[1]]}
    return env_for
