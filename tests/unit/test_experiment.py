"""The YAML experiment schema and loader: inheritance, overrides, ${ENV}, and every error path."""
import re
import shlex
from pathlib import Path

import pytest
import yaml

from megatron_cispo.config import ConfigError
from megatron_cispo.runner.experiment import ExperimentConfig, OptimizerConfig, interpolate_env, load_experiment, \
    resolve_world
from megatron_cispo.train import EXIT_CONFIG, main

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "yaml_configs" / "demo_cpu.yaml")
CONFIGS = sorted((ROOT / "yaml_configs").glob("*.yaml"))


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path, shipped_env):
    cfg = load_experiment(path, env=shipped_env(path))
    assert isinstance(cfg, ExperimentConfig)


def _header_launches(path: Path) -> list[tuple[int, list[str]]]:
    """(world size, overrides) of each `megatron_cispo.train` or launch-script command in a YAML's header."""
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("#") or path.name not in line:
            continue
        words = shlex.split(line.lstrip("# "))
        env_vars = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
        flag = next((words[i + 1] for i, w in enumerate(words) if w in ("--nproc-per-node", "--world-size")), None)
        world = flag or env_vars.get("NPROC") or (
            int(env_vars["NNODES"]) * int(env_vars.get("GPUS_PER_NODE", 4)) if "NNODES" in env_vars else 4)
        after = words[next(i for i, w in enumerate(words) if w.endswith(path.name)) + 1:]
        out.append((int(world), [w for w in after if re.match(r"^[a-z_]+(\.[a-z_]+)+=", w)]))
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_fits_the_world_sizes_its_header_launches(path, shipped_env):
    launches = _header_launches(path)
    assert launches, f"{path.name}: its header shows no command that runs it"
    for world, overrides in launches:
        cfg = load_experiment(path, overrides, env=shipped_env(path))
        assert resolve_world(cfg, world) >= 1, (world, overrides)


def test_shipped_configs_cover_demo_gpu_and_each_anchor():
    names = {p.name for p in CONFIGS}
    assert {"demo_cpu.yaml", "gpu_template.yaml", "cispo_rollout.yaml", "cispo_old.yaml"} <= names
    assert load_experiment(ROOT / "yaml_configs/cispo_old.yaml", env={}).loss.cispo.anchor == "old"
    assert load_experiment(ROOT / "yaml_configs/cispo_rollout.yaml", env={}).loss.cispo.anchor == "rollout"


def test_gpu_template_is_te_bf16_with_model_parallelism():
    cfg = load_experiment(ROOT / "yaml_configs/gpu_template.yaml", env={})
    assert (cfg.model.transformer_impl, cfg.model.dtype) == ("te", "bf16")
    assert cfg.parallelism.tp * cfg.parallelism.pp > 1
    assert resolve_world(cfg, 16) == 4


def test_defaults_inherit_and_merge_mapping_by_mapping(tmp_path):
    _write(tmp_path, "base.yaml", {"model": {"hidden_size": 48, "num_layers": 4}, "run": {"steps": 7}})
    _write(tmp_path, "mid.yaml", {"defaults": "base.yaml", "model": {"num_layers": 2}})
    top = _write(tmp_path, "top.yaml", {"defaults": ["mid.yaml"], "run": {"seed": 3}})
    cfg = load_experiment(top, env={})
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.run.steps, cfg.run.seed) == (48, 2, 7, 3)


def test_defaults_cycle_is_reported(tmp_path):
    _write(tmp_path, "a.yaml", {"defaults": "b.yaml"})
    _write(tmp_path, "b.yaml", {"defaults": "a.yaml"})
    with pytest.raises(ConfigError, match="inheritance cycle"):
        load_experiment(tmp_path / "a.yaml", env={})


def test_dotted_overrides_apply_last_and_parse_as_yaml():
    cfg = load_experiment(ROOT / "yaml_configs/demo_cpu.yaml",
                          ["loss.cispo.anchor=old", "optimizer.lr=1e-3", "run.steps=5", "parallelism.vp=null"], env={})
    assert (cfg.loss.cispo.anchor, cfg.optimizer.lr, cfg.run.steps, cfg.parallelism.vp) == ("old", 1e-3, 5, None)


def test_env_interpolation_with_fallback_and_typed_values(tmp_path):
    path = _write(tmp_path, "e.yaml", "run:\n  steps: ${STEPS}\n  run_dir: out/${NAME:-x}/r\n  seed: ${SEED:-9}\n")
    cfg = load_experiment(path, env={"STEPS": "12", "NAME": "abc"})
    assert (cfg.run.steps, cfg.run.run_dir, cfg.run.seed) == (12, "out/abc/r", 9)


def test_env_interpolation_applies_to_overrides_too():
    cfg = load_experiment(ROOT / "yaml_configs/demo_cpu.yaml", ["run.run_dir=${OUT}/a"], env={"OUT": "/tmp/q"})
    assert cfg.run.run_dir == "/tmp/q/a"


def test_missing_env_var_names_key_and_variable():
    with pytest.raises(ConfigError, match=r"run\.run_dir: environment variable \$\{NOPE\} is not set"):
        interpolate_env({"run": {"run_dir": "${NOPE}"}}, env={})


@pytest.mark.parametrize("override, message", [
    ("model.hidden_sise=3", r"model\.hidden_sise: unknown key; known keys: vocab_size"),
    ("loss.cispo.anchr=old", r"loss\.cispo\.anchr: unknown key"),
    ("run.steps=abc", r"run\.steps: expected int, got str 'abc'"),
    ("loss.cispo.anchor=new", r"loss\.cispo\.anchor: expected 'old' \| 'rollout', got str 'new'"),
    ("rollout.precision=fp16", r"rollout\.precision: expected 'fp32' \| 'bf16'"),
    ("optimizer.lr=[1]", r"optimizer\.lr: expected float, got list"),
    ("optimizer.distributed=true optimizer.name=sgd",
     r"optimizer\.distributed=true shards Adam's state; megatron-core's distributed optimizer refuses "
     r"optimizer\.name='sgd'"),
    ("run.resume=3", r"run\.resume: expected bool, got int 3"),
    ("rollout.group_size=1", r"rollout\.group_size must be >= 2, got 1"),
    ("model.vocab_size=10", r"model\.vocab_size=10 is too small for task 'reverse'"),
    ("model.seq_length=4", r"model\.seq_length=4 is too short"),
    ("parallelism.tp=3", r"model\.vocab_size=16 is not divisible by tp=3"),
    ("loss.tis.level=token", r"cispo\.anchor='rollout' cannot be combined with tis\.level='token'"),
    ("parallelism.max_tokens_per_microbatch=4",
     r"parallelism\.max_tokens_per_microbatch=4 is smaller than one sequence of task 'reverse', \d+ tokens; raise it"),
    ("loss.kl.coef=0.1", r"loss\.kl\.coef: the demo trains without a reference policy, so kl\.coef must be 0, got 0\.1"),
    ("parallelism.tp=1 parallelism.sequence_parallel=true", r"sequence_parallel needs tp >= 2 .*got tp=1"),
])
def test_bad_values_fail_with_full_key_path_and_expected_type(override, message):
    with pytest.raises(ConfigError, match=message):
        load_experiment(ROOT / "yaml_configs/demo_cpu.yaml", override.split(), env={})


def test_unknown_key_in_file_names_its_path(tmp_path):
    path = _write(tmp_path, "bad.yaml", {"rollout": {"staleness": 1, "stalenes": 2}})
    with pytest.raises(ConfigError, match=r"^rollout\.stalenes: unknown key"):
        load_experiment(path, env={})


def test_unreadable_and_non_mapping_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_experiment(tmp_path / "missing.yaml", env={})
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        load_experiment(_write(tmp_path, "list.yaml", "- 1\n"), env={})


@pytest.mark.parametrize("world, message", [
    (3, "world size 3 is not divisible by tp\\*pp\\*cp = 2\\*1\\*1"),
    (12, "must be divisible by dp\\*parallelism.micro_batch_size = 6\\*16"),
])
def test_world_size_must_fit_layout_and_batch(world, message):
    cfg = load_experiment(ROOT / "yaml_configs/demo_cpu.yaml", env={})
    with pytest.raises(ConfigError, match=message):
        resolve_world(cfg, world)


def test_lr_schedules():
    const = OptimizerConfig(lr=1.0, warmup_steps=2)
    assert [const.lr_at(s, 10) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    cos = OptimizerConfig(lr=1.0, min_lr=0.0, schedule="cosine")
    assert cos.lr_at(0, 10) == 1.0 and cos.lr_at(5, 10) == pytest.approx(0.5)
    lin = OptimizerConfig(lr=1.0, schedule="linear")
    assert lin.lr_at(5, 10) == pytest.approx(0.5)


def test_cli_reports_config_error_once_with_exit_code_2(capsys):
    assert main([DEMO, "model.foo=1"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("model.foo: unknown key") == 1 and "Traceback" not in err


def test_cli_error_is_silent_on_nonzero_ranks(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    assert main([DEMO, "model.foo=1"]) == EXIT_CONFIG
    assert capsys.readouterr().err == ""


def test_cli_check_validates_layout_without_running(capsys):
    assert main(["--check", "--world-size", "4", DEMO]) == 0
    assert "# ok: 4 processes = tp 2 x pp 1 x dp 2" in capsys.readouterr().out
    assert main(["--check", "--world-size", "3", DEMO]) == EXIT_CONFIG


def test_cli_reports_a_layout_the_device_cannot_run_as_a_config_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("bf16 training is supported on CUDA")
    assert main([DEMO, "model.dtype=bf16", "parallelism.tp=1"]) == EXIT_CONFIG
    assert "model.dtype: 'bf16' needs CUDA" in capsys.readouterr().err


@pytest.mark.parametrize("overrides,label", [
    (["loss.policy_loss=ppo"], "ppo:old"),
    (["loss.policy_loss=ppo", "loss.cispo.anchor=rollout"], "ppo:old"),  # cispo's anchor is not ppo's
    (["loss.policy_loss=rollout_is"], "rollout_is:rollout"),
    (["loss.policy_loss=cispo", "loss.cispo.anchor=rollout"], "cispo:rollout"),
    (["loss.policy_loss=ppo", "run.name=mine"], "mine"),
])
def test_run_label_names_the_anchor_the_loss_really_uses(overrides, label):
    assert load_experiment(DEMO, overrides).label == label


def test_report_labels_a_run_from_its_saved_config_like_the_run_does(tmp_path):
    from megatron_cispo.demo.report import summarize
    from megatron_cispo.runner.experiment import dump_yaml

    cfg = load_experiment(DEMO, ["loss.policy_loss=ppo", "loss.cispo.anchor=rollout"])
    (tmp_path / "config.yaml").write_text(dump_yaml(cfg))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    assert summarize(tmp_path)["label"] == cfg.label == "ppo:old"


def test_a_yaml_without_run_dir_writes_to_runs_named_after_the_file(tmp_path):
    from megatron_cispo.runner.experiment import load_experiment

    (tmp_path / "base.yaml").write_text("run:\n  steps: 3\n")
    (tmp_path / "my_exp.yaml").write_text("defaults: base.yaml\nloss:\n  policy_loss: cispo\n")
    assert load_experiment(tmp_path / "my_exp.yaml").run.run_dir == "runs/my_exp"
    assert load_experiment(tmp_path / "base.yaml").run.run_dir == "runs/base"
    # set in the file, in its defaults, or by an override: that one wins
    (tmp_path / "set.yaml").write_text("defaults: base.yaml\nrun:\n  run_dir: out/here\n")
    assert load_experiment(tmp_path / "set.yaml").run.run_dir == "out/here"
    (tmp_path / "child.yaml").write_text("defaults: set.yaml\n")
    assert load_experiment(tmp_path / "child.yaml").run.run_dir == "out/here"
    assert load_experiment(tmp_path / "my_exp.yaml", ["run.run_dir=x/y"]).run.run_dir == "x/y"


def test_routing_replay_rollout_is_refused_at_check_on_a_dense_model_and_with_vllms_rollouts(tmp_path, capsys):
    """Refused by --check in one line (exit 2), not at the first step with a traceback from every rank."""
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    code = main(["--check", DEMO, "--world-size", "1", "loss.routing_replay=rollout", "parallelism.tp=1"])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_CONFIG and len(err.splitlines()) == 1, err
    assert ("loss.routing_replay='rollout' replays the sampler's MoE routes: the model is dense "
            "(no model.num_moe_experts)") in err
    moe = make_tiny_hf("qwen3_moe", tmp_path / "moe", seed=1)
    vllm = str(ROOT / "yaml_configs" / "vllm_qwen2_tiny.yaml")
    with pytest.raises(ConfigError, match="rollout.engine='vllm' returns none"):
        load_experiment(vllm, [f"model.hf_path={moe}", "loss.routing_replay=rollout"])
    cfg = load_experiment(DEMO, ["loss.routing_replay=rollout", "model.num_moe_experts=4", "parallelism.tp=1"])
    assert cfg.loss.routing_replay == "rollout"  # an MoE model whose engine (torch) returns routes


def test_the_hf_engine_refuses_a_model_above_its_size_naming_vllm(capsys, shipped_env, monkeypatch):
    """EngineSpec.max_params: the hf engine serves up to 4B parameters; Qwen3-8B's config.json (8.2B) is
    refused at --check in one line that names vLLM, and a model under the limit passes the rule."""
    from megatron_cispo.rollout.engine import engine_spec

    assert engine_spec("hf").max_params == 4e9 and engine_spec("vllm").max_params is None
    qwen3_8b = ROOT / "yaml_configs" / "models" / "qwen3_8b"
    code = main(["--check", str(ROOT / "yaml_configs" / "hf_qwen2_tiny.yaml"), "--world-size", "2",
                 f"model.hf_path={qwen3_8b}"])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_CONFIG and len(err.splitlines()) == 1, err
    assert (f"rollout.engine='hf' serves models up to 4B parameters (it gathers the whole model on rank 0 at every "
            f"weight push, rebuilds transformers' copy of it there and generates without a paged KV cache); "
            f"model.hf_path={qwen3_8b} has 8.2B: sample with rollout.engine: vllm") in err
    tiny = ROOT / "yaml_configs" / "hf_qwen2_tiny.yaml"
    for key, value in shipped_env(tiny).items():  # HF_MODEL: the tiny model its header makes
        monkeypatch.setenv(key, value)
    assert main(["--check", str(tiny), "--world-size", "2"]) == 0, capsys.readouterr().err
