"""A verifiable synthetic task: digit strings to copy, reverse, sort or add, scored programmatically.

A sequence is [BOS] prompt [SEP] answer with fixed lengths, so a batch is one [n, seq_len]
tensor. Prompts are drawn from generators keyed by (seed, step, prompt index), never by rank,
so every parallel layout sees the same data.
"""
from __future__ import annotations

import hashlib

import torch
from torch import Tensor


def keyed_generator(*key: object) -> torch.Generator:
    """A CPU generator seeded from a hash of `key` (e.g. seed, step, global sample index)."""
    digest = hashlib.sha256(":".join(map(str, key)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


class Task:
    """Token ids: digits 0..base-1, then BOS, SEP and PLUS (for `add`)."""

    def __init__(self, cfg):  # cfg: runner.experiment.RolloutConfig, which also holds the geometry
        self.cfg = cfg
        self.base = cfg.base
        self.bos, self.sep, self.plus = self.base, self.base + 1, self.base + 2
        self.vocab_size = cfg.vocab_size
        self.prompt_len, self.answer_len = cfg.prompt_len, cfg.answer_len
        self.total_len = cfg.total_len  # tokens per sequence
        self.seq_len = self.total_len - 1  # model input length (tokens[:, :-1])

    def prompts(self, seed: int, step: int, n: int) -> Tensor:
        """[n, 2 + prompt_len] int64: BOS, prompt, SEP for prompts 0..n-1 of `step`."""
        rows = []
        for i in range(n):
            g = keyed_generator(seed, "prompt", step, i)
            digits = torch.randint(self.base, (self.prompt_len,), generator=g)
            if self.cfg.task == "add":
                digits[self.cfg.digits] = self.plus
            rows.append(torch.cat([torch.tensor([self.bos]), digits, torch.tensor([self.sep])]))
        return torch.stack(rows)

    def answers(self, prompts: Tensor) -> Tensor:
        """[n, answer_len] reference answers for prompts from `prompts()`."""
        body = prompts[:, 1:-1]
        task = self.cfg.task
        if task == "copy":
            return body.clone()
        if task == "reverse":
            return body.flip(1)
        if task == "sort":
            return body.sort(1).values
        d = self.cfg.digits
        place = self.base ** torch.arange(d)  # operands are written most significant digit first
        a, b = (body[:, :d].flip(1) * place).sum(1), (body[:, d + 1:].flip(1) * place).sum(1)
        total = a + b
        return torch.stack([(total // self.base ** k) % self.base for k in range(d + 1)], 1)  # LSB first

    def rewards(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """tokens: [n, total_len] -> (reward [n] fp32, per-position correctness [n, answer_len] bool)."""
        correct = tokens[:, -self.answer_len:] == self.answers(tokens[:, : self.prompt_len + 2])
        if self.cfg.reward == "exact_match":
            return correct.all(1).float(), correct
        return correct.float().mean(1), correct

    def loss_mask(self, n: int) -> Tensor:
        """[n, total_len - 1] bool: True on the answer's target positions."""
        mask = torch.zeros(n, self.total_len - 1, dtype=torch.bool)
        mask[:, -self.answer_len:] = True
        return mask


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """[n] or [n, k] rewards of consecutive groups of rows -> (r - group mean) / (group std + eps).

    Statistics are per column (per answer position for [n, k]); uniform groups get 0.
    """
    r = rewards.float().reshape(-1, group_size, *rewards.shape[1:])
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + eps)
    return adv.reshape(rewards.shape)
