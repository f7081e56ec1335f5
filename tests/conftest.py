"""Every test gets its own default run_dir: the example YAMLs read `run.run_dir: ${RUN_DIR:-runs/<name>}`,
so a test that does not pass run.run_dir (e.g. `train --check`, which refuses a run_dir holding a run)
never reads or writes the checkout's runs/, where the README's commands leave their runs."""
import itertools

import pytest

_next = itertools.count()


@pytest.fixture(autouse=True)
def _own_default_run_dir(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("RUN_DIR", str(tmp_path_factory.getbasetemp() / "default_run_dirs" / str(next(_next))))
