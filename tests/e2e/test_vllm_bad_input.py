"""data.prompts / data.reward / rollout.engine=vllm: bad input is one line and exit 2, nothing written.

`train --check` reads the prompt file (every row tokenized), imports the reward, then looks for vLLM (and,
with rollout.placement: ray, for Ray and a cluster at rollout.ray_address) and checks the weight stream's
bucket (rollout.sync_bucket_mb against the widest row), so the launch scripts refuse them before any rank
starts; a run does the same before run_dir is claimed, said once by rank 0, and an earlier run's files
stay where they were.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_helpers import ROOT, ranks
from megatron_cispo.train import EXIT_CONFIG, main

YAML = str(ROOT / "yaml_configs" / "vllm_qwen2_tiny.yaml")
OTHER_TIER = ROOT / ".venv-mcore-0.19.2" / "bin" / "python"  # a python without vLLM, when this one has it
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    return make_tiny_hf("qwen2", tmp_path_factory.mktemp("vllm_bad") / "qwen2", vocab=16, heads=2, kv_heads=2)


def _check(capsys, model, *overrides) -> str:
    code = main([YAML, "--check", "--world-size", "2", f"model.hf_path={model}", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_CONFIG, err
    assert len(err.splitlines()) == 1, err
    return err


def _jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prompt_file_and_reward_problems_are_one_line_each(capsys, model, tmp_path):
    task = ROOT / "yaml_configs" / "data" / "add2"
    trained = json.loads((task / "train.jsonl").read_text().splitlines()[5])
    held = json.loads((task / "eval.jsonl").read_text().splitlines()[0])  # never trained on: passes
    reward_file = tmp_path / "bad_reward.py"
    reward_file.write_text("def score(record, completion):\n    return 1.0\n")
    cases = [
        ([f"data.prompts={tmp_path}/nope.jsonl"], f"data.prompts={tmp_path}/nope.jsonl: no such file"),
        ([f"data.prompts={_jsonl(tmp_path / 'q.jsonl', [{'question': '<bos>1+2<sep>'}])}"],
         "no field 'prompt' (data.prompt_key); the fields are question"),
        (["data.reward=no_such_module:f"], "no_such_module"),
        ([f"data.reward={reward_file}:nope"], "nope"),
        (["data.split=test"], "no split 'test' (data.split)"),
        (["rollout.sync_bucket_mb=0"], "rollout.sync_bucket_mb must be finite and > 0, got 0"),
        (["parallelism.max_tokens_per_microbatch=8"],
         "parallelism.max_tokens_per_microbatch=8 is smaller than the longest row ("),
        (["rollout.sync=nccl"], "rollout.sync: expected 'stream' | 'disk', got str 'nccl'"),
        (["rollout.mode=async", "rollout.sync=disk"], "rollout.mode='async' pushes weights between generations"),
        ([f"data.eval_prompts={tmp_path}/nope.jsonl"], f"data.eval_prompts={tmp_path}/nope.jsonl: no such file"),
        ([f"data.eval_prompts={_jsonl(tmp_path / 'empty.jsonl', [])}"], "empty.jsonl: the file is empty"),
        ([f"data.eval_prompts={_jsonl(tmp_path / 'seen.jsonl', [held, trained])}"],
         f"row 1 ({trained['prompt']!r}) is also in data.prompts: held-out prompts must never be trained on"),
    ]
    cases += [  # rollout.vllm: keys megatron_cispo sets, one engine process, the trainer's row length
        (["rollout.vllm.dtype=bfloat16"], "rollout.vllm.dtype is set by megatron_cispo (from rollout.precision"),
        (["rollout.vllm.logprobs_mode=raw_logprobs"], "rollout.vllm.logprobs_mode is set by megatron_cispo"),
        (["rollout.vllm.tensor_parallel_size=2"], "rollout.vllm.tensor_parallel_size=2: the engine is one process"),
        (["rollout.vllm.max_model_len=129"], "rollout.vllm.max_model_len=129 exceeds model.seq_length=128"),
        (["rollout.vllm.max_model_len=5"], "rollout.max_new_tokens=5 leaves no room for a prompt in "
                                           "rollout.vllm.max_model_len=5"),
        (["rollout.engine=hf", "data.prompts=null", "data.reward=null", "data.eval_prompts=null",
          "rollout.vllm.enforce_eager=true"], "rollout.vllm holds options for vLLM's engine; rollout.engine is 'hf'"),
    ]
    if HAS_VLLM:
        cases.append((["rollout.vllm.gpu_mem_utilization=0.3"], "rollout.vllm.gpu_mem_utilization: vLLM's engine "
                      "has no such option; did you mean gpu_memory_utilization"))
    if HAS_VLLM:  # read after vLLM is found
        cases.append((["rollout.sync_bucket_mb=0.0001"], "rollout.sync_bucket_mb=0.0001 (104 bytes) is smaller than one row of "
                                                         "model.embed_tokens.weight gathered over tp=2"))
    if HAS_VLLM:  # rollout.placement: ray without Ray, or with no cluster at the address (port 1: nothing listens)
        cases.append((["rollout.placement=ray", "rollout.ray_address=127.0.0.1:1"],
                      "no Ray cluster answers at 127.0.0.1:1 " if importlib.util.find_spec("ray")
                      else "needs Ray, which this python cannot import: pip install 'megatron_cispo[ray]'"))
    for overrides, needle in cases:
        err = _check(capsys, model, *overrides)
        assert needle in err, (needle, err)


def _missing_vllm_python() -> str | None:
    if not HAS_VLLM:
        return sys.executable
    return str(OTHER_TIER) if OTHER_TIER.exists() else None


def test_engine_vllm_without_vllm_names_the_extra(model, tmp_path):
    python = _missing_vllm_python()
    if python is None:
        pytest.skip("every python here has vLLM: no environment to show its absence in")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "earlier.txt").write_text("an earlier run's file")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([python, "-m", "megatron_cispo.train", YAML, "--check", "--world-size", "2",
                           f"model.hf_path={model}", f"run.run_dir={run_dir}", "run.resume=true"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip()
    assert proc.returncode == EXIT_CONFIG and len(err.splitlines()) == 1, err
    assert "rollout.engine=vllm needs vLLM" in err and "[vllm]" in err, err
    assert [p.name for p in run_dir.iterdir()] == ["earlier.txt"]


def test_a_run_refuses_a_bad_prompt_file_once_before_touching_run_dir(model, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": 7}])
    proc = ranks(2, [YAML, f"model.hf_path={model}", f"run.run_dir={run_dir}", f"data.prompts={bad}",
                     "run.resume=true"], check=False, timeout=300)
    said = [line for line in proc.stderr.splitlines() if "data.prompts" in line]
    assert proc.returncode != 0 and len(said) == 1, proc.stderr[-3000:]
    assert "not a string" in said[0], said
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]
