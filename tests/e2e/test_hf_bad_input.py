"""A bad Hugging Face model directory is one line and exit 2, and nothing is written (no run_dir).

What config.json shows (no config.json, an unsupported family or feature, tp or ep that cannot split
the model, a shape key that contradicts it) is refused by `train --check`, so the launch scripts
refuse it before any rank starts. What only the weights show (no *.safetensors, a missing or
mis-shaped tensor) is refused by every rank before run_dir is claimed, said once by rank 0.
"""
import json
import shutil
import subprocess

import pytest
import torch

from e2e_helpers import ROOT, env, torchrun
from megatron_cispo.config import ConfigError
from megatron_cispo.testing import free_port
from megatron_cispo.train import EXIT_CONFIG, main

QWEN2 = str(ROOT / "yaml_configs" / "hf_qwen2_tiny.yaml")
MOE = str(ROOT / "yaml_configs" / "hf_qwen3_moe_tiny.yaml")
TENSOR = "model.layers.1.mlp.up_proj.weight"  # [ffn 96, hidden 64] in the tiny models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    root = tmp_path_factory.mktemp("tiny_hf")
    return {f: make_tiny_hf(f, root / f) for f in ("qwen2", "qwen3_moe")}


def _copy(src, dst, *, weights=True, **config_edits):
    """`src`'s model directory at `dst`, optionally without its safetensors or with config.json edited."""
    shutil.copytree(src, dst, ignore=None if weights else shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **config_edits}))
    return dst


def _with_tensor(src, dst, name, value):
    """`src` at `dst` with tensor `name` replaced by `value` (None: removed)."""
    from safetensors.torch import load_file, save_file

    _copy(src, dst)
    state = load_file(str(src / "model.safetensors"))
    state.pop(name) if value is None else state.__setitem__(name, value)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _check(capsys, monkeypatch, config, model, run_dir, *overrides, world=4):
    """train --check in this process: (exit code, stdout, stderr lines); it never creates run_dir."""
    monkeypatch.setenv("HF_MODEL", str(model))
    monkeypatch.setenv("RUN_DIR", str(run_dir))
    code = main(["--check", config, "--world-size", str(world), *overrides])
    out, err = capsys.readouterr()
    assert not run_dir.exists()
    return code, out, err.strip().splitlines()


def _config_cases(tiny, tmp_path):
    """(yaml, model dir, overrides, world size, the line after 'config error in YAML: ')."""
    q2, moe = tiny["qwen2"], tiny["qwen3_moe"]
    empty = tmp_path / "empty"
    empty.mkdir()
    gemma = _copy(q2, tmp_path / "gemma", model_type="gemma")
    yarn = _copy(q2, tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                          "original_max_position_embeddings": 32})
    window = _copy(q2, tmp_path / "window", use_sliding_window=True, sliding_window=64)
    return [
        (QWEN2, empty, [], 4, f"model: model.hf_path={str(empty)!r} has no config.json: expected a Hugging Face "
                              "model directory"),
        (QWEN2, gemma, [], 4, f"model: {gemma}/config.json: model_type='gemma' is not supported; supported: "
                              "llama, mistral, qwen2, qwen3, qwen3_moe"),
        (QWEN2, yarn, [], 4, f"model: {yarn}/config.json: rope_parameters.rope_type='yarn' is not supported; "
                             "megatron-core expresses default, linear, llama3"),
        (QWEN2, window, [], 4, f"model: {window}/config.json: use_sliding_window=True is not supported; "
                               "sliding-window attention is not expressed; set it false only if the model was "
                               "trained without it"),
        (QWEN2, q2, ["parallelism.tp=4"], 4, f"{q2}/config.json: num_key_value_heads=2 is not divisible by tp=4"),
        (QWEN2, q2, ["parallelism.tp=3"], 3, f"{q2}/config.json: num_attention_heads=4 is not divisible by tp=3"),
        (MOE, moe, ["parallelism.ep=3"], 3, f"{moe}/config.json: num_experts=4 is not divisible by ep=3"),
        (QWEN2, q2, ["model.hidden_size=48"], 4, f"model: model.hidden_size=48 conflicts with model.hf_path: "
                                                 f"{q2}/config.json gives 64; remove model.hidden_size"),
        # 32 is the synthetic GPT's default hidden_size: set explicitly, it contradicts the file all the same
        (QWEN2, q2, ["model.hidden_size=32"], 4, f"model: model.hidden_size=32 conflicts with model.hf_path: "
                                                 f"{q2}/config.json gives 64; remove model.hidden_size"),
    ]


def test_what_config_json_shows_is_refused_by_check_in_one_line(tiny, tmp_path, capsys, monkeypatch):
    for i, (config, model, overrides, world, expected) in enumerate(_config_cases(tiny, tmp_path)):
        code, out, lines = _check(capsys, monkeypatch, config, model, tmp_path / f"run{i}", *overrides, world=world)
        assert (code, out, lines) == (EXIT_CONFIG, "", [f"config error in {config}: {expected}"]), (overrides, lines)


def test_what_only_the_weights_show_passes_check_and_is_refused_before_run_dir_exists(tiny, tmp_path, capsys,
                                                                                      monkeypatch):
    from megatron_cispo.runner.loop import run
    from megatron_cispo.runner.experiment import load_experiment

    q2 = tiny["qwen2"]
    bad = {
        "no_weights": (_copy(q2, tmp_path / "no_weights", weights=False),
                       "model.hf_path='{d}' has no *.safetensors weights (only safetensors are read; convert a .bin "
                       "checkpoint with transformers' save_pretrained)"),
        "missing": (_with_tensor(q2, tmp_path / "missing", TENSOR, None),
                    f"{{d}}: tensor {TENSOR} is missing (expected shape [96, 64] from config.json)"),
        "misshaped": (_with_tensor(q2, tmp_path / "misshaped", TENSOR, torch.zeros(95, 64)),
                      f"{{d}}/model.safetensors: {TENSOR} has shape [95, 64]; config.json implies [96, 64]"),
    }
    for name, (model, expected) in bad.items():
        run_dir = tmp_path / f"run_{name}"
        code, out, lines = _check(capsys, monkeypatch, QWEN2, model, run_dir)  # config.json alone is fine
        assert (code, lines) == (0, []) and "# ok: 4 processes" in out, (name, lines)
        monkeypatch.setenv("HF_MODEL", str(model))
        cfg = load_experiment(QWEN2, [f"run.run_dir={run_dir}"])
        with pytest.raises(ConfigError) as e:
            run(cfg)
        assert str(e.value) == "model.hf_path: " + expected.format(d=model), name
        assert not run_dir.exists(), name


def _lines(proc) -> list[str]:
    return (proc.stdout + proc.stderr).strip().splitlines()


def test_missing_weights_through_the_launch_script_are_one_line_exit_2_and_no_run_dir(tiny, tmp_path):
    model = _copy(tiny["qwen2"], tmp_path / "no_weights", weights=False)
    run_dir = tmp_path / "run"
    proc = subprocess.run(["bash", "launch/single_node.sh", QWEN2, f"model.hf_path={model}",
                           f"run.run_dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**env(), "NPROC": "2", "MASTER_PORT": str(free_port())})
    assert proc.returncode == EXIT_CONFIG, _lines(proc)[-30:]
    assert _lines(proc) == [f"config error in {QWEN2}: model.hf_path: model.hf_path={str(model)!r} has no "
                            "*.safetensors weights (only safetensors are read; convert a .bin checkpoint with "
                            "transformers' save_pretrained)"], _lines(proc)[-30:]
    assert not run_dir.exists()


def test_a_misshaped_tensor_under_bare_torchrun_is_said_once_by_rank_0(tiny, tmp_path):
    model = _with_tensor(tiny["qwen3_moe"], tmp_path / "misshaped", "model.layers.0.mlp.experts.3.down_proj.weight",
                         torch.zeros(64, 31))
    run_dir = tmp_path / "run"
    proc = torchrun(2, [MOE, f"model.hf_path={model}", f"run.run_dir={run_dir}"], check=False, timeout=300)
    out = proc.stdout + proc.stderr
    message = (f"{model}/model.safetensors: model.layers.0.mlp.experts.3.down_proj.weight has shape [64, 31]; "
               "config.json implies [64, 32]")
    assert proc.returncode != 0 and "exitcode  : 2" in out, out[-3000:]
    assert out.count(message) == 1, out[-3000:]
    # torchrun's agent adds its own failure summary and traceback; no worker printed one
    assert "ConfigError" not in out and "megatron_cispo/" not in out and "[rank" not in out, out[-3000:]
    assert not run_dir.exists()
