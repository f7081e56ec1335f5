"""The README's commands, run once per session in README order in a fresh copy of the checkout.

`readme_run` is shared: test_readme_order.py checks that each exits 0 with its own default run_dir and
that the docs' demo tables are what the demo printed; test_demo_anchors.py checks the demo's runs.
`bash launch/demo.sh` runs as written (60 steps per anchor: the table needs them); the other runs
get `run.steps=2` and the TINY overrides. They run ./.venv whatever python runs pytest, so on another
tier (`bash tests/run.sh --mcore 0.19.2`) the fixture skips: it would repeat the first tier's run.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e_helpers import ROOT, env
from megatron_cispo.testing import free_port
from readme_helpers import CLONE, NEEDS_VLLM, NOT_RUN, README, doc_commands, shortened

STAMP = ".megatron_cispo_installed"  # launch/setup_env.sh's record of the setup.py it installed


@dataclass
class ReadmeRun:
    clone: Path
    ran: list[tuple[str, subprocess.CompletedProcess]]  # (README command, its result), README order
    skipped: list[str]

    def output(self, prefix: str) -> str:
        return next(p.stdout + p.stderr for c, p in self.ran if c.startswith(prefix))


def _venv_has_vllm() -> bool:
    """Whether ./.venv (the README commands' python) has vLLM; without it demo_vllm.sh would install it."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", probe]).returncode == 0


def _fresh_clone(root: Path) -> Path:
    """`root` with the checkout's files (symlinks) and a .venv that launch/setup_env.sh takes as installed:
    the checkout's venv, entry by entry, with its own install stamp, so nothing is reinstalled from here."""
    for name in CLONE:
        (root / name).symlink_to(ROOT / name)
    venv = root / ".venv"
    venv.mkdir()
    for item in (ROOT / ".venv").iterdir():
        if item.name != STAMP:
            (venv / item.name).symlink_to(item)
    (venv / STAMP).write_text((ROOT / ".venv" / STAMP).read_text())  # as installed: setup_env.sh's own record
    return root


@pytest.fixture(scope="session")
def readme_run(tmp_path_factory) -> ReadmeRun:
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"the README's commands run ./.venv (megatron-core's default tier), not this python "
                    f"({sys.prefix}): their answer is the first tier's")
    clone = _fresh_clone(tmp_path_factory.mktemp("clone"))
    run_env = {k: v for k, v in env().items() if k not in ("RUN_DIR", "OUT", "STEPS", "NPROC", "PY")}
    port = str(free_port())
    run_env.update(MASTER_PORT=port, PET_MASTER_PORT=port)  # bare torchrun reads PET_MASTER_PORT
    run_env["PRETRAIN_STEPS"] = "20"  # demo_vllm.sh's warm start, shortened like its steps (SHORT_VLLM)
    ran, skipped = [], []
    for cmd in doc_commands(README.read_text()):
        if any(cmd.startswith(prefix) for prefix in NOT_RUN) or (cmd.startswith(NEEDS_VLLM) and not _venv_has_vllm()):
            skipped.append(cmd)
            continue
        proc = subprocess.run(shortened(cmd), cwd=clone, env=run_env, capture_output=True, text=True, timeout=900)
        ran.append((cmd, proc))
    return ReadmeRun(clone, ran, skipped)
