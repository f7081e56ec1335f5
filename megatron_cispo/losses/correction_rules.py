"""The built-in corrections, registered in the order they apply (corrections.py runs them). Rules, inclusive
bands (docs/algorithm.md has the sources):
  mis [lo, hi]     keep a token iff lo <= ratio_t <= hi
  geo_rs [lo, hi]  keep a sequence iff lo <= exp(mean_t log ratio_t) <= hi
  opsm delta       drop a sequence iff mean_t A < 0 and mean_t log(pi_ref / pi_theta) > delta,
                   pi_ref = pi_rollout, or pi_old with opsm_ref='old'
  m2po             the tokens M2PO's selection before the step dropped (step/m2po.py)
Means run over the sequence's valid tokens.
"""
from __future__ import annotations

from torch import Tensor

from .common import LOG_RATIO_CLAMP
from .corrections import BOTH, Context, Correction, register_correction


def _on_rho(key: str):
    """needs(): under the old anchor a rho correction reads pi_old and pi_rollout (the rollout anchor's
    ratio needs only pi_rollout, which the anchor already requires)."""
    def needs(setting, anchor: str) -> dict:
        value = list(setting) if isinstance(setting, tuple) else setting
        return {name: f"correction.{key}={value!r}" for name in BOTH} if anchor == "old" else {}
    return needs


def _mis(band, ctx: Context) -> Tensor:
    # fp64, like the sequence means: the bands compare exactly as written (1 + 1e-9 drops r = 1).
    ratio = ctx.log_ratio.double().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    hit = (ratio >= band[0]) & (ratio <= band[1])
    ctx.m.frac("correction/mis_masked_frac", ~hit, ctx.valid)
    ctx.m.min_max("correction/mis_ratio", ratio, ctx.valid)
    return hit


def _geo_rs(band, ctx: Context) -> Tensor:
    geo = ctx.seq_mean(ctx.log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    hit = (geo >= band[0]) & (geo <= band[1])
    ctx.sequence_drops("geo_rs", ~hit)
    ctx.m.min_max("correction/geo_rs_ratio", geo, ctx.valid)
    return hit


def _geo_rs_chunk(band, anchor: str, old_from_current: bool, cp_size: int):
    key = f"correction.geo_rs={list(band)!r}"
    if anchor == "rollout":
        return f"{key} under the rollout anchor reads the current policy's sequence mean of log(pi_theta / pi_rollout)"
    if old_from_current:
        return f"{key} with pi_old from the training forward reads the current policy's sequence total"
    if cp_size > 1:
        return f"{key} under context parallelism needs a CP all-reduce of sequence totals per chunk"
    return None


def _opsm(setting, ctx: Context) -> Tensor:
    delta, ref_name = setting
    ref = ctx.rollout if ref_name == "rollout" else ctx.old
    assert ref is not None, "input_reasons makes the opsm_ref logprobs required for opsm"
    # DeepSeek-V3.2: a negative sequence the policy has already moved away from (strict >).
    kl = ctx.seq_mean(ref - ctx.logprobs.detach())
    drop = (ctx.seq_mean(ctx.advantages.detach()) < 0) & (kl > delta)
    ctx.sequence_drops("opsm", drop)
    ctx.m.min_max("correction/opsm_seq_kl", kl, ctx.valid)
    return ~drop


def _opsm_needs(setting, anchor: str) -> dict:
    delta, ref_name = setting
    ref = "" if ref_name == "rollout" else f" with opsm_ref={ref_name!r}"
    return {f"{ref_name}_logprobs": f"correction.opsm={delta!r}{ref}"}


def _m2po(setting, ctx: Context) -> Tensor:
    ctx.m.frac("correction/m2po_masked_frac", ctx.selected == 0, ctx.valid)
    return ctx.selected != 0


register_correction(Correction("mis", _mis, needs=_on_rho("mis"), settings=lambda c: c.mis))
register_correction(Correction("geo_rs", _geo_rs, needs=_on_rho("geo_rs"), chunk=_geo_rs_chunk,
                               settings=lambda c: c.geo_rs))
register_correction(Correction(
    "opsm", _opsm, needs=_opsm_needs, settings=lambda c: None if c.opsm is None else (c.opsm, c.opsm_ref),
    chunk=lambda s, anchor, old_from_current, cp: (f"correction.opsm={s[0]!r} reads the current policy's sequence "
                                                    "mean of log(pi_ref / pi_theta)")))
register_correction(Correction("m2po", _m2po, needs=_on_rho("m2po"), divides_by_rollout=True,
                               settings=lambda c: c.m2po, selection=True))
