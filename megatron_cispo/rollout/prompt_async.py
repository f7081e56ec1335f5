"""PromptSampler in rollout.mode=async (rollout/prompt_sampler.py): rank 0's feed (async_feed.py) generates and
scores the next steps' batches on its thread while the trainer trains; each push lands between two
generations; the checkpoint holds the prompt stream's position after the last batch trained or dropped.
"""
from __future__ import annotations

import time
from dataclasses import replace

from ..base.console import say
from .sampler import Batch


class PromptAsync:
    """The async side of PromptSampler (the engine and the reward are the feed thread's while it runs)."""

    def _feed_generate(self, index: int, version: int) -> tuple:
        prompts = self.stream.take(self.cfg.prompts_per_step)
        return version, time.perf_counter(), self._generate(index, prompts)

    def _feed_finish(self, raw: tuple) -> tuple[Batch, dict]:
        """(the batch, the stream's state after its prompts, refills included: this thread alone takes them)."""
        version, start, generated = raw
        return self._scored(generated, version, {}, start, engine=self.feed.engine), self.stream.state_dict()

    def _start_feed(self, step: int, version: int) -> None:
        from .async_feed import AsyncFeed

        self._trained_prompts = self.stream.state_dict()
        self.feed = AsyncFeed(self._feed_generate, self._feed_finish, staleness=self.cfg.staleness,
                              policy=self.cfg.stale_policy, first=step, last=self.exp.run.steps, version=version,
                              start=False)
        self.feed.start()  # after the assignment: _feed_finish's refills take self.feed.engine

    def _push_async(self, version: int) -> None:
        """Collective: version `version` streamed into the engine now, between two generations; rank 0
        keeps the metrics or the failure for the next rollouts() to report on every rank."""
        if self.rank != 0:
            self._stream_to_engine(version)
            return
        if self.feed is None:  # the first push (a start or a resume) starts the engine, then the feed
            info, error = self._stream_to_engine(version)
            if error is None:
                self._start_feed(version, version)
        else:
            def load():
                done, failed = self._stream_to_engine(version)
                if failed:
                    raise RuntimeError(failed)
                return done
            try:
                info, waited = self.feed.weights(version, load)
                info, error = {**info, "sync/wait_s": waited}, None
            except RuntimeError as e:
                info, error = {}, str(e)
        self._pushed = (info, self._pushed[1] or error)

    def _take_async(self, step: int) -> Batch:
        """Rank 0: the feed's batch for 0-based `step`, with the last push's and the feed's metrics."""
        info, error = self._pushed
        self._pushed = ({}, error)
        if error:
            raise RuntimeError(error)
        wait_s = self.limit_s + (self.reward_budget_s or 0)  # generation, then scoring within its own budget
        (batch, after), version, dropped, figures = self.feed.take(step, timeout_s=wait_s)
        self._trained_prompts = after  # past the dropped batches too: they came before it
        if dropped and not self._dropped_said:  # once: rollout/dropped_batches counts them every step
            self._dropped_said = True
            say(f"[{self.exp.label}] step {step + 1}: dropped {len(dropped)} rollout batch(es) that lagged more than "
                f"rollout.staleness={self.cfg.staleness} (rollout.stale_policy=drop); rollout/dropped_batches counts "
                f"them from here on")
        return replace(batch, info={**batch.info, **info, **figures})
