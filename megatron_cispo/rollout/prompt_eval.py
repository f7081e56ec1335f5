"""PromptSampler's held-out evaluation (rollout/prompt_sampler.py): data.eval_prompts sampled on the engine with
the trainer's current weights (greedy, or rollout.eval_samples at the rollout's temperature), scored by
data.reward with its own worker, the eval/ metrics given to every rank.
"""
from __future__ import annotations

import time

from .engine import Sampling
from .prompt_sources import _seed


class PromptEval:
    """The evaluation side of PromptSampler."""

    def _eval_on_engine(self, version: int) -> dict:
        """Rank 0, the engine on `version`: data.eval_prompts sampled (greedy, or rollout.eval_samples at the
        rollout's temperature) and scored by data.reward; the eval/ metrics."""
        r, k = self.cfg, self.cfg.eval_samples
        prompts = self.held_out.every()
        greedy = k == 1
        t0 = time.perf_counter()
        # seeds past any training prompt's (those are _seed(seed, stream index, group_size))
        base = _seed(self.seed, 0, 1) + 2**40
        out = self.engine_.generate([p.token_ids for p in prompts], Sampling(
            n=k, max_new_tokens=r.max_new_tokens, temperature=0.0 if greedy else r.temperature,
            top_k=0 if greedy else r.top_k, top_p=1.0 if greedy else r.top_p,
            seeds=[base + i * k for i in range(len(prompts))], stop_token_ids=self.eos))
        completions = [c for per_prompt in out for c in per_prompt]
        rewards, scored = self._scores(prompts, completions, self.reward_budget_s or self.limit_s / 2, group=k,
                                       held_out=True)
        exact = [x == 1 for x in rewards]
        info = {"eval/version": float(version), "eval/seconds": time.perf_counter() - t0,
                "eval/reward_mean": sum(x for x in rewards if x is not None) / max(1, sum(x is not None for x in rewards)),
                "eval/accuracy": sum(exact) / len(exact), "eval/prompts": float(len(prompts)),
                "eval/scored_frac": sum(x is not None for x in rewards) / len(rewards)}
        if k > 1:
            info[f"eval/pass@{k}"] = sum(any(exact[i * k:(i + 1) * k]) for i in range(len(prompts))) / len(prompts)
        return info

    def evaluate(self, version: int) -> dict:
        """Collective: the eval/ metrics of policy version `version` (the live parameters) on data.eval_prompts,
        computed by rank 0 on the engine and given to every rank; RolloutFailed alike on every rank."""
        box: list = [None]
        try:
            if self.cfg.mode == "async":  # the engine holds the live version since the last push
                if self.rank == 0:
                    box[0] = self.feed.exclusive(lambda: self._eval_on_engine(version))
            elif self.cfg.sync == "stream":
                synced, error = self._stream_to_engine(version) if self.loaded != version else ({}, None)  # collective
                if self.rank == 0:
                    if error:
                        raise RuntimeError(error)
                    box[0] = {**self._eval_on_engine(version),
                              **{f"eval/{k.replace('/', '_')}": v for k, v in synced.items()}}  # its own push
            elif self.rank == 0:
                self._engine_at(version)
                box[0] = self._eval_on_engine(version)
        except Exception as e:  # noqa: BLE001 - the engine or the reward failed: every rank stops
            box[0] = f"[{self.exp.label}] evaluation of policy version {version} failed: {e}"
        return self._share(box)
