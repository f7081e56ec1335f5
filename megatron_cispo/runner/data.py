"""The `rollout:` and `data:` sections: what is sampled and how (the synthetic task, or prompts from a
file and a reward function for rollout.engine: vllm), and the rules between them.

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
from typing import Any, Literal, Optional

from ..config import check_field_types, config_field
from ..rollout.engine import engine_spec, runs_on_cuda
from ..rollout.vllm_options import check_options, engine_length, engine_len


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    task: Literal["copy", "reverse", "sort", "add", "dedup"] = config_field(
        "reverse", "Synthetic task: answer = the digits copied, reversed, sorted, or a+b (LSB first); "
        "dedup: the distinct digits in increasing order, then EOS (variable length).")
    digits: int = config_field(4, "Digits per prompt operand.")
    base: int = config_field(10, "Digit alphabet size; the task uses base + 4 token ids.")
    reward: Literal["per_position", "exact_match"] = config_field(
        "per_position", "Fraction of answer positions right, or 1 only when all are.")
    credit: Literal["sequence", "token"] = config_field(
        "sequence", "Advantage per sample from its reward, or per answer token from that position's "
        "correctness (token needs reward=per_position); both normalised within the group.")
    prompts_per_step: int = config_field(16, "Prompts per step (global, over all DP ranks).")
    group_size: int = config_field(4, "Samples per prompt; advantages are normalised within a group.")
    staleness: int = config_field(2, "Policy versions the sampler lags: step t samples with version max(0, t-k) (rollout.mode=async: at most k "
        "versions).")
    temperature: float = config_field(1.0, "Sampler temperature (the trainer scores with the same).")
    precision: Literal["fp32", "bf16"] = config_field("bf16", "Sampler weights/compute dtype.")
    engine: str = config_field(
        "torch", "The sampler's engine, by its registered name (rollout/engine.py; a run.plugins module may "
        "register more): torch = our plain-PyTorch copy of the synthetic GPT (model.hf_path unset); "
        "hf = transformers' own model of model.hf_path's family, on the trainer's weights synced every step "
        "through the export mapping (hf/mapping.py). Task symbols are token ids 0..base+3 of the HF vocabulary. "
        "vllm = vLLM's offline engine in its own process (rank 0 starts it), on the same synced weights, "
        "sampling data.prompts (needs the [vllm] extra, model.hf_path and data.prompts).")
    sync: Literal["stream", "disk"] = config_field(
        "stream", "How the engine gets the trainer's weights after each step: stream = named buckets from one "
        "rank per pipeline stage (and one per EP rank for experts) into the engine's update_weights (vLLM: its "
        "weight-transfer API, on CPU this project's shared-memory engine; torch, hf: rank 0's in-process engine), "
        "in the parameters' dtype, no rank holding more than about two buckets beyond the model; disk = the whole "
        "model gathered, written as an fp32 HF directory and reloaded (the fallback, vLLM only).")
    engines: int = config_field(
        1, "Engine replicas (rollout.engine: vllm): every weight push reaches all of them and each step's prompts "
        "are split across them (rollout/engine_pool.py); the batch is the one a single engine makes.")
    placement: Literal["local", "ray"] = config_field(
        "local", "Where the replicas run: local = child processes, replica k beside the first rank of node k % "
        "nodes (one node: all beside rank 0; rollout/node_engines.py); ray = Ray actors in the existing "
        "Ray cluster at rollout.ray_address, in one placement group of rollout.engines bundles (on GPU each "
        "{GPU: rollout.vllm tensor_parallel_size, CPU: 1}, placed on the GPUs Ray was started with, which "
        "launch/slurm_ray.sbatch keeps apart from the trainer's; on CPU {CPU: 1}); needs the [ray] extra "
        "(rollout/ray_engines.py).")
    ray_address: str = config_field(
        "auto", "rollout.placement=ray: the Ray cluster to join (ray.init(address=...)), HOST:PORT of its head; "
        "auto = $RAY_ADDRESS, else the cluster `ray start --head` started on rank 0's node. Checked at --check.")
    engine_gpus: Optional[list[int]] = config_field(
        None, "rollout.placement=local on CUDA GPUs: the GPU of each replica, as an index among its node's GPUs "
        "(replica k runs on node k % nodes, on GPU engine_gpus[k]; its vLLM process sees that GPU alone). A GPU "
        "a trainer rank of that node also uses (local rank i trains on GPU i) is shared with it, colocated: "
        "rollout.vllm.gpu_memory_utilization must leave the trainer room; any other is the engine's own, apart: "
        "launch fewer trainer processes per node than it has GPUs. Replicas on one node need distinct GPUs. "
        "Checked at --check against run.gpus_per_node and at start against each node's GPUs. null = rank 0's "
        "own GPU, for one replica (several on CUDA must be listed).")
    on_engine_death: Literal["stop", "restart"] = config_field(
        "stop", "An engine replica whose process dies (rollout.engine: vllm, rollout.sync: stream): stop = the run "
        "stops with one line naming the replica; restart = a fresh replica is started in its place. With "
        "rollout.engines > 1 the other replicas generate the dead one's share (the same samples: each prompt "
        "has its own seed) and the fresh one rejoins at the next weight push, so nothing is kept; a single "
        "engine gets the last push again (kept for this: a host copy of the weights on rank 0, or Ray's object "
        "store) and retries. A second failure of that call, or every replica dead at once, stops the run "
        "(rollout/engine_restarts counts the restarts).")
    mode: Literal["sync", "async"] = config_field(
        "sync", "sync = the engine samples step t's batch when the trainer asks, with policy version max(0, t - "
        "staleness): an exact, reproducible lag (tests, the demo table). async = rollout.engine=vllm generates the "
        "batches of the next steps while the trainer trains this one, each with the weights the engine holds "
        "then (pushed between generations after every optimizer step); rollout.staleness bounds the lag and "
        "rollout.stale_policy says what keeps it. Needs rollout.sync: stream.")
    stale_policy: Literal["wait", "drop"] = config_field(
        "wait", "rollout.mode=async: wait = the engine starts a batch only when its lag at training will be at "
        "most rollout.staleness (it waits for newer weights: rollout/engine_wait_frac); drop = the engine never "
        "waits for weights, keeping staleness + 1 batches ahead, and a batch that lags more than staleness when "
        "its step comes is not trained on (rollout/dropped_batches counts them, their prompts are not re-used).")
    vllm: dict[str, Any] = config_field(
        doc="rollout.engine=vllm: more keywords for vllm.LLM (EngineArgs fields), e.g. gpu_memory_utilization "
        "on a GPU shared with the trainer, max_model_len (at most model.seq_length; the prompts' limit follows "
        "it), enforce_eager: false. Keys set from other settings (dtype, seed, ...) and unknown keys are refused "
        "at --check, in one line.", factory=dict)
    sync_bucket_mb: float = config_field(
        256.0, "Bucket size of rollout.sync=stream in MiB: what one send carries (a tensor larger than one is "
        "sent in row blocks).")
    eval_samples: int = config_field(
        1, "With data.eval_prompts: samples per eval prompt; 1 = greedy (eval/accuracy is the greedy answer's), "
        "k > 1 = k samples at rollout.temperature with rollout.top_k / top_p (eval/accuracy over all of them, "
        "eval/pass@k: the share of prompts with at least one exact answer).")
    filter_groups: bool = config_field(
        False, "Dynamic sampling (DAPO): drop each group whose scored rewards are all equal (zero advantage) and "
        "sample more prompts to refill the batch, up to rollout.filter_max_rounds extra rounds; then fill with "
        "dropped groups (rollout/filter_short_groups). A step left with no signal at all skips its optimizer "
        "step (step/skipped_no_signal): Adam's momentum would otherwise move the weights with no gradient. "
        "data.prompts only.")
    filter_max_rounds: int = config_field(3, "rollout.filter_groups: extra sampling rounds per step at most.")
    max_new_tokens: int = config_field(
        16, "With data.prompts: the most tokens a sample may take; EOS ends it earlier. A sample that reaches "
        "it is truncated (rollout/truncated_frac).")
    top_k: int = config_field(
        0, "Sampler top-k after temperature: keep the k most likely tokens (ties kept), 0 = off. With top_k "
        "or top_p on, the sampler returns its kept sets and every trainer pass scores over them "
        "(sampling-mask replay); its logprobs are renormalised over the kept set, as vLLM's processed_logprobs.")
    top_p: float = config_field(
        1.0, "Sampler top-p (nucleus) after top-k: keep the most likely tokens until their probability "
        "reaches top_p (the top token always kept), in (0, 1]; 1 = off.")

    def __post_init__(self) -> None:
        check_field_types(self)
        for name, low in (("digits", 1), ("base", 2), ("prompts_per_step", 1), ("group_size", 2), ("staleness", 0),
                          ("eval_samples", 1), ("filter_max_rounds", 0),
                          ("top_k", 0), ("max_new_tokens", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"rollout.{name} must be >= {low}, got {getattr(self, name)}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 < self.sync_bucket_mb < math.inf:
            raise ValueError(f"rollout.sync_bucket_mb must be finite and > 0, got {self.sync_bucket_mb}")
        if not 0 < self.temperature < math.inf:
            raise ValueError(f"rollout.temperature must be finite and > 0, got {self.temperature}")
        spec = engine_spec(self.engine)  # an unknown name: one line naming the registered engines
        if self.vllm and spec.options != "vllm":
            raise ValueError(f"rollout.vllm holds options for vLLM's engine; rollout.engine is {self.engine!r}: "
                             "remove rollout.vllm or set rollout.engine: vllm")
        if self.mode == "async" and not spec.overlaps:
            raise ValueError(f"rollout.mode='async' generates beside the trainer, which an engine in its own process "
                             f"(rollout.engine: vllm) does; the {self.engine!r} engine samples inside the trainer's "
                             "step: use rollout.mode: sync")
        if self.engines < 1:
            raise ValueError(f"rollout.engines must be >= 1, got {self.engines}")
        if self.engine_gpus is not None:
            self._check_engine_gpus()
        if self.engines > 1 and not spec.replicas:
            raise ValueError(f"rollout.engines={self.engines}: the {self.engine!r} engine runs inside the trainer's "
                             "process, one copy; replicas are engines in their own processes (rollout.engine: vllm)")
        wants_pool = [k for k, on in (("placement='ray'", self.placement == "ray"),
                                      ("on_engine_death='restart'", self.on_engine_death == "restart")) if on]
        if wants_pool and not spec.replicas:
            raise ValueError(f"rollout.{wants_pool[0]} runs engines in their own processes, which the "
                             f"{self.engine!r} engine is not (it runs inside the trainer's process): use "
                             "rollout.engine: vllm")
        if wants_pool and self.sync != "stream":
            raise ValueError(f"rollout.{wants_pool[0]} pushes the weights to each replica in buckets: it needs "
                             f"rollout.sync: stream, got {self.sync!r}")
        if self.engines > 1 and self.sync != "stream":
            raise ValueError(f"rollout.engines={self.engines} pushes each version to every replica in buckets: it "
                             f"needs rollout.sync: stream, got {self.sync!r}")
        if self.sync == "disk" and not spec.disk:
            raise ValueError(f"rollout.sync='disk' reloads an exported HF directory, which the {self.engine!r} engine "
                             "does not: it takes the weights streamed (rollout.sync: stream)")
        if self.mode == "async" and self.sync != "stream":
            raise ValueError("rollout.mode='async' pushes weights between generations, bucket by bucket: it needs "
                             f"rollout.sync: stream, got {self.sync!r}")
        if self.stale_policy != "wait" and self.mode != "async":
            raise ValueError(f"rollout.stale_policy={self.stale_policy!r} applies to rollout.mode: async only "
                             "(sync mode's lag is exactly rollout.staleness)")
        if self.credit == "token" and self.reward != "per_position":
            raise ValueError(f"rollout.credit='token' needs rollout.reward='per_position', got {self.reward!r}")
        if self.credit == "token" and self.variable_length:
            raise ValueError(f"rollout.credit='token' needs a fixed-length task, got task={self.task!r}")

    def _check_engine_gpus(self) -> None:
        g = self.engine_gpus
        if self.placement != "local" or not engine_spec(self.engine).replicas:
            raise ValueError(f"rollout.engine_gpus places engines in their own processes beside trainer ranks "
                             f"(rollout.engine: vllm, rollout.placement: local); got engine {self.engine!r}, placement "
                             f"{self.placement!r} (Ray places its bundles on the GPUs it was started with)")
        if len(g) != self.engines or min(g) < 0:
            raise ValueError(f"rollout.engine_gpus={g}: expected {self.engines} GPU indices >= 0, one per "
                             f"replica (rollout.engines={self.engines})")

    @property
    def pooled(self) -> bool:
        """The engine runs as a pool of replicas (rollout/engine_pool.py): several, on Ray, or restartable."""
        return self.engines > 1 or self.placement == "ray" or self.on_engine_death == "restart"

    @property
    def sync_bucket_bytes(self) -> int:
        return max(1, int(self.sync_bucket_mb * 2**20))

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size

    # Sequence geometry of the task, [BOS] prompt [SEP] answer; the demo's Task reads it from here.
    @property
    def variable_length(self) -> bool:
        """Answers end at an EOS token, so sequences differ in length."""
        return self.task == "dedup"

    @property
    def prompt_len(self) -> int:
        return 2 * self.digits + 1 if self.task == "add" else self.digits

    @property
    def answer_len(self) -> int:
        """Answer tokens (the most a variable-length answer may take, EOS included)."""
        return self.digits + 1 if self.task in ("add", "dedup") else self.digits

    @property
    def total_len(self) -> int:
        """Tokens per sequence; the model reads total_len - 1 of them."""
        return self.prompt_len + self.answer_len + 2

    @property
    def vocab_size(self) -> int:
        """Digits 0..base-1, then BOS, SEP, PLUS and EOS."""
        return self.base + 4


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
    reward_budget_s: Optional[float] = config_field(
        None, "Seconds one step's scoring may take in all; the samples not scored by then are left out of the "
        "loss and counted in reward/budget_cut. The other ranks then wait for rank 0's batch in a process group "
        "of their own, whose timeout is run.dist_timeout_s plus this budget, so a slow reward needs no longer "
        "collective timeout for the trainer. null: what generation leaves of 0.9 x run.dist_timeout_s.")
    reward_workers: int = config_field(
        1, "Worker processes that score a step's samples at the same time (each sample goes to a free one), "
        "for a reward slower than its pipe: a verifier, a sandbox, a judge.")
    eval_prompts: Optional[str] = config_field(
        None, "Held-out prompts (JSONL or Parquet, the fields of data.prompts), scored by data.reward on the "
        "engine at run.eval_interval; never trained on (a prompt also in data.prompts is refused at --check). "
        "null = no evaluation. A relative path is resolved against the directory the run starts in.")

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("prompts", "eval_prompts"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, str(Path(getattr(self, name)).expanduser().absolute()))
        if self.eval_prompts is not None and self.prompts is None:
            raise ValueError("data.eval_prompts holds out prompts of the data.prompts task: set data.prompts (and "
                             "rollout.engine: vllm), or remove data.eval_prompts")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens must be >= 1 (or null), got {self.max_prompt_tokens}")
        if not 0 < self.reward_timeout_s < math.inf:
            raise ValueError(f"data.reward_timeout_s must be finite and > 0, got {self.reward_timeout_s}")
        if self.reward_budget_s is not None and not 0 < self.reward_budget_s < math.inf:
            raise ValueError(f"data.reward_budget_s must be finite and > 0 (or null), got {self.reward_budget_s}")
        if self.reward_workers < 1:
            raise ValueError(f"data.reward_workers must be >= 1, got {self.reward_workers}")
        if self.prompts is not None and not self.reward:
            raise ValueError("data.prompts needs data.reward: 'package.module:function' or 'file.py:function' "
                             "(e.g. megatron_cispo.rollout.arith:exact_match)")
        if self.reward and self.prompts is None:
            raise ValueError("data.reward scores completions of data.prompts; set data.prompts (or remove "
                             "data.reward: the synthetic task scores itself with rollout.reward)")


def check_data_rollout(data: DataConfig, rollout, model) -> None:
    """ValueError (one line) for a data/rollout/model combination that cannot run."""
    spec = engine_spec(rollout.engine)
    if spec.prompt_files and data.prompts is None:
        raise ValueError(f"rollout.engine={rollout.engine!r} samples prompts from a file: set data.prompts and "
                         "data.reward (e.g. yaml_configs/vllm_qwen2_tiny.yaml), or use rollout.engine: hf for the "
                         "synthetic task")
    if data.prompts is not None and not spec.prompt_files:
        raise ValueError(f"data.prompts is sampled by vLLM: set rollout.engine: vllm (got {rollout.engine!r}); "
                         "the torch and hf samplers run the synthetic task only")
    listed = rollout.engine_gpus is not None or rollout.placement != "local"
    if rollout.engines > 1 and not listed and runs_on_cuda(model):
        raise ValueError(f"rollout.engines={rollout.engines} on CUDA GPUs would put every replica on rank 0's GPU: "
                         "give each its GPU in rollout.engine_gpus (e.g. [0, 1]: colocated with local ranks 0 and 1)")
    if rollout.filter_groups and data.prompts is None:
        raise ValueError("rollout.filter_groups drops and refills groups of data.prompts samples (rollout.engine: "
                         "vllm); the synthetic task has no prompt stream to refill from: set it false")
    if data.prompts is None:
        return
    if rollout.credit == "token":
        raise ValueError("rollout.credit='token' needs the synthetic task's per-position correctness; "
                         "with data.prompts use credit: sequence")
    if rollout.vllm:
        check_options(rollout.vllm)
        if engine_len(rollout.vllm, model.seq_length) > model.seq_length:
            raise ValueError(f"rollout.vllm.max_model_len={rollout.vllm['max_model_len']} exceeds model.seq_length="
                             f"{model.seq_length}, the longest row the trainer trains; lower it (or remove it)")
    length, where = engine_length(rollout, model)
    longest = length - rollout.max_new_tokens
    if longest < 1:
        raise ValueError(f"rollout.max_new_tokens={rollout.max_new_tokens} leaves no room for a prompt in "
                         f"{where}={length}; lower rollout.max_new_tokens")
    if data.max_prompt_tokens is not None and data.max_prompt_tokens > longest:
        raise ValueError(f"data.max_prompt_tokens={data.max_prompt_tokens} + rollout.max_new_tokens="
                         f"{rollout.max_new_tokens} exceeds {where}={length}; lower either")
