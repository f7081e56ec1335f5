"""What the vLLM sampler reads and builds, apart from the sampler: the prompt files (data.prompts and
data.eval_prompts, checked at --check), the EOS ids, each prompt's vLLM seed, and the trainer batch made
from vLLM's completions.

    sources = check_sources(cfg)            # before any rank starts: ValueError, one line
    batch = rows_to_batch(rows, rewards, group_size=g, version=v, info={})
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..kept_set import KeptSet
from .prompts import PromptStream, has_tokenizer, read_prompts
from .vllm_options import prompt_limit
from .sampler import PAD, Batch
from .task import group_advantages


# Test-only: "push:<version>" (after the first bucket of that version's push) or "generate:<step>" (the
# 0-based step's rollout, its prompts taken, before vLLM generates): rank 0 writes run_dir/test_paused
# and sleeps, so a test can SIGKILL the run at that point. Unset: nothing.
TEST_PAUSE_ENV = "CISPO_TEST_PAUSE_IN"


def _pause_for_tests(run_dir, where: str, n: int) -> None:
    if os.environ.get(TEST_PAUSE_ENV) == f"{where}:{n}":
        (Path(run_dir) / "test_paused").write_text(f"{where}:{n}\n")
        time.sleep(600)


class RolloutFailed(RuntimeError):
    """The rollout engine failed; raised alike on every rank after rank 0 printed the one line."""


@dataclass(frozen=True)
class Sources:
    """What check_sources read, for the sampler to keep: the training prompts and the held-out ones."""

    prompts: PromptStream
    eval: Optional[PromptStream] = None  # data.eval_prompts


def open_prompts(cfg, held_out: bool = False) -> PromptStream:
    """data.prompts (held_out: data.eval_prompts) tokenized with model.hf_path's tokenizer; ValueError (one
    line) for a bad file or row."""
    d = cfg.data
    limit, limit_name = prompt_limit(d, cfg.rollout, cfg.model)
    return PromptStream(d.eval_prompts if held_out else d.prompts, tokenizer_path=cfg.model.hf_path,
                        seed=cfg.run.seed, split="train" if held_out else d.split, prompt_key=d.prompt_key,
                        chat_template=d.chat_template, max_prompt_tokens=limit, limit_name=limit_name,
                        setting="data.eval_prompts" if held_out else "data.prompts")


def _held_out(train_texts: list[str], held_texts: list[str], held_path) -> None:
    """ValueError (one line) naming the first held-out prompt that is also a training prompt."""
    seen = set(train_texts)
    for i, text in enumerate(held_texts):
        if text in seen:
            raise ValueError(f"data.eval_prompts={held_path}: row {i} ({text[:40]!r}) is also in data.prompts: "
                             "held-out prompts must never be trained on; remove it from one of the files")


def check_sources(cfg, *, untokenized: bool = False) -> Optional[Sources]:
    """ValueError (one line) for what data.prompts, data.eval_prompts, data.reward and rollout.engine=vllm
    need and lack: vLLM not installed, Ray (rollout.placement: ray) not installed or no cluster at its
    address, the prompt files, their rows, a held-out prompt also trained on, the reward's import. Before
    any rank starts. Returns what it read (None without data.prompts). untokenized (--check): a
    model.hf_path without tokenizer files (a config-only directory) checks the rows but not their lengths
    in tokens, and returns None; otherwise it is refused."""
    from .engine import engine_spec

    spec = engine_spec(cfg.rollout.engine)
    if not spec.prompt_files:
        return None
    from .rewards import load_reward

    d, sources = cfg.data, None
    if untokenized and not has_tokenizer(cfg.model.hf_path):
        texts = read_prompts(Path(d.prompts).absolute(), d.split, d.prompt_key)[1]
        if d.eval_prompts:
            path = Path(d.eval_prompts).absolute()
            _held_out(texts, read_prompts(path, "train", d.prompt_key, "data.eval_prompts")[1], path)
    else:
        stream = open_prompts(cfg)
        held = open_prompts(cfg, held_out=True) if d.eval_prompts else None
        if held is not None:
            _held_out(stream.texts, held.texts, held.path)
        new = cfg.rollout.max_new_tokens  # the trainer reads prompt + new - 1 tokens of a row
        cfg.parallelism.check_row_fits(stream.max_len + new - 1,
                                       f"the longest row ({stream.max_len} prompt + {new} new - 1)")
        sources = Sources(stream, held)
    load_reward(d.reward)
    from .ray_engines import placement_problem

    problem = spec.problem(cfg) or placement_problem(cfg.rollout)
    if cfg.rollout.sync == "stream":
        from .weight_stream import bucket_problem

        problem = problem or bucket_problem(
            cfg.model.arch, cfg.rollout.sync_bucket_mb, tp=cfg.parallelism.tp)
    if problem:
        raise ValueError(problem)
    return sources


def eos_ids(model_dir: str) -> list[int]:
    """The ids that end a sample: generation_config.json's eos_token_id (an int or a list, as chat models
    give several), else config.json's; [] = samples end at rollout.max_new_tokens only."""
    for name in ("generation_config.json", "config.json"):
        f = Path(model_dir) / name
        eos = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


def _seed(run_seed: int, index: int, group_size: int) -> int:
    """vLLM's seed for stream position `index` (its samples take seed + 0 .. group_size - 1): a function
    of the position, so a resumed run samples the same prompt alike, and never shared between prompts."""
    base = int.from_bytes(hashlib.sha256(f"vllm:{run_seed}".encode()).digest()[:4], "little") >> 2
    return base + index * group_size


def rows_to_batch(rows, rewards: list, *, group_size: int, version: int, info: dict) -> Batch:
    """Right-padded rows [prompt, completion], the completion's targets in the loss (unless its reward failed)."""
    n, g = len(rows), group_size
    total = max(len(p) + len(c.token_ids) for p, c in rows)
    tokens = torch.full((n, total), PAD, dtype=torch.int64)
    mask = torch.zeros(n, total - 1, dtype=torch.bool)
    logps = torch.zeros(n, total - 1)
    kept: list[list[int]] = [[] for _ in range(n * (total - 1))] if rows[0][1].kept is not None else None
    for i, (p, c) in enumerate(rows):
        row = list(p) + list(c.token_ids)
        tokens[i, :len(row)] = torch.tensor(row)
        span = slice(len(p) - 1, len(row) - 1)  # targets of the completion's tokens
        logps[i, span] = torch.tensor(c.logprobs, dtype=torch.float32)
        mask[i, span] = rewards[i] is not None
        if kept is not None and rewards[i] is not None:
            for j, ids in enumerate(c.kept):
                kept[i * (total - 1) + len(p) - 1 + j] = sorted(ids)
    lengths = torch.tensor([len(p) + len(c.token_ids) for p, c in rows])
    ok = torch.tensor([x is not None for x in rewards])
    r = torch.tensor([x if x is not None else 0.0 for x in rewards], dtype=torch.float32)
    info["reward/scored_frac"] = ok.float().mean().item()
    advantages = group_advantages(r, g, scored=ok)  # a failed sample moves no other's advantage
    truncated = [c.finish_reason == "length" for _, c in rows]
    info.update({"rollout/truncated_frac": sum(truncated) / n,
                 "rollout/new_tokens_mean": sum(len(c.token_ids) for _, c in rows) / n})
    keep = KeptSet.from_lists(kept) if kept is not None else None
    return Batch(tokens=tokens, lengths=lengths, loss_mask=mask, rollout_logprobs=logps.masked_fill(~mask, 0.0),
                 rewards=r.masked_fill(~ok, torch.nan), advantages=advantages, correct=((r == 1) & ok)[:, None],
                 version=version, sample_versions=torch.full((n,), version, dtype=torch.int64),
                 keep=keep, info=info)
