"""The commands a doc shows, in its order (test_docs_commands.py, conftest.py), and how the README's run."""
from __future__ import annotations

import re
import shlex

import pytest

from e2e_helpers import ROOT, TINY

README = ROOT / "README.md"
# What a fresh clone has that the commands use (and .venv, set up by tests/run.sh).
CLONE = ("launch", "yaml_configs", "megatron_cispo", "setup.py")
SHORT = ["run.steps=2", *TINY]
NOT_RUN = {  # command prefix: why it is not run here
    "bash tests/run.sh": "the test suite itself",
    "VLLM=1 bash tests/run.sh": "the test suite itself, with vLLM",
    "python -m megatron_cispo.integrations.megatron_lm.run": "needs a Megatron-LM checkout and CUDA "
                                                              "(tests/unit/test_megatron_lm*.py)",
}
_COMMAND = r"(?:[A-Z_]+=\S+\s+)*(?:\.venv/bin/)?(?:python|bash|torchrun|sbatch) "
_BLOCK_OR_INLINE = re.compile(r"^ *```(?P<lang>\w*)\n(?P<block>.*?)^ *```|(?<!`)`(?P<inline>" + _COMMAND + r"[^`]+)`(?!`)",
                              re.S | re.M)


def doc_commands(text: str) -> list[str]:
    """The shell commands in a markdown `text` (fenced blocks, continuations joined, and inline code), in
    the order they appear, without comments or a trailing `&`."""
    out = []
    for m in _BLOCK_OR_INLINE.finditer(text):
        if m["block"] is not None and m["lang"] not in ("", "bash", "sh", "console"):
            continue  # a code block (python, yaml): skipped whole, so nothing in it reads as a command
        lines = re.sub(r"\\\n\s*", " ", m["block"]).splitlines() if m["block"] is not None else [m["inline"]]
        for line in lines:
            line = line.split(" # ")[0].split("   #")[0].strip().rstrip("&").strip()
            if re.match(_COMMAND, line + " "):
                out.append(line)
    return out


# run only where ./.venv has vLLM (CI's first tier); elsewhere it would install vLLM, so it is skipped
NEEDS_VLLM = "bash launch/demo_vllm.sh"
SHORT_VLLM = ["run.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4", "parallelism.micro_batch_size=16",
              "run.log_interval=1", "run.tensorboard=false", "run.checkpoint_interval=0"]


def shortened(cmd: str) -> list[str]:
    """argv for one README command as this test runs it."""
    words = shlex.split(cmd)
    if words[:2] == ["bash", "launch/demo.sh"]:
        return words  # as written: the doc tables are its 60-step numbers
    if words[:2] == ["bash", "launch/demo_vllm.sh"]:
        return [*words, *SHORT_VLLM]
    if "megatron_cispo.train" in words or words[:2] == ["bash", "launch/single_node.sh"]:
        return [*words, *SHORT]
    pytest.fail(f"README command {cmd!r}: tests/e2e/conftest.py does not know how to run it; add a rule")
