"""The README's commands, parsed in README order, and how the e2e tests run each (tests/e2e/conftest.py)."""
from __future__ import annotations

import re
import shlex

import pytest

from e2e_helpers import ROOT, TINY

README = ROOT / "README.md"
# What a fresh clone has that the commands use; .venv is the one tests/run.sh set up.
CLONE = ("launch", "yaml_configs", "megatron_cispo", "setup.py", ".venv")
SHORT = ["run.steps=2", *TINY]
NOT_RUN = {  # command prefix: why it is not run here
    "bash tests/run.sh": "the test suite itself",
    "python -m megatron_cispo.integrations.megatron_lm.run": "needs a Megatron-LM checkout and CUDA "
                                                              "(tests/unit/test_megatron_lm*.py)",
}
_COMMAND = r"(?:[A-Z_]+=\S+\s+)*(?:\.venv/bin/)?(?:python|bash|torchrun|sbatch) "
_BLOCK_OR_INLINE = re.compile(r"```(?:bash|sh|console)?\n(?P<block>.*?)```|(?<!`)`(?P<inline>" + _COMMAND + r"[^`]+)`(?!`)",
                              re.S)


def readme_commands(text: str) -> list[str]:
    """The shell commands in `text` (fenced blocks and inline code), in the order they appear."""
    out = []
    for m in _BLOCK_OR_INLINE.finditer(text):
        lines = m["block"].splitlines() if m["block"] is not None else [m["inline"]]
        for line in lines:
            line = line.split(" # ")[0].strip()
            if re.match(_COMMAND, line + " "):
                out.append(line)
    return out


def shortened(cmd: str) -> list[str]:
    """argv for one README command as this test runs it."""
    words = shlex.split(cmd)
    if words[:2] == ["bash", "launch/demo.sh"]:
        return words  # as written: the doc tables are its 60-step numbers
    if "megatron_cispo.train" in words or words[:2] == ["bash", "launch/single_node.sh"]:
        return [*words, *SHORT]
    pytest.fail(f"README command {cmd!r}: tests/e2e/conftest.py does not know how to run it; add a rule")
