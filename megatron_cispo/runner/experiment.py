"""The YAML experiment schema (frozen dataclasses) and its loader.

    cfg = load_experiment("yaml_configs/demo_cpu.yaml", ["loss.cispo.anchor=rollout"])
    python -m megatron_cispo.runner.config_doc > docs/configuration.md   # regenerate the docs

A file may inherit from others (`defaults:`), values may read the environment (`${VAR}`,
`${VAR:-fallback}`), and dotted overrides are applied last. Errors are `ConfigError`s naming
the full key path and the expected type; nothing here imports megatron-core.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from ..config import ConfigError, LossConfig, apply_overrides, check_field_types, config_field, from_dict, \
    parse_override_value, to_dict
from ..losses import check_loss_config, get_policy_loss, required_inputs
from ..rollout.engine import engine_spec
from .data import DataConfig, RolloutConfig, check_data_rollout
from .model import ModelConfig, hf_shape
from .optimizer_config import OptimizerConfig


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tp: int = config_field(1, "Tensor-parallel size.")
    pp: int = config_field(1, "Pipeline-parallel size.")
    vp: Optional[int] = config_field(None, "Virtual pipeline stages per rank (interleaved 1F1B); needs pp >= 2.")
    cp: int = config_field(1, "Context-parallel size: each sequence is split into 2*cp load-balanced chunks.")
    ep: int = config_field(1, "Expert-parallel size (MoE models): experts are split over ep data-parallel ranks.")
    sequence_parallel: bool = config_field(False, "Megatron sequence parallelism (needs tp >= 2).")
    micro_batch_size: int = config_field(
        8, "Sequences per microbatch per data-parallel rank; packed, the rows packed together (one or more bins).")
    max_tokens_per_microbatch: Optional[int] = config_field(
        None, "Pack each micro_batch_size rows into [1, T] microbatches of at most this many tokens "
        "(first-fit decreasing); null = pad them into one [b, s] microbatch. cp > 1 needs packing.")

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("tp", "pp", "cp", "ep", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallelism.{name} must be >= 1, got {getattr(self, name)}")
        if self.vp is not None and (self.vp < 1 or self.pp < 2):
            raise ValueError(f"parallelism.vp={self.vp} needs vp >= 1 and pp >= 2 (pp={self.pp}); "
                             "set vp: null for the plain 1F1B schedule")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ValueError(f"parallelism.max_tokens_per_microbatch must be >= 1 or null, "
                             f"got {self.max_tokens_per_microbatch}")
        if self.cp > 1 and self.max_tokens_per_microbatch is None:
            raise ValueError(f"parallelism.cp={self.cp} needs packed microbatches: set "
                             "parallelism.max_tokens_per_microbatch")

    def check_row_fits(self, tokens: int, row: str) -> None:
        """ValueError when one row of `tokens` trainer tokens cannot fit max_tokens_per_microbatch (the
        rule for the synthetic task's sequences and for the prompt files' longest row, said once)."""
        budget = self.max_tokens_per_microbatch
        if budget is not None and budget < tokens:
            raise ValueError(f"parallelism.max_tokens_per_microbatch={budget} is smaller than {row}, {tokens} "
                             f"tokens; raise it to at least {tokens}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    steps: int = config_field(60, "Optimizer steps (one per rollout batch: the fully-async regime); 0 only "
                              "with export_hf (export the loaded model and stop).")
    seed: int = config_field(1234, "Seeds the model init, prompts and sampling (keyed by global sample index).")
    run_dir: str = config_field(
        "runs/experiment", "Output directory: metrics.jsonl, metrics.png, checkpoints/. A YAML file that sets no "
        "run_dir (here or in its defaults:) writes to runs/<its file name without .yaml>.")
    name: str = config_field("", "Label in logs and plots; empty = '<loss>:<anchor>'.")
    log_interval: int = config_field(5, "Steps between progress lines.")
    checkpoint_interval: int = config_field(0, "Steps between checkpoints; 0 = never.")
    eval_interval: int = config_field(
        0, "With data.eval_prompts: evaluate before the first step, every eval_interval steps and after the "
        "last (0 = before the first and after the last only), on the engine with the trainer's current weights; "
        "eval/reward_mean, eval/accuracy (and eval/pass@k) go into that step's record (step 0: before training).")
    checkpoint_keep: int = config_field(
        2, "Complete checkpoints kept (the highest steps); older ones are deleted, never the one just written.")
    resume: bool = config_field(
        False, "Continue from the newest intact checkpoint in run_dir/checkpoints (on any layout), falling back "
        "past a corrupt one with a warning; with none, start fresh and move the earlier files aside. Settings "
        "that differ from the checkpoint's apply with one warning, or are refused (model, optimizer.name, "
        "run.seed): docs/reliability.md.")
    tensorboard: bool = config_field(True, "Write TensorBoard events to run_dir/tb when tensorboard is installed.")
    max_consecutive_skips: int = config_field(
        3, "Stop the run (exit code 3) after this many optimizer steps in a row were skipped because the "
        "loss or gradient was non-finite; 0 = never stop.")
    overwrite: bool = config_field(
        False, "A fresh run (resume: false) into a non-empty run_dir moves the old contents aside to "
        "run_dir/previous_<time>/ instead of refusing; nothing is deleted.")
    export_hf: bool = config_field(
        False, "With model.hf_path: write the model as a Hugging Face directory (config.json, safetensors, "
        "tokenizer files) to run_dir/hf/step_<N>/ at every checkpoint and at the end (run.steps=0: the "
        "loaded model, a round trip). Written atomically, like checkpoints; kept (checkpoint_keep prunes no export).")
    dist_timeout_s: int = config_field(
        600, "Process-group timeout in seconds (every group, megatron's too): a collective that waits this long "
        "fails the job. On gloo the rank that stopped answering is then named (exit code 4, within about twice "
        "this); on NCCL see docs/troubleshooting.md.")

    gpu_memory_gb: Optional[float] = config_field(
        None, "Memory of one GPU in GiB (80 for an H100 80GB): a recipe whose largest rank's estimate (the plan "
        "`train --check` prints: runner/memory_plan.py) exceeds it is refused at --check and at start, naming "
        "the largest part; null = no check.")

    gpus_per_node: Optional[int] = config_field(
        None, "GPUs on each node (8 on an H100 or H200 node). With it `train --check` places the rollout engines "
        "(rollout/placement.py) on the job's nodes (--nnodes; the launch scripts pass torchrun's) beside their "
        "world_size / nnodes trainer processes, and refuses in one line an engine on a GPU a node lacks or more "
        "Ray engines than the GPUs left over; null = the nodes' GPUs are checked at start only.")

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"run.gpus_per_node must be >= 1, or null, got {self.gpus_per_node}")
        if self.gpu_memory_gb is not None and not 0 < self.gpu_memory_gb < math.inf:
            raise ValueError(f"run.gpu_memory_gb must be finite and > 0 (GiB), or null, got {self.gpu_memory_gb}")
        for name, low in (("steps", 0), ("log_interval", 1), ("checkpoint_interval", 0), ("eval_interval", 0),
                          ("checkpoint_keep", 1),
                          ("max_consecutive_skips", 0), ("dist_timeout_s", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"run.{name} must be >= {low}, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    model: ModelConfig = config_field(factory=ModelConfig, doc="A GPT from megatron-core's layer specs.")
    parallelism: ParallelConfig = config_field(factory=ParallelConfig, doc="dp = world_size / (tp * pp).")
    loss: LossConfig = config_field(factory=LossConfig, doc="The policy loss (megatron_cispo.config.LossConfig).")
    optimizer: OptimizerConfig = config_field(factory=OptimizerConfig, doc="Optimizer and LR schedule.")
    rollout: RolloutConfig = config_field(factory=RolloutConfig, doc="Task, sampler and async settings.")
    data: DataConfig = config_field(factory=DataConfig, doc="Prompts from a file and a reward function "
                                    "(rollout.engine: vllm); unset = the synthetic task.")
    run: RunConfig = config_field(factory=RunConfig, doc="Steps, seed, outputs, checkpoints.")

    def __post_init__(self) -> None:
        check_field_types(self)
        r, p = self.rollout, self.parallelism
        check_data_rollout(self.data, r, self.model)
        if self.data.prompts is None:
            self._check_task_geometry()
        hf = self.model.hf_path is not None
        if engine_spec(r.engine).hf_model and not hf:
            raise ValueError(f"rollout.engine={r.engine!r} samples with model.hf_path's family; set "
                             "model.hf_path, or use rollout.engine: torch for the synthetic GPT")
        if not engine_spec(r.engine).hf_model and hf:
            raise ValueError(f"rollout.engine={r.engine!r} samples with the synthetic GPT only; model.hf_path="
                             f"{self.model.hf_path!r} needs rollout.engine: hf (or vllm with data.prompts)")
        if self.run.steps == 0 and not self.run.export_hf:
            raise ValueError("run.steps=0 trains nothing; it is for run.export_hf=true (export the loaded "
                             "model). Set run.steps >= 1")
        if self.run.export_hf and not hf:
            raise ValueError("run.export_hf=true writes a Hugging Face directory of model.hf_path's family; "
                             "set model.hf_path (the synthetic GPT has no HF architecture)")
        self.model.check_layout(tp=p.tp, pp=p.pp, vp=p.vp, cp=p.cp, ep=p.ep, sequence_parallel=p.sequence_parallel)
        self._check_engine_size()
        self._check_routing_replay()
        try:  # the registry's rules (unknown loss, rollout anchor + TIS), once per experiment
            check_loss_config(self.loss)
        except ValueError as e:
            raise ValueError(f"loss: {e}") from None
        if "ref_logprobs" in required_inputs(self.loss):
            raise ValueError(f"loss.kl.coef: the demo trains without a reference policy, so kl.coef must "
                             f"be 0, got {self.loss.kl.coef}")

    def _check_engine_size(self) -> None:
        """An engine that declares the largest model it serves (EngineSpec.max_params) refuses a larger one."""
        spec = engine_spec(self.rollout.engine)
        if spec.max_params is None or self.model.hf_path is None:
            return
        from .memory_plan import Shape, total_params

        n = total_params(Shape.of(self.model))
        if n > spec.max_params:
            raise ValueError(f"rollout.engine={spec.name!r} serves models up to {spec.max_params / 1e9:g}B parameters "
                             f"({spec.max_params_why}); model.hf_path={self.model.hf_path} has {n / 1e9:.1f}B: "
                             "sample with rollout.engine: vllm (data.prompts and data.reward, docs/launch.md)")

    def _check_routing_replay(self) -> None:
        """loss.routing_replay='rollout' needs an MoE model and rollouts that carry routes (the torch and hf
        engines return them on an MoE model; vLLM's does not): said here, so --check refuses it."""
        if self.loss.routing_replay != "rollout":
            return
        if self.model.num_moe_experts is None:
            dense = f"model.hf_path={self.model.hf_path} is dense" if self.model.hf_path else "no model.num_moe_experts"
            raise ValueError(f"loss.routing_replay='rollout' replays the sampler's MoE routes: the model is dense "
                             f"({dense}); set it to 'off'")
        if not engine_spec(self.rollout.engine).routes:
            raise ValueError(f"loss.routing_replay='rollout' replays the sampler's MoE routes: rollout.engine="
                             f"{self.rollout.engine!r} returns none (rollout.engine torch or hf does); set it to 'off'")

    def _check_task_geometry(self) -> None:
        """The synthetic task's sequences fit the model and the microbatch token budget."""
        r, p = self.rollout, self.parallelism
        p.check_row_fits(r.total_len - 1, f"one sequence of task {r.task!r}")
        if self.model.vocab_size < r.vocab_size:
            raise ValueError(f"model.vocab_size={self.model.vocab_size} is too small for task "
                             f"{r.task!r} with base {r.base}: needs >= {r.vocab_size}")
        if self.model.seq_length < r.total_len - 1:
            raise ValueError(f"model.seq_length={self.model.seq_length} is too short for task "
                             f"{r.task!r} with {r.digits} digits: needs >= {r.total_len - 1}")

    @property
    def label(self) -> str:
        return run_label(self.loss, self.run.name)


def run_label(loss: LossConfig, name: str = "") -> str:
    """`name`, else "<policy_loss>:<anchor>" with the anchor that loss really uses (ppo -> "ppo:old")."""
    return name or f"{loss.policy_loss}:{get_policy_loss(loss.policy_loss).anchor_for(loss)}"


# ---------------------------------------------------------------- loading

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _deep_merge(base: dict, top: Mapping) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def read_tree(path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> dict:
    """The YAML mapping at `path` with its `defaults:` files (relative to it) merged underneath."""
    path = Path(path)
    if path.resolve() in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path.resolve()))
        raise ConfigError(f"defaults: inheritance cycle: {chain}")
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    parents = data.get("defaults") or []
    parents = [parents] if isinstance(parents, str) else parents
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: defaults: expected str | list[str], got {parents!r}")
    merged: dict = {}
    for parent in parents:
        merged = _deep_merge(merged, read_tree(path.parent / parent, (*_seen, path.resolve())))
    return _deep_merge(merged, {k: v for k, v in data.items() if k != "defaults"})


def interpolate_env(value: Any, path: str = "", env: Mapping[str, str] = os.environ) -> Any:
    """Replace ${VAR} / ${VAR:-fallback} in strings; a value that is one reference is parsed as YAML."""
    if isinstance(value, Mapping):
        return {k: interpolate_env(v, f"{path}.{k}" if path else str(k), env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate_env(v, f"{path}.{i}", env) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def sub(m: re.Match) -> str:
        if m.group(1) in env:
            return env[m.group(1)]
        if m.group(2) is not None:
            return m.group(2)
        raise ConfigError(f"{path}: environment variable ${{{m.group(1)}}} is not set "
                          f"(write ${{{m.group(1)}:-fallback}} to give a default)")

    whole = _ENV_REF.fullmatch(value)
    return parse_override_value(sub(whole), path) if whole else _ENV_REF.sub(sub, value)


def load_experiment(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (),
                    env: Mapping[str, str] = os.environ) -> ExperimentConfig:
    """File (with defaults) -> overrides -> ${ENV} -> validated ExperimentConfig; raises ConfigError."""
    data = read_tree(path)
    if isinstance(data.get("run", {}), dict) and "run_dir" not in data.get("run", {}):
        # its own folder per experiment file, so two examples never collide in one default
        data = {**data, "run": {**data.get("run", {}), "run_dir": f"runs/{Path(path).stem}"}}
    data = interpolate_env(apply_overrides(data, list(overrides), schema=ExperimentConfig), env=env)
    cfg = from_dict(ExperimentConfig, data)
    _check_hf_shape_keys(cfg, data.get("model") or {})
    return cfg


def _check_hf_shape_keys(cfg: ExperimentConfig, model: Mapping) -> None:
    """ConfigError for a shape key the YAML sets next to model.hf_path to another value than config.json's.
    ModelConfig refuses those that differ from its default; one set to the default value itself
    (model.hidden_size: 32) only the YAML shows."""
    if cfg.model.hf_path is None:
        return
    for name, value in hf_shape(cfg.model.arch).items():
        if name in model and model[name] != value:
            raise ConfigError(f"model: model.{name}={model[name]} conflicts with model.hf_path: "
                              f"{cfg.model.hf_path}/config.json gives {value}; remove model.{name}")


def resolve_world(cfg: ExperimentConfig, world_size: int) -> int:
    """Data-parallel size for `world_size` ranks; ConfigError when the batch or layout does not fit."""
    p, r = cfg.parallelism, cfg.rollout
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    model_parallel = p.tp * p.pp * p.cp
    if world_size % model_parallel:
        raise ConfigError(f"parallelism: world size {world_size} is not divisible by tp*pp*cp = "
                          f"{p.tp}*{p.pp}*{p.cp}; launch a multiple of {model_parallel} processes or change "
                          "parallelism.tp/pp/cp")
    dp = world_size // model_parallel
    if (dp * p.cp) % p.ep:
        raise ConfigError(f"parallelism.ep={p.ep} must divide dp*cp = {dp}*{p.cp} (world size {world_size})")
    if r.batch_size % (dp * p.micro_batch_size):
        raise ConfigError(
            f"rollout: prompts_per_step*group_size = {r.prompts_per_step}*{r.group_size} = {r.batch_size} must "
            f"be divisible by dp*parallelism.micro_batch_size = {dp}*{p.micro_batch_size} (world size {world_size})")
    if r.batch_size % dp:
        raise ConfigError(f"rollout: prompts_per_step*group_size = {r.prompts_per_step}*{r.group_size} = "
                          f"{r.batch_size} must be divisible by dp = {dp} (world size {world_size})")
    return dp


def dump_yaml(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
