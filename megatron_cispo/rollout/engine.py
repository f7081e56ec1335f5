"""The rollout engine protocol and the engines by name: what every engine does, and what each one can.

    spec = engine_spec(cfg.rollout.engine)              # one line naming the registered engines if unknown
    eng = spec.open(EngineStart(model=cfg.model, precision="fp32", seed=0, ...))
    eng.update_weights(stream_buckets(chunks, namer=spec.namer(arch), bucket_bytes=n), manifest=..., bucket_bytes=n)
    out = eng.generate([[1, 5, 7], [1, 9]], Sampling(n=4, max_new_tokens=8, seeds=[0, 4]))   # out[i][j]: Completion
    eng.close()

An engine takes the trainer's weights as a stream of named buckets (weight_stream.Bucket; the names
its spec's `names` says: megatron's full tensors or the HF export mapping) and loads them all or
nothing: a stream that fails partway leaves it on its previous complete weights. generate() samples
n completions per prompt (token ids), sample j of prompt i keyed by seeds[i] + j, so the same seeds and
weights give the same completions on every engine of a kind.

The spec is the engine's rules, read where the config is checked (runner/data.py, runner/experiment.py)
and nowhere else. Adding an engine is one file with an `open_engine(start) -> Engine` and one
register_engine(EngineSpec(...)) line: here for the shipped ones, in a run.plugins module for yours.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Protocol

from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """How generate() samples: n per prompt, at most max_new_tokens each, stopping after any of
    stop_token_ids (the stop token kept). temperature applies before top_k / top_p (0 and 1 are off);
    temperature 0 is greedy. seeds: one per prompt, at least n apart."""

    n: int
    max_new_tokens: int
    seeds: list[int]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)

    @property
    def filtered(self) -> bool:
        """top_k or top_p cuts the distribution: completions carry their kept sets."""
        return self.top_k > 0 or self.top_p < 1.0


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # the sampled tokens, the stop token included when it ended the sample
    logprobs: list[float]  # per token: the processed logprob (temperature, top-k/top-p, renormalised)
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens)
    kept: Optional[list[list[int]]] = None  # per token the kept set's ids, ascending (top-k/top-p on)
    routes: Optional[Tensor] = None  # MoE engines: [prompt + completion - 1 fed tokens, moe layers, k] int64


class Engine(Protocol):
    def update_weights(self, buckets: Iterable, *, manifest: dict[str, tuple[int, ...]], bucket_bytes: int) -> dict:
        """Load every tensor of `manifest` from the stream, all or nothing; {"sync/seconds", "sync/bytes", ...}."""

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        """[prompt][sample] completions of `prompts` on the last complete weights."""

    def close(self) -> None:
        """Free the engine (idempotent); any call after it raises."""


@dataclass(frozen=True)
class EngineStart:
    """What an engine needs to start: the trainer's model (runner.model.ModelConfig; .arch for an HF
    family), the sampler's precision ("fp32" | "bf16"), its seed, its longest row, and for an engine in
    its own process the limits and the log (rollout.vllm's options in `options`)."""

    model: Any
    precision: str
    seed: int
    max_model_len: int
    kept_sets: bool = False
    device: Any = "cpu"
    log_path: Optional[str] = None
    start_timeout_s: float = 900.0
    call_timeout_s: float = 3600.0
    options: dict = field(default_factory=dict)
    gpu: Optional[int] = None  # rollout.engine_gpus: the GPU (an index among the node's) an engine process sees


@dataclass(frozen=True)
class EngineSpec:
    """A registered engine and its rules. opener: "module:function", imported on first open.

    hf_model: it serves model.hf_path's family (else the synthetic GPT, model.hf_path unset).
    prompt_files: it samples data.prompts scored by data.reward (else the synthetic task, rollout.task).
    overlaps: it runs beside the trainer (its own process), so rollout.mode=async can use it.
    routes: it returns MoE routes (Completion.routes), so loss.routing_replay=rollout can use it.
    names: how its weights are named in the stream: "hf" (the export mapping) or "megatron".
    disk: it can also reload an exported HF directory (rollout.sync: disk, the fallback).
    replicas: several of it can run at once (rollout.engines > 1: engine_pool.py).
    options: the rollout.<options> key of its own settings, passed through (None: it takes none).
    check: "module:function", check(cfg) -> None or one line: what the engine itself refuses at --check
    (installed? can it serve this model here?), before any rank starts.
    max_params: the largest model it serves (parameters), with the reason (max_params_why); a larger
    model.hf_path is refused where the config is read, in one line naming both.
    """

    name: str
    opener: str
    hf_model: bool
    prompt_files: bool
    overlaps: bool
    routes: bool
    names: str = "hf"
    disk: bool = False
    replicas: bool = False
    options: Optional[str] = None
    check: Optional[str] = None
    max_params: Optional[float] = None
    max_params_why: str = ""

    def open(self, start: EngineStart) -> Engine:
        module, _, fn = self.opener.partition(":")
        return getattr(importlib.import_module(module), fn)(start)

    def problem(self, cfg) -> Optional[str]:
        """What the engine refuses for experiment `cfg` (its `check`), or None."""
        if self.check is None:
            return None
        module, _, fn = self.check.partition(":")
        return getattr(importlib.import_module(module), fn)(cfg)

    def namer(self, arch):
        """The weight stream's namer for this engine (weight_stream.hf_namer or megatron_namer)."""
        from .weight_stream import hf_namer, megatron_namer

        return hf_namer(arch) if self.names == "hf" else megatron_namer


ENGINES: dict[str, EngineSpec] = {}


def push_in_parts(engine, buckets: Iterable, *, manifest: dict, bucket_bytes: int, stage=None) -> dict:
    """update_weights for an engine in its own process, from its parts (begin_update, add_bucket(stage(bucket),
    index), finish_update; abort_update when the stream fails): every bucket, all or nothing. Returns
    {"sync/seconds", "sync/bytes", "sync/buckets"}."""
    import time

    t0, nbytes, count = time.perf_counter(), 0, 0
    engine.begin_update(manifest, bucket_bytes)
    try:
        for bucket in buckets:
            engine.add_bucket(stage(bucket) if stage else bucket, count)
            nbytes, count = nbytes + bucket.data.numel(), count + 1
    except BaseException:
        engine.abort_update()
        raise
    engine.finish_update()
    return {"sync/seconds": time.perf_counter() - t0, "sync/bytes": float(nbytes), "sync/buckets": float(count)}


def runs_on_cuda(model) -> bool:
    """Whether a run of `model` (runner.model.ModelConfig) is on CUDA GPUs: a Transformer Engine recipe (TE
    runs on CUDA only), or CUDA here. --check of a GPU recipe on a CPU login node then judges it for the GPUs
    it will run on."""
    import torch

    return model.transformer_impl == "te" or torch.cuda.is_available()


def register_engine(spec: EngineSpec) -> EngineSpec:
    if spec.names not in ("hf", "megatron"):
        raise ValueError(f"engine {spec.name!r}: names must be 'hf' or 'megatron', got {spec.names!r}")
    ENGINES[spec.name] = spec
    return spec


def engine_spec(name: str) -> EngineSpec:
    """The registered engine `name`; ValueError in one line naming the registered ones."""
    if name not in ENGINES:
        raise ValueError(f"rollout.engine={name!r} is not a registered engine; registered: {sorted(ENGINES)} "
                         "(a plugin registers one with megatron_cispo.rollout.engine.register_engine)")
    return ENGINES[name]


register_engine(EngineSpec("torch", "megatron_cispo.rollout.torch_engine:open_engine", hf_model=False,
                           prompt_files=False, overlaps=False, routes=True, names="megatron"))
# The hf engine is for checking a family end to end, not for serving: measured by the memory plan
# (runner/memory_plan.py, docs/launch.md), an 8B model's push alone needs 30.5 GiB on rank 0 beside its trainer.
register_engine(EngineSpec("hf", "megatron_cispo.rollout.hf_engine:open_engine", hf_model=True,
                           prompt_files=False, overlaps=False, routes=True, max_params=4e9,
                           max_params_why="it gathers the whole model on rank 0 at every weight push, rebuilds "
                           "transformers' copy of it there and generates without a paged KV cache"))
register_engine(EngineSpec("vllm", "megatron_cispo.rollout.vllm_engine:open_engine", hf_model=True,
                           prompt_files=True, overlaps=True, routes=False, disk=True, replicas=True, options="vllm",
                           check="megatron_cispo.rollout.vllm_engine:start_problem"))
