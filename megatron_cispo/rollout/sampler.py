"""The synthetic task's batch: a copy of the policy that lags the trainer by `staleness` versions.

    sampler.sync(version, full_state)                   # a version's full weights (unit tests; disk fallback)
    batch = sampler.rollouts(step)                      # global batch, sampled with version step - k

Sampler is the in-process core that TaskSampler (task_sampler.py: a run, rank 0's engine fed by the
weight stream) and PromptSampler build on. It never reads the trainer's live parameters: it samples
with its own temperature and precision (e.g. bf16 against an fp32 trainer) and returns its per-token
logprobs. rollout.engine picks the engine (engine.py's registry): torch (torch_engine.py, the synthetic
GPT) or hf (hf_engine.py: transformers' model of model.hf_path's family); a version reaches it through
the engine protocol, as named buckets (update_weights), and the batch comes from its generate(), sample
r of step t keyed by t * n + r, so every layout gets the same batch. Variable-length tasks still sample
answer_len tokens per row; a row ends at its first EOS (`Batch.lengths`). With rollout.top_k / top_p it
samples from the filtered distribution, as vLLM does, and returns the kept sets (compressed rows) and
the logprobs renormalised over them (sampling-mask replay).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..base.param_names import canonical_names
from ..kept_set import KeptSet
from .engine import Engine, EngineStart, Sampling, engine_spec
from .inprocess import top_k_top_p  # noqa: F401 - tests import it from here
from .task import PAD, Task, group_advantages
from .weight_stream import tensor_buckets


@dataclass(frozen=True, kw_only=True)
class Batch:
    """A global rollout batch of n = prompts * group sequences (up to total_len tokens each)."""

    tokens: Tensor            # [n, total_len] int64, PAD at and past each row's length
    lengths: Tensor           # [n] int64 real tokens per row (total_len for fixed-length tasks)
    loss_mask: Tensor         # [n, total_len - 1] bool, the answer's targets inside the row
    rollout_logprobs: Tensor  # [n, total_len - 1] fp32 (0 where loss_mask is False)
    rewards: Tensor           # [n] fp32
    advantages: Tensor        # [n] fp32, or [n, total_len - 1] for credit="token"
    correct: Tensor           # [n, answer_len] bool
    version: int              # policy version that sampled it (the oldest, when samples differ)
    sample_versions: Optional[Tensor] = None  # [n] int64: each sample's policy version (None: all `version`)
    keep: Optional[KeptSet] = None  # the kept set of every [n, total_len - 1] target (top_k / top_p)
    routed_experts: Optional[Tensor] = None  # [n, total_len - 1, moe_layers, k] int64: an MoE engine's routes
    info: dict = field(default_factory=dict)  # the sampler's own metrics (vLLM: sync and rollout time, rewards)

    def rollout_fields(self) -> dict[str, Tensor]:
        """The global batch as step.Rollouts fields; Rollouts.dp_shard splits it over DP."""
        kept = {} if self.keep is None else {"keep_ids": self.keep.ids, "keep_offsets": self.keep.offsets}
        routes = {} if self.routed_experts is None else {"routed_experts": self.routed_experts}
        return {"tokens": self.tokens, "lengths": self.lengths, "loss_mask": self.loss_mask,
                "advantages": self.advantages, "rollout_logprobs": self.rollout_logprobs, **kept, **routes}


class Sampler:
    def __init__(self, model_cfg, rollout_cfg, *, seed: int, device: torch.device | str = "cpu"):
        self.model_cfg, self.cfg, self.seed, self.device = model_cfg, rollout_cfg, seed, device
        self.task = Task(rollout_cfg)
        self.versions: dict[int, dict[str, Tensor]] = {}  # policy version -> full fp32 state
        self._built: Optional[tuple[int, Engine]] = None  # (version, its engine): the last one built

    def version_for(self, step: int) -> int:
        """The policy version used for rollouts of 0-based `step` (the trainer is at version step)."""
        return max(0, step - self.cfg.staleness)

    def _held_version(self, step: int) -> int:
        """version_for(step), or the oldest version held when that one is older. That happens only
        after a resume with a larger rollout.staleness (the checkpoint holds the versions the old
        one needed); the lag then grows to the new staleness one step at a time."""
        want = self.version_for(step)
        return max(want, min(self.versions)) if self.versions else want

    def sync(self, version: int, full_state: dict[str, Tensor]) -> None:
        """Receive the trainer's weights after `version` optimizer steps; drop versions never needed again."""
        self.versions[version] = {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in full_state.items()}
        for v in [v for v in self.versions if v < version - self.cfg.staleness]:
            del self.versions[v]
        if self._built is not None and (self._built[0] == version or self._built[0] not in self.versions):
            self._built[1].close()
            self._built = None  # built from weights it no longer holds

    def push(self, version: int, chunks) -> None:
        """Collective: the trainer's model chunks are now policy version `version`, gathered whole
        (base/weights.gather_full_state): PromptSampler's rollout.sync=disk fallback only (the runs'
        samplers stream instead, prompt_weights.EngineWeights.push)."""
        from ..base.weights import gather_full_state

        self.sync(version, gather_full_state(chunks))

    def resumed(self, step: int, chunks) -> None:
        """After a checkpoint's load: its versions came with it (load_state_dict); nothing to do."""

    def engine(self, version: int) -> Engine:
        """The inference engine (rollout.engine) on policy version `version`'s weights, streamed in as the
        engine names them, built once per version: the last one built is kept, so a version sampled again
        is not rebuilt."""
        if version not in self.versions:
            raise KeyError(f"sampler has no weights of policy version {version} (has {sorted(self.versions)})")
        if self._built is None or self._built[0] != version:
            if self._built is not None:
                self._built[1].close()  # free the old engine before building the next
            self._built = None
            spec = engine_spec(self.cfg.engine)
            built = spec.open(EngineStart(model=self.model_cfg, precision=self.cfg.precision, seed=self.seed,
                                          max_model_len=self.task.total_len, device=self.device))
            named = canonical_names(self.versions[version])
            if spec.names == "hf":
                from ..hf.mapping import to_hf

                named = to_hf(named, self.model_cfg.arch)
            size = self.cfg.sync_bucket_bytes
            built.update_weights(tensor_buckets(named, size), manifest={k: tuple(v.shape) for k, v in named.items()},
                                 bucket_bytes=size)
            self._built = (version, built)
        return self._built[1]

    def generate(self, engine: Engine, prompts: Tensor, step: int) -> tuple[Tensor, Tensor]:
        """(tokens [n, total_len], logprobs [n, answer_len] fp32) of `sample`, without the kept sets."""
        return self.sample(engine, prompts, step)[:2]

    def sample(self, engine: Engine, prompts: Tensor, step: int) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """Sample answer_len tokens per row -> (tokens [n, total_len], logprobs [n, answer_len] fp32,
        kept [n, answer_len, V] bool: each draw's kept set, all True without top_k / top_p, routes
        [n, total_len - 1, moe_layers, k] int64 or None: the experts of each fed token, MoE engines only).

        Row i is global sample index step * n + i (engine.generate's seed of a one-sample prompt), so
        its draws are the same on every rank and layout. No stop token: the task finds each row's EOS.
        """
        n, a = prompts.shape[0], self.task.answer_len
        out = engine.generate(prompts.tolist(), Sampling(n=1, max_new_tokens=a, seeds=[step * n + i for i in range(n)],
                                                         temperature=self.cfg.temperature, top_k=self.cfg.top_k,
                                                         top_p=self.cfg.top_p))
        done = [per_prompt[0] for per_prompt in out]
        tokens = torch.cat([prompts, torch.tensor([c.token_ids for c in done], dtype=torch.long)], 1)
        logps = torch.tensor([c.logprobs for c in done], dtype=torch.float32)
        # as wide as any kept id (a padded vocabulary's rows can be drawn too); False columns add nothing
        vocab = max([self.model_cfg.vocab_size] + [max(ids) + 1 for c in done for ids in (c.kept or []) if ids])
        kept = torch.ones(n, a, vocab, dtype=torch.bool)
        for i, c in enumerate(done):
            if c.kept is not None:
                kept[i] = False
                for j, ids in enumerate(c.kept):
                    kept[i, j, ids] = True
        routed = torch.stack([c.routes for c in done]) if done and done[0].routes is not None else None
        return tokens, logps, kept, routed

    def rollouts(self, step: int) -> Batch:
        """The global batch of 0-based `step`: prompts x group samples, rewards, group advantages."""
        version = self._held_version(step)
        return self._batch(step, version, self.engine(version))

    def _batch(self, step: int, version: int, engine: Engine) -> Batch:
        """The batch of `step` sampled by `engine` (on policy version `version`)."""
        g, p = self.cfg.group_size, self.cfg.prompts_per_step
        prompts = self.task.prompts(self.seed, step, p).repeat_interleave(g, 0)
        tokens, answer_lp, kept, routed = self.sample(engine, prompts, step)
        lengths = self.task.lengths(tokens)  # a variable-length row ends at its first EOS
        tokens = tokens.masked_fill(torch.arange(tokens.shape[1]) >= lengths[:, None], PAD)
        rewards, correct = self.task.rewards(tokens)
        mask = self.task.loss_mask(lengths)
        a = self.task.answer_len
        rollout_lp = torch.zeros(mask.shape)
        rollout_lp[:, -a:] = answer_lp
        rollout_lp.masked_fill_(~mask, 0.0)  # the tokens sampled after EOS are not part of the row
        if self.cfg.credit == "token":
            advantages = torch.zeros(mask.shape)
            advantages[:, -a:] = group_advantages(correct.float(), g)
        else:
            advantages = group_advantages(rewards, g)
        keep = None
        if self.cfg.top_k > 0 or self.cfg.top_p < 1.0:  # each trained target's kept set; none elsewhere
            full = torch.zeros(*mask.shape, kept.shape[-1], dtype=torch.bool)
            full[:, -a:] = kept
            keep = KeptSet.from_mask(full & mask[..., None])
        return Batch(tokens=tokens, lengths=lengths, loss_mask=mask, rollout_logprobs=rollout_lp,
                     rewards=rewards, advantages=advantages, correct=correct, version=version, keep=keep,
                     routed_experts=routed)

    def state_dict(self) -> dict:
        return {"versions": self.versions}

    def load_state_dict(self, state: dict) -> None:
        self.versions = dict(state["versions"])
        self._built = None

    def close(self) -> None:
        """Free the engine; PromptSampler also stops its processes."""
        if self._built is not None:
            self._built[1].close()
        self._built = None
