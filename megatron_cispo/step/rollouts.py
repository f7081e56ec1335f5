"""What one policy step consumes: a batch of Rollouts, and the StepConfig that splits it.

    batch = Rollouts(tokens=t, loss_mask=m, advantages=a, rollout_logprobs=lp, lengths=l)  # DP-local
    batch.dp_shard(dp_rank=r, dp=dp)   # this rank's share of a global batch
Sequences may differ in length (`lengths`); the step packs them under a token budget
(StepConfig.max_tokens_per_microbatch) or pads them per microbatch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Literal, Optional

import torch
from torch import Tensor

from ..config import check_field_types, config_field
from ..kept_set import KeptSet, check_targets
from ..losses.compute import check_loss_mask
from ..vocab_softmax import check_devices


@dataclass(frozen=True, kw_only=True)
class Rollouts:
    """A DP-local batch of n sequences of up to s+1 tokens (prompt + response, right-padded).

    Every field lives on one device, the model's (policy_step checks). n = 0 builds (an empty
    shard), but policy_step refuses a batch with no rows with a ValueError.
    Construction syncs with the host only to check a non-bool loss_mask, `lengths` and the kept
    sets. A batch derived from a checked one (`rows`, `dp_shard`, `replace` of logprobs or
    advantages) is not checked again: its values come from one that was.
    """

    tokens: Tensor = config_field(doc="[n, s+1] int64|int32. The model reads tokens[:, :-1] and is scored on "
                                      "tokens[:, 1:].")
    loss_mask: Tensor = config_field(doc="[n, s] bool (or a number dtype holding only 0 and 1), True on trained "
                                         "(response) targets; it carries the prompt/response boundary.")
    advantages: Tensor = config_field(doc="[n] or [n, s] float.")
    rollout_logprobs: Optional[Tensor] = config_field(None, "[n, s] fp32: the sampler's logprob of each target.")
    old_logprobs: Optional[Tensor] = config_field(None, "[n, s] fp32: pi_old's (None: policy_step computes it "
                                                        "when the loss needs it).")
    ref_logprobs: Optional[Tensor] = config_field(None, "[n, s] fp32: the reference model's (KL).")
    lengths: Optional[Tensor] = config_field(None, "[n] int, real tokens per row (2..s+1); None = every row is "
                                                   "s+1 long. Positions at or past a row's length are padding: "
                                                   "never trained, never seen by the model when packed.")
    keep_ids: Optional[Tensor] = config_field(None, "[K] int: the sampler's kept vocabulary ids of each target "
                                                    "position (row-major over [n, s]), compressed rows as vLLM "
                                                    "returns them (kept_set.KeptSet). Given, every pass scores "
                                                    "over these sets (sampling-mask replay).")
    keep_offsets: Optional[Tensor] = config_field(None, "[n*s + 1] int: where each position's kept ids start; "
                                                        "an empty position keeps the full vocabulary. Both keep_ "
                                                        "fields or neither; each trained target must be in its set.")
    routed_experts: Optional[Tensor] = config_field(
        None, "[n, s, moe_layers, top_k] int: the sampler's experts for the token fed at each model input "
              "position t (tokens[:, t], whose output scores target t), per MoE layer in model order, as vLLM "
              "returns them; a token with any -1 has no route and takes its router's own choice "
              "(loss.routing_replay, step.routing_replay). Checked against the model by policy_step.")

    def __post_init__(self):
        self._check_layout()
        self._check_values()

    @classmethod
    def _derived(cls, **given: Optional[Tensor]) -> Rollouts:
        """A batch whose values come from a checked one: only the layout checks (no host sync)."""
        out = cls.__new__(cls)
        for f in fields(cls):
            object.__setattr__(out, f.name, given.get(f.name))
        out._check_layout()
        return out

    def _check_layout(self) -> None:
        """Dtypes, shapes and devices; no host sync."""
        if self.tokens.dim() != 2 or self.tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"rollouts.tokens must be an int64 or int32 [n, s+1] tensor of token ids, got "
                             f"{self.tokens.dtype} {tuple(self.tokens.shape)}")
        n, s = self.tokens.shape[0], self.tokens.shape[1] - 1
        check_devices({f"rollouts.{f.name}": getattr(self, f.name) for f in fields(self)},
                      "put every field on one device (the model's)")
        for name in ("loss_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (n, s):
                raise ValueError(f"rollouts.{name} has shape {tuple(t.shape)}; expected [n, s] = {(n, s)} "
                                 f"for tokens of shape {tuple(self.tokens.shape)}")
        if tuple(self.advantages.shape) not in ((n,), (n, s)):
            raise ValueError(f"rollouts.advantages has shape {tuple(self.advantages.shape)}; expected "
                             f"[n] = {(n,)} or [n, s] = {(n, s)}")
        for name in ("advantages", "rollout_logprobs", "old_logprobs", "ref_logprobs"):
            t = getattr(self, name)
            if t is not None and not t.dtype.is_floating_point:
                raise ValueError(f"rollouts.{name} must be a floating tensor (fp32), got {t.dtype}")
        lengths = self.lengths
        if lengths is not None and (tuple(lengths.shape) != (n,) or lengths.dtype.is_floating_point
                                    or lengths.dtype == torch.bool):
            raise ValueError(f"rollouts.lengths must be an int [n] = {(n,)} tensor, got {lengths.dtype} "
                             f"{tuple(lengths.shape)}")
        if (self.keep_ids is None) != (self.keep_offsets is None):
            raise ValueError("rollouts.keep_ids and rollouts.keep_offsets come together (the kept sets in "
                             "compressed rows); got only one of them")
        r = self.routed_experts
        if r is not None and (r.dim() != 4 or tuple(r.shape[:2]) != (n, s) or r.dtype.is_floating_point
                              or r.dtype == torch.bool):
            raise ValueError(f"rollouts.routed_experts must be an int [n, s, moe_layers, top_k] tensor with [n, s] = "
                             f"{(n, s)} (one route per model input position), got {r.dtype} {tuple(r.shape)}")
        if self.keep_offsets is not None and self.keep_offsets.shape != (n * s + 1,):
            raise ValueError(f"rollouts.keep_offsets has shape {tuple(self.keep_offsets.shape)}; expected "
                             f"[n*s + 1] = ({n * s + 1},), one kept set per target position")

    def _check_values(self) -> None:
        """A non-bool mask's values, the lengths against the mask, the trained targets against
        their kept sets: host syncs."""
        n, s = self.tokens.shape[0], self.tokens.shape[1] - 1
        check_loss_mask(self.loss_mask, "rollouts.loss_mask")  # host sync for a non-bool mask
        if self.lengths is not None:
            lengths = self.lengths
            if n and (int(lengths.min()) < 2 or int(lengths.max()) > s + 1):
                raise ValueError(f"rollouts.lengths must be in [2, {s + 1}] (a prompt token and a target, at "
                                 f"most tokens.shape[1]), got min {int(lengths.min())} max {int(lengths.max())}")
            past = torch.arange(s, device=lengths.device)[None, :] >= (lengths[:, None] - 1)
            if bool((self.loss_mask.bool() & past.to(self.loss_mask.device)).any()):
                row = int((self.loss_mask.bool() & past.to(self.loss_mask.device)).any(1).nonzero()[0, 0])
                raise ValueError(f"rollouts.loss_mask trains a target past the end of row {row} "
                                 f"(length {int(lengths[row])}): targets at or after lengths-1 are padding")
        if self.keep_ids is not None:
            try:
                check_targets(KeptSet(self.keep_ids, self.keep_offsets), self.tokens[:, 1:], self.loss_mask != 0)
            except ValueError as e:
                raise ValueError(f"rollouts.{e}") from None

    def kept(self) -> Optional[KeptSet]:
        """The kept sets over the [n, s] target positions (sampling-mask replay), or None."""
        return None if self.keep_ids is None else KeptSet.trusted(self.keep_ids, self.keep_offsets)

    def nonfinite_advantages(self) -> Tensor:
        """[n] or [n, s] bool, as advantages: non-finite advantages that would be trained (a row
        with a trained target, or a trained target). No host sync; `describe_nonfinite` names one."""
        trained = self.loss_mask.to(self.advantages.device) != 0
        trained = trained.any(1) if self.advantages.dim() == 1 else trained
        return trained & ~torch.isfinite(self.advantages)

    def describe_nonfinite(self, bad: Tensor) -> str:
        """The first True of `nonfinite_advantages()` as 'advantages[row 1] = nan' (or [row 1, target 4])."""
        where = [int(i) for i in bad.nonzero()[0]]
        value = float(self.advantages[tuple(where)])
        return f"advantages[row {where[0]}{f', target {where[1]}' if len(where) > 1 else ''}] = {value}"

    def target_lengths(self) -> Tensor:
        """[n] int64: model input (= target) positions per row, lengths - 1."""
        n, s = self.tokens.shape[0], self.tokens.shape[1] - 1
        if self.lengths is None:
            return torch.full((n,), s, dtype=torch.int64, device=self.tokens.device)
        return self.lengths.to(self.tokens.device, torch.int64) - 1

    def dp_shard(self, *, dp_rank: int, dp: int, minibatches: int = 1) -> Rollouts:
        """This DP rank's share of a global batch, so that each minibatch (optimizer step)
        holds the same global sequences in every layout: minibatch j is split over DP ranks."""
        n = self.tokens.shape[0]
        if n % (dp * minibatches):
            raise ValueError(f"global batch of {n} sequences does not split into {minibatches} "
                             f"minibatches over dp={dp}")

        rows = torch.arange(n, device=self.tokens.device).view(minibatches, dp, n // (dp * minibatches))
        return self.rows(rows[:, dp_rank].reshape(-1))

    def rows(self, idx) -> Rollouts:
        """Rows `idx` (a slice or an index tensor) as a batch, not checked again."""
        return Rollouts._derived(**self.select(idx))

    def replace(self, **changes: Optional[Tensor]) -> Rollouts:
        """This batch with `changes`, e.g. old_logprobs from a forward pass. Dtypes, shapes and
        devices are checked; the host-syncing value checks run only when a field they read changes."""
        if changes.keys() & {"tokens", "loss_mask", "lengths", "keep_ids", "keep_offsets"}:
            return dataclasses.replace(self, **changes)
        return Rollouts._derived(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})

    def select(self, idx) -> dict[str, Tensor]:
        """The given fields of rows `idx` (a slice or an index tensor), as Rollouts(**...) takes them
        (`rows(idx)` builds that batch without checking it again)."""
        out = {k: getattr(self, k)[idx] for k in ("tokens", "loss_mask", "advantages", "rollout_logprobs",
                                                  "old_logprobs", "ref_logprobs", "lengths", "routed_experts")
               if getattr(self, k) is not None}
        if self.keep_ids is not None:  # the rows' positions' kept sets, in compressed rows again
            n, s = self.tokens.shape[0], self.tokens.shape[1] - 1
            rows = torch.arange(n, device=self.tokens.device)[idx]
            part = self.kept().take(rows[:, None] * s + torch.arange(s, device=rows.device))
            out["keep_ids"], out["keep_offsets"] = part.ids, part.offsets
        return out


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    """How one batch of rollouts becomes optimizer steps."""

    micro_batch_size: int = config_field(
        1, "rows per microbatch per DP rank; packed: rows packed together into one or more bins")
    minibatch_size: Optional[int] = config_field(
        None, "global sequences per optimizer step; None = the whole batch (one step)")
    epochs: int = config_field(1, "passes over the batch")
    temperature: float = config_field(1.0, "the sampler's temperature; logits are divided by it")
    old_logprob_pass: Literal["auto", "always"] = config_field(
        "auto", "auto skips the pi_old pass when it cannot matter")
    max_tokens_per_microbatch: Optional[int] = config_field(
        None, "pack each micro_batch_size rows into [1, T] microbatches of at most this many tokens "
              "(first-fit decreasing); None = pad the rows")

    def __post_init__(self):
        if self.old_logprob_pass not in ("auto", "always"):
            raise ValueError(f"old_logprob_pass must be 'auto' or 'always', got {self.old_logprob_pass!r}")
        check_field_types(self)
        for name in ("micro_batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ValueError(f"max_tokens_per_microbatch must be >= 1 or None, got {self.max_tokens_per_microbatch}")
        if self.minibatch_size is not None and self.minibatch_size < 1:
            raise ValueError(f"minibatch_size must be >= 1 or None, got {self.minibatch_size}")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
