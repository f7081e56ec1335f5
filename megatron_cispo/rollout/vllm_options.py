"""rollout.vllm: the YAML's own options for vLLM's engine (keywords of vllm.LLM, i.e. EngineArgs
fields), checked once where the config is read and handed to the engine's process as they are.

    rollout:
      engine: vllm
      vllm: {gpu_memory_utilization: 0.35, max_model_len: 4096, enforce_eager: false}

The keys megatron_cispo sets from other settings, or needs as they are, are refused in one line that
names what to set instead; an unknown key is refused naming the nearest ones vLLM accepts.
"""
from __future__ import annotations

import dataclasses
import difflib

# key -> where megatron_cispo's value comes from, or why it needs that value
OWNED = {
    "model": "from model.hf_path, then the trainer's weights",
    "dtype": "from rollout.precision: fp32 | bf16",
    "seed": "from run.seed and each prompt's position in the stream",
    "skip_tokenizer_init": "the trainer tokenizes; the engine gets token ids",
    "distributed_executor_backend": "'uni': the engine is one process beside rank 0, which its weight push "
                                    "and kill rely on",
    "logprobs_mode": "'processed_logprobs': the rollout anchor needs the logprobs the sampler sampled from",
    "max_logprobs": "-1: the kept sets need every logprob",
    "weight_transfer_config": "from rollout.sync",
    "load_format": "from rollout.sync (stream starts on placeholder weights)",
}
ONE_ENGINE_PROCESS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def check_options(options: dict, *, accepted: set[str] | None = None) -> None:
    """ValueError, one line, for the first rollout.vllm key that cannot be passed to vllm.LLM. accepted:
    vLLM's keys (default: EngineArgs' fields, imported here; None when vLLM is not installed skips
    that check, the engine's start then says vLLM is missing)."""
    for key, value in options.items():
        if key in OWNED:
            raise ValueError(f"rollout.vllm.{key} is set by megatron_cispo ({OWNED[key]}); remove it")
        if key in ONE_ENGINE_PROCESS and value != 1:
            raise ValueError(f"rollout.vllm.{key}={value!r}: the engine is one process beside rank 0, so "
                             f"{key} must be 1 (engines on several GPUs are not built yet); remove it")
        if key == "max_model_len" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"rollout.vllm.max_model_len must be an integer >= 1, got {value!r}")
    accepted = engine_args() if accepted is None else accepted
    if accepted is None:
        return
    for key in options:
        if key not in accepted:
            near = difflib.get_close_matches(key, sorted(accepted), n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(near)}? " if near else ""
            raise ValueError(f"rollout.vllm.{key}: vLLM's engine has no such option; {hint}it accepts the "
                             f"{len(accepted)} fields of vllm.engine.arg_utils.EngineArgs "
                             "(gpu_memory_utilization, max_model_len, enforce_eager, ...)")


def engine_args() -> set[str] | None:
    """The keys vllm.LLM accepts (EngineArgs' fields); None when vLLM is not installed."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return None
    return {f.name for f in dataclasses.fields(EngineArgs)}


def engine_len(options: dict, seq_length: int) -> int:
    """The engine's max_model_len: rollout.vllm.max_model_len, else model.seq_length."""
    return options.get("max_model_len", seq_length)


def engine_length(rollout, model) -> tuple[int, str]:
    """The longest row (prompt + completion) the engine serves, and the setting it comes from."""
    if "max_model_len" in rollout.vllm:
        return engine_len(rollout.vllm, model.seq_length), "rollout.vllm.max_model_len"
    return model.seq_length, "model.seq_length"


def prompt_limit(data, rollout, model) -> tuple[int, str]:
    """The longest prompt a run accepts and where that comes from: data.max_prompt_tokens, else what the
    engine's length (rollout.vllm.max_model_len, else model.seq_length) leaves."""
    if data.max_prompt_tokens is not None:
        return data.max_prompt_tokens, "data.max_prompt_tokens"
    length, where = engine_length(rollout, model)
    return length - rollout.max_new_tokens, f"{where} - rollout.max_new_tokens = {length} - {rollout.max_new_tokens}"
