"""Off-policy corrections as a keep mask on the per-token loss, each a registered Correction: token MIS
(IcePop), Geo-RS, OPSM, and M2PO's selection made before the step; a plugin adds its own.

    keep = correction_keep(cfg.correction, anchor, logprobs=lp, old=old, rollout=rollout,
                           advantages=adv, valid=valid, m=m, seq_sum=seq_sum, selected=None)
    per_token = torch.where(keep, per_token, 0.0)  # None: nothing configured; drops stay counted

A correction declares what it needs (needs: the inputs, and why, for required_inputs and the messages),
what it keeps (keep: a [b, s] mask from the shared context), whether a chunk of a sequence can compute
it (chunk: why loss.head=fused_grad must fall back, or None), whether it divides by pi_rollout (refused
under the rollout anchor, which already does) and, for a plugin, its settings (config: a frozen
dataclass written correction.<name> in the YAML). Under the old anchor MIS and Geo-RS test
rho = pi_old / pi_rollout; under the rollout anchor the detached r = pi_theta / pi_rollout that the
clamp sees. Sequence means are segment sums (seq_sum: one CP all-reduce each when cp > 1) in fp64, so
every layout takes the same keep decision.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..config import CorrectionConfig
from .common import SeqSum, row_sum
from .metrics import Metrics

BOTH = ("old_logprobs", "rollout_logprobs")


@dataclass
class Context:
    """What a correction's keep() reads: the microbatch's tensors ([b, s]; old / rollout fp32, finite
    on `valid` where needed), the anchor, the Metrics to record into, seq_sum, and M2PO's `selected`;
    the shared quantities are computed once, on first use."""

    anchor: str
    logprobs: Tensor
    old: Optional[Tensor]
    rollout: Optional[Tensor]
    advantages: Tensor
    valid: Tensor
    m: Metrics
    seq_sum: SeqSum
    selected: Optional[Tensor]

    @functools.cached_property
    def log_ratio(self) -> Tensor:
        """The ratio MIS and Geo-RS test, as a detached log, 0 off `valid`."""
        assert self.rollout is not None, "input_reasons makes rollout_logprobs required for mis/geo_rs"
        return torch.where(self.valid, correction_log_ratio(self.anchor, self.logprobs, self.old, self.rollout), 0.0)

    @functools.cached_property
    def count(self) -> Tensor:
        """Each token's sequence length in valid tokens (>= 1), fp64."""
        return self.seq_sum(self.valid.double()).clamp(min=1.0)

    def seq_mean(self, x: Tensor) -> Tensor:
        return _seq_mean(x, self.valid, self.count, self.seq_sum)

    def sequence_drops(self, name: str, drop: Tensor) -> None:
        # per sequence 1/len: the weighted mean is the fraction of sequences, exact over CP and DP.
        self.m.weighted_mean(f"correction/{name}_dropped_frac", drop.float(), 1.0 / self.count, self.valid)
        self.m.frac(f"correction/{name}_dropped_token_frac", drop, self.valid)


@dataclass(frozen=True)
class Correction:
    """settings(c: CorrectionConfig) -> its setting, None when off (a plugin's: its config dataclass,
    from correction.<name>). keep(settings, ctx) -> [b, s] bool (True = kept). needs(settings, anchor) ->
    {input: why}. chunk(settings, anchor, old_from_current, cp_size) -> why a chunk cannot compute it,
    or None. selection: a mask made before the step and handed in (M2PO's), active whenever given."""

    name: str
    keep: Callable[[Any, Context], Tensor]
    needs: Callable[[Any, str], dict] = lambda s, anchor: {}
    chunk: Callable[[Any, str, bool, int], Optional[str]] = lambda s, anchor, old_from_current, cp: None
    divides_by_rollout: bool = False
    config: Optional[type] = None
    settings: Optional[Callable[[CorrectionConfig], Any]] = None
    selection: bool = False

    def setting(self, c: CorrectionConfig) -> Any:
        if self.settings is not None:
            return self.settings(c)
        return plugin_settings(self, c.sections.get(self.name)) if self.name in c.sections else None


CORRECTIONS: dict[str, Correction] = {}


def register_correction(correction: Correction) -> Correction:
    """Add `correction` (applied after those registered before it); ValueError for a taken name."""
    if correction.name in CORRECTIONS:
        raise ValueError(f"correction {correction.name!r} is already registered")
    if correction.config is not None and not (dataclasses.is_dataclass(correction.config)
                                              and correction.config.__dataclass_params__.frozen):
        raise ValueError(f"correction {correction.name!r}: config= must be a frozen dataclass")
    CORRECTIONS[correction.name] = correction
    return correction


@functools.lru_cache(maxsize=64)
def plugin_settings(correction: Correction, section) -> Any:
    from ..schema import from_dict

    if correction.config is None:
        raise ValueError(f"correction.{correction.name}: the correction takes no settings (it registered no config=)")
    return from_dict(correction.config, dict(section or {}), f"correction.{correction.name}")


def active(c: CorrectionConfig, selected: Optional[Tensor] = None, *, applying: bool = False) -> list[tuple[Correction, Any]]:
    """The corrections on, in registration order, each with its setting; applying: in the loss, where a
    selection (M2PO's) is on only when handed in. ValueError, one line, for a correction.<name> no
    correction registered."""
    stray = sorted(set(c.sections) - set(CORRECTIONS))
    if stray:
        fields = [f.name for f in dataclasses.fields(CorrectionConfig) if f.name != "sections"]
        known = fields + [n for n in CORRECTIONS if n not in fields]  # the plugins' after the config's own keys
        raise ValueError(f"correction.{stray[0]}: unknown key; known keys: {', '.join(known)}")
    out = []
    for corr in CORRECTIONS.values():
        setting = corr.setting(c)
        if (selected is not None) if corr.selection and applying else setting is not None:
            out.append((corr, setting))
    return out


def corrections_on(c: CorrectionConfig, selected: Optional[Tensor] = None) -> bool:
    """Whether any correction zeroes tokens in the loss (M2PO through its `selected` mask)."""
    return bool(active(c, selected, applying=True))


def correction_log_ratio(anchor: str, logprobs: Tensor, old: Optional[Tensor], rollout: Tensor) -> Tensor:
    """log of the ratio MIS and Geo-RS test, [b, s] fp32, detached: log rho = log pi_old - log
    pi_rollout under the old anchor, log r = log pi_theta - log pi_rollout under the rollout one."""
    if anchor == "old":
        assert old is not None, "input_reasons makes old_logprobs required under the old anchor"
        return (old - rollout).detach().float()
    return (logprobs.detach() - rollout).float()


def _seq_mean(x: Tensor, mask: Tensor, count: Tensor, seq_sum: SeqSum) -> Tensor:
    """Each token's sequence mean of x over `mask`, fp64 (count: seq_sum of the mask, >= 1)."""
    return seq_sum(torch.where(mask, x.double(), 0.0)) / count


def correction_keep(c: CorrectionConfig, anchor: str, *, logprobs: Tensor, old: Optional[Tensor],
                    rollout: Optional[Tensor], advantages: Tensor, valid: Tensor, m: Metrics,
                    seq_sum: SeqSum = row_sum, selected: Optional[Tensor] = None) -> Optional[Tensor]:
    """[b, s] bool: tokens whose loss the corrections keep (meaningful on `valid` only), or None
    when no correction is on. The caller zeroes the rest; they stay in the denominator.

    logprobs: current pi_theta [b, s] (detached here). old / rollout: [b, s] fp32, finite on
    `valid` where the config needs them. advantages: [b, s] (a [b] advantage expanded).
    selected: a selection made before the step (M2PO's), False = drop. The built-in rules are in
    correction_rules.py. Collectives: seq_sum's, 1 to 4 calls for the built-ins.
    """
    on = active(c, selected, applying=True)
    if not on:
        return None
    ctx = Context(anchor, logprobs, old, rollout, advantages, valid, m, seq_sum, selected)
    keep = torch.ones_like(valid)
    for corr, setting in on:
        keep = keep & corr.keep(setting, ctx)
    m.frac("correction/dropped_token_frac", ~keep, valid)
    return keep


def correction_inputs(c: CorrectionConfig, anchor: str) -> dict[str, str]:
    """{input: why} the configured corrections need (M2PO counted as configured by correction.m2po)."""
    reasons: dict[str, str] = {}
    for corr, setting in active(c):
        for name, why in corr.needs(setting, anchor).items():
            reasons.setdefault(name, why)
    return reasons


def correction_chunk_problem(c: CorrectionConfig, anchor: str, old_from_current: bool, cp_size: int) -> Optional[str]:
    """Why a configured correction cannot be computed chunk by chunk (loss.head=fused_grad), or None."""
    for corr, setting in active(c):
        why = corr.chunk(setting, anchor, old_from_current, cp_size)
        if why:
            return why
    return None


def mismatch_sequence_metrics(m: Metrics, old: Tensor, rollout: Tensor, mask: Tensor,
                              seq_sum: SeqSum = row_sum) -> None:
    """mismatch/seq_log_rho_mean (mean over sequences of mean_t log rho_t) and its _min / _max over
    sequences; old / rollout: [b, s] fp32, finite on `mask`. Collectives: two seq_sum calls, so
    compute_policy_loss records it only while a correction is on."""
    count = seq_sum(mask.double()).clamp(min=1.0)
    mean = _seq_mean(old - rollout, mask, count, seq_sum)
    m.weighted_mean("mismatch/seq_log_rho_mean", mean, 1.0 / count, mask)
    m.min_max("mismatch/seq_log_rho", mean, mask)


from . import correction_rules  # noqa: E402,F401 - the built-ins register themselves, in this order
