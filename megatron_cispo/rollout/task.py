"""A verifiable synthetic task: digit strings to copy, reverse, sort, add or dedup, scored programmatically.

A sequence is [BOS] prompt [SEP] answer in a [n, total_len] tensor. copy/reverse/sort/add answers
have a fixed length; dedup answers (the distinct digits, increasing, then EOS) end at the first
EOS, and the rest of the row is padding (`PAD`, past the row's length). Prompts are drawn from
generators keyed by (seed, step, prompt index), never by rank, so every parallel layout sees the
same data.
"""
from __future__ import annotations

import hashlib

import torch
from torch import Tensor

PAD = 0  # written past a row's end; a digit id, but `lengths` mark it as not part of the row


def keyed_generator(*key: object) -> torch.Generator:
    """A CPU generator seeded from a hash of `key` (e.g. seed, step, global sample index)."""
    digest = hashlib.sha256(":".join(map(str, key)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


class Task:
    """Token ids: digits 0..base-1, then BOS, SEP, PLUS (for `add`) and EOS (for `dedup`)."""

    def __init__(self, cfg):  # cfg: runner.data.RolloutConfig, which also holds the geometry
        self.cfg = cfg
        self.base = cfg.base
        self.bos, self.sep, self.plus, self.eos = self.base, self.base + 1, self.base + 2, self.base + 3
        self.vocab_size = cfg.vocab_size
        self.variable_length = cfg.variable_length
        self.prompt_len, self.answer_len = cfg.prompt_len, cfg.answer_len  # answer_len: the most, EOS included
        self.total_len = cfg.total_len  # tokens per sequence (the longest, for variable-length tasks)
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
        """[n, answer_len] int64 reference answers for prompts from `prompts()` (dedup: PAD after EOS)."""
        body = prompts[:, 1:-1]
        task = self.cfg.task
        if task == "copy":
            return body.clone()
        if task == "reverse":
            return body.flip(1)
        if task == "sort":
            return body.sort(1).values
        if task == "dedup":
            return self._dedup(body)
        d = self.cfg.digits
        place = self.base ** torch.arange(d)  # operands are written most significant digit first
        a, b = (body[:, :d].flip(1) * place).sum(1), (body[:, d + 1:].flip(1) * place).sum(1)
        total = a + b
        return torch.stack([(total // self.base ** k) % self.base for k in range(d + 1)], 1)  # LSB first

    def _dedup(self, body: Tensor) -> Tensor:
        n, digits = body.shape
        present = torch.zeros(n, self.base, dtype=torch.bool).scatter_(1, body, True)
        k = present.sum(1, keepdim=True)  # distinct digits per row, <= min(base, digits)
        # present digits first, in increasing order; absent ones sort last (as `base`)
        distinct = torch.where(present, torch.arange(self.base), self.base).sort(1).values
        out = torch.full((n, self.answer_len), PAD, dtype=torch.int64)
        m = min(self.base, digits)
        out[:, :m] = distinct[:, :m]
        j = torch.arange(self.answer_len)
        return torch.where(j < k, out, torch.where(j == k, self.eos, PAD))

    def answer_lengths(self, answers: Tensor) -> Tensor:
        """answers: [n, answer_len] -> [n] int64 answer tokens up to and including the first EOS
        (answer_len when there is none, and always for fixed-length tasks)."""
        n, a = answers.shape
        if not self.variable_length:
            return torch.full((n,), a, dtype=torch.int64)
        is_eos = answers == self.eos
        return torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, a).long()

    def lengths(self, tokens: Tensor) -> Tensor:
        """tokens: [n, total_len] -> [n] int64 real tokens per row: BOS, prompt, SEP and the answer
        through its first EOS (total_len for fixed-length tasks and for answers without EOS)."""
        return self.prompt_len + 2 + self.answer_lengths(tokens[:, -self.answer_len:])

    def rewards(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """tokens: [n, total_len] -> (reward [n] fp32, per-position correctness [n, answer_len] bool).

        The generated answer is the tokens through the first EOS (variable-length tasks), so padding
        after it is never read. Position j is correct when it is inside both the reference and the
        generated answer and the tokens agree. per_position: correct positions over the longer of
        the two answers (a length mismatch costs the unmatched positions); exact_match: 1 when the
        answers are identical, EOS included. Fixed-length tasks: the fraction of positions right.
        """
        ref = self.answers(tokens[:, : self.prompt_len + 2])
        gen = tokens[:, -self.answer_len:]
        ref_len, gen_len = self.answer_lengths(ref), self.answer_lengths(gen)
        j = torch.arange(self.answer_len)
        correct = (gen == ref) & (j < torch.minimum(ref_len, gen_len)[:, None])
        hits = correct.sum(1)
        if self.cfg.reward == "exact_match":
            return ((hits == ref_len) & (gen_len == ref_len)).float(), correct
        return hits.float() / torch.maximum(ref_len, gen_len).float(), correct

    def loss_mask(self, lengths: Tensor) -> Tensor:
        """lengths: [n] (from `lengths()`) -> [n, total_len - 1] bool, True on the answer's target
        positions inside each row: targets prompt_len + 1 .. lengths - 2."""
        t = torch.arange(self.total_len - 1)
        return (t >= self.prompt_len + 1) & (t < lengths[:, None] - 1)


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6, scored: Tensor | None = None) -> Tensor:
    """[n] or [n, k] rewards of consecutive groups of rows -> (r - group mean) / (group std + eps).

    Statistics are per column (per answer position for [n, k]); uniform groups get 0. scored ([n] bool,
    optional): only those rows count in their group's mean and std, and the others get 0 (a prompt-file
    reward that failed: left out of the loss, it moves no other row's advantage).
    """
    r = rewards.float().reshape(-1, group_size, *rewards.shape[1:])
    if scored is None:
        adv = (r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + eps)
        return adv.reshape(rewards.shape)
    w = scored.float().reshape(-1, group_size, *[1] * (r.dim() - 2)).expand_as(r)
    count = w.sum(1, keepdim=True).clamp(min=1)
    mean = (r * w).sum(1, keepdim=True) / count
    std = (((r - mean) ** 2 * w).sum(1, keepdim=True) / count).sqrt()
    return ((r - mean) / (std + eps) * w).reshape(rewards.shape)
