"""What the in-process engines (torch_engine.py, hf_engine.py) share: weights from the bucket stream, all
or nothing, and sampling from their logits the way vLLM samples.

    class MyEngine(InProcessEngine):
        def _load(self, tensors): ...                       # {stream name: full tensor}, complete
        def logits(self, tokens, routes=None): ...          # [b, s] int64 -> [b, s, V]

Sample j of prompt i draws its uniforms from a generator keyed by (engine seed, "sample", seeds[i] + j),
so a row's draws do not depend on the batch it is in. The whole prefix is recomputed per token (no KV
cache): these engines serve the demo's and the tests' short rows. Temperature applies before top-k /
top-p, and the logprobs are over the kept set (vLLM's processed_logprobs).
"""
from __future__ import annotations

import time
from typing import Iterable, Optional

import torch
from torch import Tensor

from .engine import Completion, Sampling
from .task import keyed_generator
from .weight_receiver import Staging


def top_k_top_p(logits: Tensor, k: int, p: float) -> Tensor:
    """logits [n, V] with -inf outside the kept set, as vLLM's apply_top_k_top_p (vllm/v1/sample/
    ops/topk_topp_sampler.py) filters them: top-k keeps every logit >= the k-th largest (ties
    kept); top-p then drops the tokens whose ascending cumulative probability (after top-k) is
    <= 1 - p, never the most likely. k = 0 and p = 1 are off."""
    if k <= 0 and p >= 1.0:
        return logits
    srt, idx = logits.sort(-1)  # ascending
    if 0 < k < srt.shape[-1]:
        srt = srt.masked_fill(srt < srt[:, -k, None], -torch.inf)
    if p < 1.0:
        drop = srt.softmax(-1).cumsum(-1) <= 1 - p
        drop[:, -1] = False
        srt = srt.masked_fill(drop, -torch.inf)
    return srt.scatter(-1, idx, srt)


class InProcessEngine:
    moe = False  # True: logits(routes=) fills each MoE layer's experts and completions carry routes

    def __init__(self, *, seed: int, device="cpu"):
        self.seed, self.device = seed, device
        self.ready = False  # complete weights loaded
        self.closed = False

    def _load(self, tensors: dict[str, Tensor]) -> None:
        raise NotImplementedError

    def logits(self, tokens: Tensor, routes: Optional[list] = None) -> Tensor:
        raise NotImplementedError

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"{type(self).__name__}: {what} on a closed engine")

    def update_weights(self, buckets: Iterable, *, manifest: dict[str, tuple[int, ...]], bucket_bytes: int) -> dict:
        """Every manifest tensor from the stream, then loaded at once: a stream that raises or ends short
        leaves the previous weights in place (the staging is dropped)."""
        self._check_open("a weight update")
        t0, staging, nbytes, count = time.perf_counter(), Staging(manifest), 0, 0
        for bucket in buckets:
            staging.add(bucket.blocks, bucket.data)
            nbytes, count = nbytes + bucket.data.numel(), count + 1
        self._load(staging.complete())
        self.ready = True
        return {"sync/seconds": time.perf_counter() - t0, "sync/bytes": float(nbytes), "sync/buckets": float(count)}

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        self._check_open("generate")
        if not self.ready:
            raise RuntimeError(f"{type(self).__name__}: generate before any weights were loaded")
        if len(sampling.seeds) != len(prompts):
            raise ValueError(f"seeds: one per prompt, got {len(sampling.seeds)} for {len(prompts)} prompts")
        rows = [(i, j) for i in range(len(prompts)) for j in range(sampling.n)]
        out: list[list[Optional[Completion]]] = [[None] * sampling.n for _ in prompts]
        by_len: dict[int, list[tuple[int, int]]] = {}
        for i, j in rows:
            by_len.setdefault(len(prompts[i]), []).append((i, j))
        for group in by_len.values():  # rows of one prompt length share each forward
            tokens = torch.tensor([prompts[i] for i, _ in group], dtype=torch.long)
            keys = [sampling.seeds[i] + j for i, j in group]
            for (i, j), c in zip(group, self._sample(tokens, keys, sampling)):
                out[i][j] = c
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def _sample(self, prompts: Tensor, keys: list[int], s: Sampling) -> list[Completion]:
        n, a, plen = prompts.shape[0], s.max_new_tokens, prompts.shape[1]
        u = torch.stack([torch.rand(a, generator=keyed_generator(self.seed, "sample", k)) for k in keys]).to(self.device)
        tokens, logps, kept, routes = prompts.to(self.device), [], [], []
        for j in range(a):
            layers: Optional[list] = [] if self.moe else None
            logits = self.logits(tokens, routes=layers) if self.moe else self.logits(tokens)
            if self.moe:  # as a KV-cached engine computes them: the prompt's at the prefill, then one per token
                routes.append(torch.stack(layers, 2)[:, (0 if j == 0 else -1):])
            if s.temperature == 0:  # greedy: the most likely token, its logprob unscaled
                logp = torch.log_softmax(logits[:, -1].float(), -1)
                nxt = logp.argmax(-1, keepdim=True)
                finite = torch.ones_like(logp, dtype=torch.bool)
            else:
                last = top_k_top_p(logits[:, -1].float() / s.temperature, s.top_k, s.top_p)
                logp = torch.log_softmax(last, -1)
                cdf = logp.exp().cumsum(-1)
                # right: a draw never lands on a token of zero probability (one outside the kept set)
                nxt = torch.searchsorted(cdf, (u[:, j] * cdf[:, -1]).unsqueeze(1), right=True)
                nxt.clamp_(max=last.shape[-1] - 1)
                finite = torch.isfinite(last)
            logps.append(logp.gather(1, nxt).squeeze(1))
            kept.append(finite)
            tokens = torch.cat([tokens, nxt], 1)
            if s.stop_token_ids and torch.isin(tokens[:, plen:], torch.tensor(s.stop_token_ids, device=tokens.device)).any(1).all():
                break  # every row has stopped
        new, lps = tokens[:, plen:].cpu(), torch.stack(logps, 1).cpu()
        kept_t = torch.stack(kept, 1).cpu() if s.filtered else None
        routed = torch.cat(routes, 1).cpu() if self.moe else None
        stops = set(s.stop_token_ids)
        out = []
        for r in range(n):
            ids = new[r].tolist()
            m = next((t + 1 for t, x in enumerate(ids) if x in stops), len(ids))
            reason = "stop" if m <= len(ids) and ids[m - 1] in stops else "length"
            out.append(Completion(
                token_ids=ids[:m], logprobs=lps[r, :m].tolist(), finish_reason=reason,
                kept=None if kept_t is None else [kept_t[r, t].nonzero()[:, 0].tolist() for t in range(m)],
                routes=None if routed is None else routed[r, :plen + m - 1]))
        return out

    def close(self) -> None:
        self.closed, self.ready = True, False
        self._drop()

    def _drop(self) -> None:
        """Free the model's tensors (close)."""
