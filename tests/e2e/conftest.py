"""The README's commands, run once per session in README order in a fresh copy of the checkout.

`readme_run` is shared: test_readme_order.py checks that each exits 0 with its own default run_dir and
that the docs' demo tables are what the demo printed; test_demo_anchors.py checks the demo's runs.
`bash launch/demo.sh` runs as written (60 steps per anchor: the table needs them); the other runs
get `run.steps=2` and the TINY overrides.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e_helpers import ROOT, env
from megatron_cispo.testing import free_port
from readme_helpers import CLONE, NOT_RUN, README, readme_commands, shortened


@dataclass
class ReadmeRun:
    clone: Path
    ran: list[tuple[str, subprocess.CompletedProcess]]  # (README command, its result), README order
    skipped: list[str]

    def output(self, prefix: str) -> str:
        return next(p.stdout + p.stderr for c, p in self.ran if c.startswith(prefix))


def _fresh_clone(root: Path) -> Path:
    stamp = ROOT / ".venv" / ".megatron_cispo_installed"
    want = subprocess.run(["sha256sum", str(ROOT / "setup.py")], capture_output=True, text=True).stdout[:16]
    if not stamp.is_file() or stamp.read_text().strip() != want:
        # launch/setup_env.sh inside the copy would reinstall the package from the copy's path
        pytest.fail("./.venv is not installed from the current setup.py: run `bash launch/setup_env.sh` first")
    for name in CLONE:
        (root / name).symlink_to(ROOT / name)
    return root


@pytest.fixture(scope="session")
def readme_run(tmp_path_factory) -> ReadmeRun:
    clone = _fresh_clone(tmp_path_factory.mktemp("clone"))
    run_env = {k: v for k, v in env().items() if k not in ("RUN_DIR", "OUT", "STEPS", "NPROC", "PY")}
    port = str(free_port())
    run_env.update(MASTER_PORT=port, PET_MASTER_PORT=port)  # bare torchrun reads PET_MASTER_PORT
    ran, skipped = [], []
    for cmd in readme_commands(README.read_text()):
        if any(cmd.startswith(prefix) for prefix in NOT_RUN):
            skipped.append(cmd)
            continue
        proc = subprocess.run(shortened(cmd), cwd=clone, env=run_env, capture_output=True, text=True, timeout=900)
        ran.append((cmd, proc))
    return ReadmeRun(clone, ran, skipped)
