"""The `data:` section: prompts from a file and a reward function, for rollout.engine: vllm.

    data:
      prompts: yaml_configs/data/add_small.jsonl    # JSONL or Parquet (rollout/prompts.py)
      reward: megatron_cispo.rollout.arith:exact_match

Without data.prompts the run samples the synthetic task of `rollout:` (rollout.task). The files are
read when the run starts (rollout/prompts.py, rollout/rewards.py); here only what the YAML shows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..config import check_field_types, config_field


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    prompts: Optional[str] = config_field(
        None, "Prompt file: JSONL (.jsonl/.json) or Parquet, read with the datasets library, or a directory of "
        "split files (train.jsonl, test.parquet, ...); one row per prompt. With it the synthetic task is off "
        "and rollout.engine must be vllm; null = the synthetic task (rollout.task). A relative path is "
        "resolved against the directory the run starts in.")
    split: str = config_field("train", "The split to read (a single file's only split is train).")
    prompt_key: str = config_field("prompt", "The field holding the prompt text.")
    chat_template: bool = config_field(
        False, "Wrap each prompt as one user turn with the tokenizer's chat template (model.hf_path's "
        "tokenizer; refused when it has none); false = the text tokenized as it is.")
    max_prompt_tokens: Optional[int] = config_field(
        None, "Refuse a prompt longer than this (naming its row); null = the model's sequence length less "
        "rollout.max_new_tokens decides.")
    reward: Optional[str] = config_field(
        None, "The reward, 'package.module:function' or 'path/to/file.py:function', called as "
        "fn(record, completion, token_ids) -> float (or fn(record, completion)) with the prompt's row, the "
        "decoded completion and its token ids. It runs in a worker process: an exception, a non-number or a "
        "call longer than reward_timeout_s is counted per step (reward/errors, reward/timeouts, "
        "reward/non_numbers), named in one line, and that sample is left out of the loss.")
    reward_timeout_s: float = config_field(10.0, "Seconds one reward call may take.")

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.prompts is not None:
            object.__setattr__(self, "prompts", str(Path(self.prompts).expanduser().absolute()))
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens must be >= 1 (or null), got {self.max_prompt_tokens}")
        if not 0 < self.reward_timeout_s < math.inf:
            raise ValueError(f"data.reward_timeout_s must be finite and > 0, got {self.reward_timeout_s}")
        if self.prompts is not None and not self.reward:
            raise ValueError("data.prompts needs data.reward: 'package.module:function' or 'file.py:function' "
                             "(e.g. megatron_cispo.rollout.arith:exact_match)")
        if self.reward and self.prompts is None:
            raise ValueError("data.reward scores completions of data.prompts; set data.prompts (or remove "
                             "data.reward: the synthetic task scores itself with rollout.reward)")


def check_data_rollout(data: DataConfig, rollout, model) -> None:
    """ValueError (one line) for a data/rollout/model combination that cannot run."""
    if rollout.engine == "vllm" and data.prompts is None:
        raise ValueError("rollout.engine='vllm' samples prompts from a file: set data.prompts and data.reward "
                         "(e.g. yaml_configs/vllm_qwen2_tiny.yaml), or use rollout.engine: hf for the synthetic task")
    if data.prompts is not None and rollout.engine != "vllm":
        raise ValueError(f"data.prompts is sampled by vLLM: set rollout.engine: vllm (got {rollout.engine!r}); "
                         "the torch and hf samplers run the synthetic task only")
    if data.prompts is None:
        return
    if rollout.credit == "token":
        raise ValueError("rollout.credit='token' needs the synthetic task's per-position correctness; "
                         "with data.prompts use credit: sequence")
    longest = model.seq_length - rollout.max_new_tokens
    if longest < 1:
        raise ValueError(f"rollout.max_new_tokens={rollout.max_new_tokens} leaves no room for a prompt in "
                         f"model.seq_length={model.seq_length}; lower rollout.max_new_tokens")
    if data.max_prompt_tokens is not None and data.max_prompt_tokens > longest:
        raise ValueError(f"data.max_prompt_tokens={data.max_prompt_tokens} + rollout.max_new_tokens="
                         f"{rollout.max_new_tokens} exceeds model.seq_length={model.seq_length}; lower either")


def prompt_limit(data: DataConfig, rollout, model) -> tuple[int, str]:
    """The longest prompt a run accepts and where that comes from: data.max_prompt_tokens, else what the
    sequence length leaves."""
    if data.max_prompt_tokens is not None:
        return data.max_prompt_tokens, "data.max_prompt_tokens"
    return model.seq_length - rollout.max_new_tokens, (f"model.seq_length - rollout.max_new_tokens = "
                                                       f"{model.seq_length} - {rollout.max_new_tokens}")
