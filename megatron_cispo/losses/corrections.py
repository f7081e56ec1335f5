"""Off-policy corrections as a keep mask on the per-token loss: token MIS (IcePop), Geo-RS, OPSM,
and M2PO's selection made before the step.

    keep = correction_keep(cfg.correction, anchor, logprobs=lp, old=old, rollout=rollout,
                           advantages=adv, valid=valid, m=m, seq_sum=seq_sum, selected=None)
    per_token = torch.where(keep, per_token, 0.0)  # None: nothing configured; drops stay counted

Under the old anchor MIS and Geo-RS test rho = pi_old / pi_rollout; under the rollout anchor the
detached r = pi_theta / pi_rollout that the clamp sees. Sequence means are segment sums (seq_sum:
one CP all-reduce each when cp > 1) in fp64, so every layout takes the same keep decision.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..config import CorrectionConfig
from .common import LOG_RATIO_CLAMP, SeqSum, row_sum
from .metrics import Metrics


def corrections_on(c: CorrectionConfig, selected: Optional[Tensor] = None) -> bool:
    """Whether any correction zeroes tokens in the loss (M2PO through its `selected` mask)."""
    return c.mis is not None or c.geo_rs is not None or c.opsm is not None or selected is not None


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


def _sequence_drop_metrics(m: Metrics, name: str, drop: Tensor, per_seq: Tensor, valid: Tensor) -> None:
    # per_seq = 1/len: the weighted mean is the fraction of sequences, exact over CP and DP.
    m.weighted_mean(f"correction/{name}_dropped_frac", drop.float(), per_seq, valid)
    m.frac(f"correction/{name}_dropped_token_frac", drop, valid)


def correction_keep(c: CorrectionConfig, anchor: str, *, logprobs: Tensor, old: Optional[Tensor],
                    rollout: Optional[Tensor], advantages: Tensor, valid: Tensor, m: Metrics,
                    seq_sum: SeqSum = row_sum, selected: Optional[Tensor] = None) -> Optional[Tensor]:
    """[b, s] bool: tokens whose loss the corrections keep (meaningful on `valid` only), or None
    when no correction is on. The caller zeroes the rest; they stay in the denominator.

    logprobs: current pi_theta [b, s] (detached here). old / rollout: [b, s] fp32, finite on
    `valid` where the config needs them. advantages: [b, s] (a [b] advantage expanded).
    selected: a selection made before the step (M2PO's), False = drop. Rules (inclusive bands):
      mis [lo, hi]     keep a token iff lo <= ratio_t <= hi
      geo_rs [lo, hi]  keep a sequence iff lo <= exp(mean_t log ratio_t) <= hi
      opsm delta       drop a sequence iff mean_t A < 0 and mean_t log(pi_ref / pi_theta) > delta,
                       pi_ref = pi_rollout, or pi_old with opsm_ref='old'
    Means run over the sequence's valid tokens. Collectives: seq_sum's, 1 to 4 calls.
    """
    if not corrections_on(c, selected):
        return None
    keep = torch.ones_like(valid)
    if c.mis is not None or c.geo_rs is not None:
        assert rollout is not None, "input_reasons makes rollout_logprobs required for mis/geo_rs"
        d = torch.where(valid, correction_log_ratio(anchor, logprobs, old, rollout), 0.0)
    if c.mis is not None:
        # fp64, like the sequence means: the bands compare exactly as written (1 + 1e-9 drops r = 1).
        ratio = d.double().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        hit = (ratio >= c.mis[0]) & (ratio <= c.mis[1])
        m.frac("correction/mis_masked_frac", ~hit, valid)
        m.min_max("correction/mis_ratio", ratio, valid)
        keep = keep & hit
    if c.geo_rs is not None or c.opsm is not None:
        count = seq_sum(valid.double()).clamp(min=1.0)
        per_seq = 1.0 / count
    if c.geo_rs is not None:
        geo = _seq_mean(d, valid, count, seq_sum).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        hit = (geo >= c.geo_rs[0]) & (geo <= c.geo_rs[1])
        _sequence_drop_metrics(m, "geo_rs", ~hit, per_seq, valid)
        m.min_max("correction/geo_rs_ratio", geo, valid)
        keep = keep & hit
    if c.opsm is not None:
        ref = rollout if c.opsm_ref == "rollout" else old
        assert ref is not None, "input_reasons makes the opsm_ref logprobs required for opsm"
        # DeepSeek-V3.2: a negative sequence the policy has already moved away from (strict >).
        kl = _seq_mean(ref - logprobs.detach(), valid, count, seq_sum)
        drop = (_seq_mean(advantages.detach(), valid, count, seq_sum) < 0) & (kl > c.opsm)
        _sequence_drop_metrics(m, "opsm", drop, per_seq, valid)
        m.min_max("correction/opsm_seq_kl", kl, valid)
        keep = keep & ~drop
    if selected is not None:
        m.frac("correction/m2po_masked_frac", selected == 0, valid)
        keep = keep & (selected != 0)
    m.frac("correction/dropped_token_frac", ~keep, valid)
    return keep


def mismatch_sequence_metrics(m: Metrics, old: Tensor, rollout: Tensor, mask: Tensor,
                              seq_sum: SeqSum = row_sum) -> None:
    """mismatch/seq_log_rho_mean (mean over sequences of mean_t log rho_t) and its _min / _max over
    sequences; old / rollout: [b, s] fp32, finite on `mask`. Collectives: two seq_sum calls, so
    compute_policy_loss records it only while a correction is on."""
    count = seq_sum(mask.double()).clamp(min=1.0)
    mean = _seq_mean(old - rollout, mask, count, seq_sum)
    m.weighted_mean("mismatch/seq_log_rho_mean", mean, 1.0 / count, mask)
    m.min_max("mismatch/seq_log_rho", mean, mask)
