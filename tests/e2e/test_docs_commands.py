"""Every command shown in README.md and docs/*.md refers to things that exist, and every YAML
run it shows passes `megatron_cispo.train --check` at the world size it would launch with.

Commands that can run on CPU in seconds run for real (benchmarks in --quick mode); the demo,
torchrun and multi-node commands run in the other e2e tests; GPU/SLURM ones are checked here.
"""
import importlib.util
import re
import shlex
import subprocess
import sys

import pytest

from e2e_helpers import ROOT, env
from megatron_cispo.runner.experiment import load_experiment
from megatron_cispo.train import main
from readme_helpers import doc_commands

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands():
    """(doc, command) for each shell command a doc shows (readme_helpers.doc_commands)."""
    return [(doc.name, cmd) for doc in DOCS for cmd in doc_commands(doc.read_text())]


COMMANDS = _commands()


def _world_size(words: list[str]) -> int:
    env_vars = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
    for flag in ("--world-size", "--nproc-per-node", "--nproc_per_node"):
        if flag in words:
            return int(words[words.index(flag) + 1])
    if "NPROC" in env_vars:
        return int(env_vars["NPROC"])
    if "sbatch" in words:
        return int(words[words.index("--nodes") + 1]) * int(words[words.index("--gpus-per-node") + 1])
    if "NNODES" in env_vars:
        return int(env_vars["NNODES"]) * int(env_vars.get("GPUS_PER_NODE", "4"))
    return 4  # launch/single_node.sh and demo.sh default on CPU


def _nnodes(words: list[str]) -> int:
    """The nodes the command runs on, as the launch scripts hand them to --check (torchrun's --nnodes)."""
    env_vars = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
    for flag in ("--nnodes", "--nodes"):  # train --check's and torchrun's; sbatch's
        if flag in words:
            return int(words[words.index(flag) + 1])
    return int(env_vars.get("NNODES", "1"))


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 15, COMMANDS  # the parser found the documented commands


@pytest.mark.parametrize("doc,cmd", COMMANDS, ids=[f"{d}:{c[:50]}" for d, c in COMMANDS])
def test_documented_command_refers_to_real_things(doc, cmd):
    words = [w for w in shlex.split(cmd) if "<" not in w]
    for i, w in enumerate(words):
        if w == "-m" and i + 1 < len(words):
            assert importlib.util.find_spec(words[i + 1]) is not None, f"{doc}: no module {words[i + 1]}"
        elif re.search(r"\.(py|sh|sbatch|yaml)$", w) and "/" in w and not w.startswith(("path/", "/path")):
            if w.startswith(("train_rl.py", "runs/")):
                continue  # the user's Megatron-LM script; run outputs
            assert (ROOT / w).exists(), f"{doc}: {cmd!r} names {w}, which does not exist"


YAML_RUNS = [(d, c) for d, c in COMMANDS if re.search(r"yaml_configs/[\w.]+\.yaml", c)]


@pytest.mark.parametrize("doc,cmd", YAML_RUNS, ids=[f"{d}:{c[:50]}" for d, c in YAML_RUNS])
def test_documented_yaml_run_passes_check_at_its_world_size(doc, cmd, shipped_env, monkeypatch, capsys):
    """`train --check` in this process (train.main, what `python -m megatron_cispo.train --check` runs): a
    subprocess per documented command cost an interpreter and torch import each (docs/testing.md);
    test_cli_errors.py runs the module as a subprocess."""
    words = shlex.split(cmd)
    config = next(w for w in words if re.match(r"yaml_configs/[\w.]+\.yaml$", w))
    overrides = [w for w in words[words.index(config) + 1:] if re.match(r"^[a-z_]+(\.[a-z_]+)+=", w)]
    world = _world_size(words)
    monkeypatch.chdir(ROOT)
    for key, value in shipped_env(ROOT / config).items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    code = main(["--check", config, *overrides, "--world-size", str(world), "--nnodes", str(_nnodes(words))])
    out, err = capsys.readouterr()
    if importlib.util.find_spec("vllm") is None and load_experiment(config, overrides).rollout.engine == "vllm":
        # this environment has no vLLM (the second megatron-core tier): --check says so, in one line
        assert code == 2 and "needs vLLM" in err.strip().splitlines()[-1], err
        return
    assert code == 0, f"{doc}: {cmd!r}\n{err}"
    assert f"# ok: {world} processes" in out


@pytest.mark.parametrize("script", ["benchmarks/bench_head.py", "benchmarks/bench_logprobs.py",
                                    "benchmarks/bench_packing.py", "benchmarks/bench_policy_step.py",
                                    "benchmarks/bench_replay.py"])
def test_documented_benchmark_runs_in_quick_mode(script):
    proc = subprocess.run([sys.executable, script, "--quick"], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| TP |" in proc.stdout or "| ratio |" in proc.stdout, proc.stdout[-2000:]
