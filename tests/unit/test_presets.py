"""Framework presets (megatron_cispo/presets.py) against transcriptions of each framework's own code.

Each `their_*` function re-implements, line for line, the few lines of that framework's CISPO clamp
(and truncated IS) as its source writes them, cited by repo/file/function@commit. The preset's
LossConfig must give the same per-token loss and gradient, bit for bit where the ratio is inside
our +-20 nat guard, on random ratios, ratios far out, ratios at (or straddling) the bounds, and
-inf anchors, where the per-peer behaviour of docs/mapping.md is pinned.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_cispo.config import ConfigError, LossConfig, apply_overrides, from_dict, to_dict
from megatron_cispo.losses import per_token_policy_loss
from megatron_cispo.presets import PRESETS, from_framework

GUARD = 20.0  # our LOG_RATIO_CLAMP; past it a weight may differ from an unguarded peer by < exp(-20)
GUARDED = {"skyrl", "verl"}  # clamp every log-ratio to +-20 as we do: equal bit for bit everywhere


# ----------------------------------------------------------------------------- transcriptions
def their_skyrl(f, lp, old, rollout, adv, mask):
    # NovaSky-AI/SkyRL@a9564572eb8e91076be43c1bd5e4615e3de17265
    # skyrl/backends/skyrl_train/utils/torch_utils.py::safe_exp_delta
    def safe_exp_delta(delta, clip=20.0, out_dtype=None):
        y = torch.clamp(delta.to(torch.float32), -clip, clip).exp()
        return y.to(out_dtype or delta.dtype)
    # skyrl/backends/skyrl_train/utils/ppo_utils.py::compute_policy_loss_cispo
    behavior_log_probs = rollout if f["cispo_anchor"] == "rollout" else old
    ratio = safe_exp_delta(lp - behavior_log_probs, clip=20.0, out_dtype=lp.dtype)
    clamped_ratio = torch.clamp(ratio, 1 - f["cispo_eps_clip_low"], 1 + f["cispo_eps_clip_high"])
    loss = -adv * clamped_ratio.detach() * lp
    # skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py::compute_tis_ratio
    token_tis_log_ratio = old - rollout
    if f["tis_ratio_type"] == "token":
        token_tis_ratio = safe_exp_delta(token_tis_log_ratio, clip=20.0, out_dtype=old.dtype)
        loss = loss * torch.clamp(token_tis_ratio, max=f["token_tis_ratio_clip_high"]).detach()
    elif f["tis_ratio_type"] == "sequence":
        seq_tis_log_ratio = (token_tis_log_ratio * mask).sum(dim=-1, keepdim=True)
        seq_tis_ratio = safe_exp_delta(seq_tis_log_ratio, clip=20.0, out_dtype=old.dtype)
        loss = loss * torch.clamp(seq_tis_ratio, max=f["sequence_tis_ratio_clip_high"]).detach()
    return loss


def their_ms_swift(f, lp, old, rollout, adv, mask):
    # modelscope/ms-swift@3602360a562313afbf2ef6065fdf61f271a2c5b9
    # swift/rlhf_trainers/grpo_trainer.py::_compute_loss (cispo) and _apply_rollout_importance_sampling
    epsilon_high = f["epsilon_high"] if f["epsilon_high"] is not None else f["epsilon"]
    log_ratio = lp - old
    coef_1 = torch.exp(log_ratio)
    clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
    per_token_loss = -clamped_ratios * adv * lp
    if f["rollout_importance_sampling_mode"] == "token_truncate":
        rollout_log_ratio = old - rollout
        SAFETY_BOUND = 20.0
        rollout_log_ratio_safe = torch.clamp(rollout_log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
        is_ratio = torch.exp(rollout_log_ratio_safe)
        is_weights = torch.clamp(is_ratio, max=f["rollout_importance_sampling_threshold"])
        per_token_loss = per_token_loss * is_weights
    return per_token_loss


def their_trl(f, lp, old, rollout, adv, mask):
    # huggingface/trl@f2cd57710ae345ea6428ae95363267fcf38a3dc8
    # trl/trainer/grpo_trainer.py: __init__ (epsilon_high fallback), the vLLM IS block (~L2578),
    # _compute_loss (cispo, ~L3080) and `per_token_loss * inputs["importance_sampling_ratio"]`
    epsilon_high = f["epsilon_high"] if f["epsilon_high"] is not None else f["epsilon"]
    coef_1 = torch.exp(lp - old)
    clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
    per_token_loss = -clamped_ratios * adv * lp
    if f["use_vllm"] and f["vllm_importance_sampling_correction"]:
        per_token_logps_diff = (old - rollout) * mask
        if f["vllm_importance_sampling_mode"] in ["sequence_mask", "sequence_truncate"]:
            logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
        else:
            logps_diff = per_token_logps_diff
        ratio = torch.exp(logps_diff)
        ratio = torch.clamp(ratio, min=f["vllm_importance_sampling_clip_min"],
                            max=f["vllm_importance_sampling_clip_max"])
        per_token_loss = per_token_loss * ratio
    return per_token_loss


def their_verl(f, lp, old, rollout, adv, mask):
    # volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7
    # verl/trainer/ppo/core_algos.py::compute_policy_loss_cispo
    clip_ratio_low = f["clip_ratio_low"] if f["clip_ratio_low"] is not None else f["clip_ratio"]
    clip_ratio_high = f["clip_ratio_high"] if f["clip_ratio_high"] is not None else f["clip_ratio"]
    negative_approx_kl = torch.clamp(lp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio_sg = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    pg_losses = -clipped_ratio_sg * adv * lp
    # verl/trainer/ppo/rollout_corr_helper.py::compute_rollout_correction_weights (log_ratio = old - rollout)
    if f["rollout_is"] is not None:
        log_ratio = old - rollout
        if f["rollout_is"] == "token":
            w = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
        else:
            log_ratio_sum = (log_ratio * mask).sum(-1).unsqueeze(-1)
            w = torch.exp(torch.clamp(log_ratio_sum, min=-20.0, max=20.0)).expand_as(log_ratio)
        w = (w * mask).clamp(max=f["rollout_is_threshold"]).detach()
        pg_losses = pg_losses * w
    return pg_losses


def their_nemo_rl(f, lp, old, rollout, adv, mask):
    # NVIDIA-NeMo/RL@7ea279abfbeb698b092856d0dab61e7cf39bc909
    # nemo_rl/algorithms/loss/loss_functions.py::ClippedPGLossFn.__call__ (use_cispo, token level)
    ratios = (lp - old).exp()
    ratios_clamped = ratios.clamp(1.0 - f["ratio_clip_min"], 1.0 + f["ratio_clip_max"])
    clip_loss = -adv * ratios_clamped.detach() * lp
    if not f["use_importance_sampling_correction"]:
        return clip_loss
    w = torch.nan_to_num(torch.exp(old - rollout), nan=0.0, posinf=0.0, neginf=0.0)
    tis_min = f["truncated_importance_sampling_ratio_min"] or 0.0
    w = torch.clamp(w, min=tis_min, max=f["truncated_importance_sampling_ratio"])
    return w * clip_loss


def their_slime(f, lp, old, rollout, adv, mask):
    # THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    # slime/utils/arguments.py (eps_clip_high None -> eps_clip), slime/backends/megatron_utils/loss.py
    # ::policy_loss_function (old = rollout_log_probs if use_rollout_logprobs), slime/utils/ppo_utils.py
    # ::compute_cispo_loss, loss.py::vanilla_tis_function
    eps_clip_high = f["eps_clip_high"] if f["eps_clip_high"] is not None else f["eps_clip"]
    old_log_probs = rollout if f["use_rollout_logprobs"] else old
    ppo_kl = old_log_probs - lp
    ratio = (-ppo_kl).exp()
    ratio_truncated = torch.clamp(ratio, min=1.0 - f["eps_clip"], max=1.0 + eps_clip_high)
    pg_loss = -ratio_truncated.detach() * adv * lp
    if f["use_tis"]:
        tis = torch.exp(old - rollout)
        pg_loss = pg_loss * torch.clamp(tis, min=f["tis_clip_low"], max=f["tis_clip"])
    if f["use_opsm"]:  # policy_loss_function hands compute_opsm_mask full_old_log_probs = old_log_probs
        opsm_mask = []
        for full_log_prob, full_old_log_prob, advantage, loss_mask in zip(lp.detach(), old_log_probs, adv, mask):
            seq_kl = ((full_old_log_prob - full_log_prob) * loss_mask).sum() / torch.clamp_min(loss_mask.sum(), 1)
            opsm_mask.append(1 - ((advantage < 0) & (seq_kl > f["opsm_delta"])).float())
        pg_loss = pg_loss * torch.stack(opsm_mask)
    return pg_loss


THEIRS = {"skyrl": their_skyrl, "ms_swift": their_ms_swift, "trl": their_trl, "verl": their_verl,
          "nemo_rl": their_nemo_rl, "slime": their_slime}

# Settings per framework: defaults, their typical CISPO setting, and each exact IS option.
CASES = [
    ("skyrl", {}), ("skyrl", {"cispo_eps_clip_low": 0.2, "cispo_eps_clip_high": 0.28, "cispo_anchor": "rollout"}),
    ("skyrl", {"tis_ratio_type": "token"}), ("skyrl", {"tis_ratio_type": "sequence"}),
    ("ms_swift", {}), ("ms_swift", {"epsilon_high": 5.0}),
    ("ms_swift", {"epsilon_high": 5.0, "rollout_importance_sampling_mode": "token_truncate"}),
    ("trl", {}), ("trl", {"epsilon_high": 5.0, "use_vllm": True, "vllm_importance_sampling_mode": "token_truncate"}),
    ("trl", {"epsilon_high": 5.0, "use_vllm": True, "vllm_importance_sampling_mode": "sequence_truncate"}),
    ("trl", {"use_vllm": True, "vllm_importance_sampling_correction": False}),
    ("verl", {}), ("verl", {"clip_ratio_low": 10.0, "clip_ratio_high": 0.2}),
    ("verl", {"clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio": 0.3, "rollout_is": "token"}),
    ("verl", {"clip_ratio_low": 10.0, "clip_ratio_high": 4.0, "rollout_is": "sequence", "rollout_is_threshold": 3.0}),
    ("nemo_rl", {}), ("nemo_rl", {"ratio_clip_min": 1.0, "ratio_clip_max": 5.0}),
    ("nemo_rl", {"ratio_clip_min": 1.0, "ratio_clip_max": 4.0, "use_importance_sampling_correction": True,
                 "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0}),
    ("slime", {}), ("slime", {"eps_clip": 1.0, "eps_clip_high": 4.0, "use_rollout_logprobs": True}),
    ("slime", {"eps_clip": 1.0, "eps_clip_high": 4.0, "use_tis": True}),
    ("slime", {"eps_clip": 1.0, "eps_clip_high": 4.0, "use_opsm": True, "opsm_delta": 0.05}),  # drops 1 of 4
    ("slime", {"eps_clip": 1.0, "eps_clip_high": 4.0, "use_opsm": True, "use_rollout_logprobs": True}),  # 1 of 4
]


def _flags(framework: str, given: dict) -> dict:
    """Every flag of the framework with its default (the preset class's), then `given`."""
    return {**to_dict(PRESETS[framework]()), **given}


def _near(bound: float, anchor: torch.Tensor) -> list[torch.Tensor]:
    """fp32 logprobs lp with exp(lp - anchor) at `bound` exactly where fp32 allows it, and on both sides."""
    x = anchor + math.log(bound)
    up = down = x
    out = [x]
    for _ in range(3):
        up, down = torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)
        out += [up, down]
    return out


def _batch(bounds: tuple[float, float], seed: int = 0, s: int = 12):
    """lp, anchor, other (the logprob the anchor is not), advantages, mask: [b, s] fp32.

    The ratio lp - anchor covers random values, |log r| up to 30 and the two clip bounds; the
    IS ratio anchor - other covers the same; the last token of each row is padding."""
    g = torch.Generator().manual_seed(seed)
    far = torch.tensor([30.0, 21.0, 19.5, 12.0, 5.0])
    log_r = torch.cat([torch.randn(14, generator=g) * 1.5, far, -far])
    anchor = -torch.rand(log_r.numel(), generator=g) * 3.0 - 0.05
    lp = anchor + log_r
    at = [(a, v) for b in bounds if b > 0 and math.isfinite(b) for a in (torch.tensor(-2.0), torch.tensor(-0.5))
          for v in _near(b, a)]
    lp = torch.cat([lp, torch.stack([v for _, v in at])])
    anchor = torch.cat([anchor, torch.stack([a for a, _ in at])])
    n = lp.numel()
    rows = -(-n // (s - 1))
    pad = rows * (s - 1) - n
    lp, anchor = (torch.cat([t, torch.full((pad,), -1.0)]).view(rows, s - 1) for t in (lp, anchor))
    lp, anchor = (torch.cat([t, torch.full((rows, 1), -0.7)], 1) for t in (lp, anchor))  # padding column
    log_rho = (torch.randn(rows, s, generator=g) * 0.7).masked_scatter(
        torch.rand(rows, s, generator=g) < 0.05, torch.tensor([25.0, -25.0, 21.0, -21.0] * rows * s))
    other = anchor - log_rho
    adv = torch.randn(rows, generator=g)[:, None].expand(rows, s).contiguous()
    mask = torch.ones(rows, s, dtype=torch.bool)
    mask[:, -1] = False
    return lp, anchor, other, adv, mask


def _ours_and_theirs(framework, given, lp, anchor, other, adv, mask):
    f = _flags(framework, given)
    cfg = from_dict(LossConfig, {"preset": {"framework": framework, **given}}, "loss")
    rollout_anchor = cfg.cispo.anchor == "rollout"
    old, rollout = (other, anchor) if rollout_anchor else (anchor, other)
    lp_ours, lp_theirs = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    ours, valid, metrics = per_token_policy_loss(cfg, lp_ours, advantages=adv, loss_mask=mask,
                                                 old_logprobs=old, rollout_logprobs=rollout)
    theirs = THEIRS[framework](f, lp_theirs, old, rollout, adv, mask.float()) * mask
    ours.sum().backward()
    theirs.sum().backward()
    return cfg, (ours.detach(), lp_ours.grad), (theirs.detach(), lp_theirs.grad), metrics


@pytest.mark.parametrize("framework,given", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_preset_reproduces_the_frameworks_own_formula(framework, given):
    cfg = from_dict(LossConfig, {"preset": {"framework": framework, **given}}, "loss")
    lp, anchor, other, adv, mask = _batch(cfg.cispo.bounds(), seed=len(given))
    _, (ours, g_ours), (theirs, g_theirs), _ = _ours_and_theirs(framework, given, lp, anchor, other, adv, mask)
    # Inside the guard the two agree bit for bit; past it (|log r| > 20) an unguarded peer's weight
    # exp(log r) and ours exp(+-20) differ by < exp(-20) below, and both are capped above.
    rollout_anchor = cfg.cispo.anchor == "rollout"
    old, rollout = (other, anchor) if rollout_anchor else (anchor, other)
    inside = ((lp - anchor).abs() <= GUARD) & ((old - rollout).abs() <= GUARD)
    if cfg.tis.level == "sequence":
        inside &= (((old - rollout) * mask).sum(-1, keepdim=True).abs() <= GUARD)
    assert inside.sum() >= 10 and (~inside & mask).sum() >= 5  # both regimes are covered
    if framework in GUARDED:
        inside = torch.ones_like(mask)
    for a, b in ((ours, theirs), (g_ours, g_theirs)):
        assert torch.equal(a[inside], b[inside])
        torch.testing.assert_close(a, b, rtol=0, atol=math.exp(-GUARD) * 4 * (adv.abs().max() * lp.abs().max()).item())


@pytest.mark.parametrize("framework,given,kept_at", [
    # anchor (the CISPO ratio's denominator) -inf: Delta = +inf
    ("skyrl", {"cispo_anchor": "rollout"}, "cap"),                       # safe_exp_delta clamps to +20
    ("slime", {"eps_clip": 1.0, "eps_clip_high": 4.0, "use_rollout_logprobs": True}, "cap"),  # exp(inf) clamped
    ("verl", {"clip_ratio_low": 10.0, "clip_ratio_high": 4.0}, "cap"),  # Delta clamped to +20 (anchor: old_log_prob)
    # the sampler's logprob -inf inside truncated IS, anchor finite
    ("skyrl", {"tis_ratio_type": "token"}, "is_cap"),
    ("ms_swift", {"epsilon_high": 5.0, "rollout_importance_sampling_mode": "token_truncate"}, "is_cap"),
    ("trl", {"epsilon_high": 5.0, "use_vllm": True, "vllm_importance_sampling_mode": "token_truncate"}, "is_cap"),
    ("slime", {"eps_clip": 1.0, "eps_clip_high": 4.0, "use_tis": True}, "is_cap"),
    ("nemo_rl", {"ratio_clip_min": 1.0, "ratio_clip_max": 4.0, "use_importance_sampling_correction": True,
                 "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0}, "zero"),
])
def test_minus_inf_anchor_each_peer_as_documented_we_drop_it(framework, given, kept_at):
    cfg = from_dict(LossConfig, {"preset": {"framework": framework, **given}}, "loss")
    lp, anchor, other, adv, mask = _batch(cfg.cispo.bounds(), seed=3)
    hit = torch.zeros_like(mask)
    hit[:, 2] = True
    if kept_at == "cap":
        anchor = anchor.masked_fill(hit, -math.inf)   # the CISPO ratio's own anchor
    else:
        other = other.masked_fill(hit, -math.inf)     # old anchor: `other` is the sampler's logprob
    _, (ours, g_ours), (theirs, _), metrics = _ours_and_theirs(framework, given, lp, anchor, other, adv, mask)
    low, high = cfg.cispo.bounds()
    weight = (lp - anchor).clamp(-GUARD, GUARD).exp().clamp(low, high)  # = high where the anchor is -inf
    is_weight = {"cap": 1.0, "is_cap": cfg.tis.cap, "zero": 0.0}[kept_at]
    torch.testing.assert_close(theirs[hit], (-(adv * weight) * lp * is_weight)[hit])
    assert torch.isfinite(theirs).all() and (kept_at == "zero" or (theirs[hit] != 0).all())
    assert torch.equal(ours[hit], torch.zeros_like(ours[hit])) and torch.equal(g_ours[hit], torch.zeros_like(ours[hit]))
    assert metrics.values()["policy/nonfinite_dropped"] == hit.sum()


@pytest.mark.parametrize("use_rollout_logprobs", [False, True])
def test_slime_opsm_tests_the_ratios_own_denominator_pi_old_by_default(use_rollout_logprobs):
    # slime's OPSM reads mean_t log(old_log_probs / pi_theta), old_log_probs being pi_old, or
    # pi_rollout with --use-rollout-logprobs; the two references drop different sequences here
    g = torch.Generator().manual_seed(7)
    b, s = 16, 6
    rollout = -torch.rand(b, s, generator=g) * 2 - 0.1
    old = rollout + 0.4 * torch.randn(b, s, generator=g)
    lp = old + 0.4 * torch.randn(b, s, generator=g)
    adv = torch.where(torch.rand(b, generator=g) < 0.7, -1.0, 1.0)[:, None].expand(b, s).contiguous()
    mask = torch.ones(b, s, dtype=torch.bool)
    given = {"eps_clip": 1.0, "eps_clip_high": 4.0, "use_opsm": True, "opsm_delta": 0.05,
             "use_rollout_logprobs": use_rollout_logprobs}
    cfg = from_dict(LossConfig, {"preset": {"framework": "slime", **given}}, "loss")
    assert cfg.correction.opsm_ref == ("rollout" if use_rollout_logprobs else "old")
    ours, _, _ = per_token_policy_loss(cfg, lp, advantages=adv, loss_mask=mask, old_logprobs=old,
                                       rollout_logprobs=rollout)
    theirs = their_slime(_flags("slime", given), lp, old, rollout, adv, mask.float())
    assert torch.equal(ours, theirs)
    ref = rollout if use_rollout_logprobs else old
    other = old if use_rollout_logprobs else rollout
    dropped = ours.eq(0).all(1)
    assert torch.equal(dropped, (adv[:, 0] < 0) & ((ref - lp).mean(1) > 0.05))
    assert 0 < dropped.sum() and not torch.equal(dropped, (adv[:, 0] < 0) & ((other - lp).mean(1) > 0.05))


# ----------------------------------------------------------------------------- flags -> our keys
@pytest.mark.parametrize("framework,flags,bounds", [
    ("skyrl", {}, (0.0, 5.0)),
    ("ms_swift", {}, (0.0, 0.2)),                      # epsilon_high unset -> epsilon = 0.2: an absolute cap
    ("trl", {}, (0.0, 0.2)),
    ("verl", {}, (0.8, 1.2)),
    ("nemo_rl", {}, (0.8, 1.2)),
    ("slime", {}, (0.8, 1.2)),
    ("nemo_rl", {"ratio_clip_min": 1.0, "ratio_clip_max": 5.0}, (0.0, 6.0)),  # NeMo-RL's recipe: a cap of 6
    # ScaleRL's [0, 5] in each framework's own terms (docs/mapping.md)
    ("ms_swift", {"epsilon_high": 5.0}, (0.0, 5.0)),
    ("trl", {"epsilon_high": 5.0}, (0.0, 5.0)),
    ("verl", {"clip_ratio_low": 10, "clip_ratio_high": 4.0}, (0.0, 5.0)),
    ("nemo_rl", {"ratio_clip_min": 1.0, "ratio_clip_max": 4.0}, (0.0, 5.0)),
    ("slime", {"eps_clip": 1.0, "eps_clip_high": 4.0}, (0.0, 5.0)),
])
def test_each_framework_setting_gives_these_weight_bounds(framework, flags, bounds):
    cfg = from_dict(LossConfig, from_framework(framework, **flags))
    assert cfg.cispo.bounds() == bounds and cfg.policy_loss == "cispo"


def test_default_is_still_scalerl_zero_to_five_and_verl_no_floor_equals_floor_zero():
    assert LossConfig().cispo.bounds() == (0.0, 5.0)
    lp, anchor, _, adv, mask = _batch((0.0, 5.0), seed=5)
    outs = []
    for eps_low in (1.0, 10.0):
        cfg = from_dict(LossConfig, {"cispo": {"eps_low": eps_low}})
        outs.append(per_token_policy_loss(cfg, lp, advantages=adv, loss_mask=mask, old_logprobs=anchor)[0])
    assert torch.equal(outs[0], outs[1])


def test_absolute_bounds_replace_offsets_and_are_the_bounds_the_clip_fractions_count():
    lp, anchor, _, adv, mask = _batch((0.5, 0.7), seed=6)
    cfg = from_dict(LossConfig, {"cispo": {"eps_low": 0.2, "eps_high": 0.2, "clip_min": 0.5, "clip_max": 0.7}})
    assert cfg.cispo.bounds() == (0.5, 0.7)
    lp = lp.clone().requires_grad_()
    per_token, valid, m = per_token_policy_loss(cfg, lp, advantages=adv, loss_mask=mask, old_logprobs=anchor)
    r = (lp - anchor).detach().clamp(-GUARD, GUARD).exp()
    assert torch.equal(per_token, torch.where(mask, -(r.clamp(0.5, 0.7) * adv) * lp, 0.0))
    v = m.values()
    assert v["cispo/clip_frac_low"] == (r < 0.5)[mask].float().mean()
    assert v["cispo/clip_frac_high"] == (r > 0.7)[mask].float().mean()


# ----------------------------------------------------------------------------- the YAML key
def test_yaml_preset_expands_before_validation_and_the_dump_holds_the_resolved_keys(tmp_path: Path):
    from megatron_cispo.runner.experiment import dump_yaml, load_experiment
    path = tmp_path / "run.yaml"
    path.write_text("loss:\n  preset: {framework: nemo_rl, ratio_clip_min: 1.0, ratio_clip_max: 5.0}\n")
    cfg = load_experiment(path, ["loss.preset.ratio_clip_max=4.0", "loss.entropy_coef=0.01"])
    assert cfg.loss.cispo.bounds() == (0.0, 5.0) and cfg.loss.entropy_coef == 0.01
    dumped = dump_yaml(cfg)
    assert "preset" not in dumped and "eps_high: 4.0" in dumped
    (tmp_path / "dumped.yaml").write_text(dumped)
    assert load_experiment(tmp_path / "dumped.yaml") == cfg
    assert load_experiment(path, ["loss.preset=null"]).loss == LossConfig()


def test_a_key_set_by_the_preset_and_explicitly_must_agree():
    same = from_dict(LossConfig, {"preset": {"framework": "skyrl"}, "policy_loss": "cispo",
                                  "cispo": {"eps_high": 4, "token_mask": True}})
    assert same.cispo.eps_high == 4.0 and same.cispo.token_mask  # keys the preset does not set stay the user's
    with pytest.raises(ConfigError, match=r"^loss\.cispo\.anchor: 'rollout' conflicts with loss\.preset "
                       r"\(framework skyrl\), which sets it to 'old'; change it through the preset's flags, "
                       r"or drop one of the two$"):
        from_dict(LossConfig, {"preset": {"framework": "skyrl"}, "cispo": {"anchor": "rollout"}}, "loss")


@pytest.mark.parametrize("preset,message", [
    ({"framework": "nemo"}, r"^loss\.preset\.framework: unknown framework 'nemo'; known: ms_swift, nemo_rl, "
                            r"skyrl, slime, trl, verl$"),
    ({"ratio_clip_min": 1.0}, r"^loss\.preset: expected a mapping with framework: ms_swift \| nemo_rl"),
    ({"framework": "nemo_rl", "ratio_clip": 1.0}, r"^loss\.preset\.ratio_clip: unknown key; known keys: "
                                                  r"ratio_clip_min, ratio_clip_max, use_importance_sampling"),
    ({"framework": "verl", "clip_ratio_high": "0.2"}, r"^loss\.preset\.clip_ratio_high: expected float \| None"),
    ({"framework": "skyrl", "cispo_eps_clip_low": -0.5}, r"^loss\.preset: skyrl flags .* give an invalid loss "
                                                         r"config: cispo: CispoConfig\.eps_low must be finite"),
    ({"framework": "ms_swift", "rollout_importance_sampling_mode": "sequence_truncate"},
     r"^loss\.preset: rollout_importance_sampling_mode='sequence_truncate': .*geometric mean; no exact equivalent"),
    ({"framework": "ms_swift", "importance_sampling_level": "sequence"}, r"importance_sampling_level='sequence'"),
    ({"framework": "trl", "use_vllm": True}, r"vllm_importance_sampling_mode='sequence_mask': .*no exact"),
    ({"framework": "trl", "use_vllm": True, "vllm_importance_sampling_mode": "token_truncate",
      "vllm_importance_sampling_clip_min": 0.5}, r"vllm_importance_sampling_clip_min=0\.5: our TIS has no floor"),
    ({"framework": "verl", "rollout_is_batch_normalize": True}, r"rollout_is_batch_normalize=True"),
    ({"framework": "nemo_rl", "use_importance_sampling_correction": True},
     r"truncated_importance_sampling_type=None: with use_importance_sampling_correction=True only 'tis'"),
    ({"framework": "nemo_rl", "truncated_importance_sampling_type": "tis"},
     r"needs use_importance_sampling_correction=True"),
    ({"framework": "slime", "use_tis": True, "use_rollout_logprobs": True}, r"use_tis=True: slime refuses it"),
    ({"framework": "slime", "use_tis": True, "tis_clip_low": 0.5}, r"tis_clip_low=0\.5: our TIS has no floor"),
])
def test_bad_presets_are_refused_in_one_line(preset, message):
    with pytest.raises(ConfigError, match=message) as e:
        from_dict(LossConfig, {"preset": preset}, "loss")
    assert "\n" not in str(e.value)


def test_from_framework_equals_the_yaml_key_and_overrides_reach_the_preset():
    flags = {"cispo_eps_clip_high": 0.28, "cispo_anchor": "rollout"}
    assert from_dict(LossConfig, from_framework("skyrl", **flags)) == from_dict(
        LossConfig, {"preset": {"framework": "skyrl", **flags}})
    data = apply_overrides({}, ["preset.framework=trl", "preset.epsilon_high=5.0"], schema=LossConfig)
    assert from_dict(LossConfig, data).cispo.bounds() == (0.0, 5.0)
    with pytest.raises(ConfigError, match=r"^presett: unknown key; known keys: policy_loss, .*, correction, preset$"):
        apply_overrides({}, ["presett.framework=trl"], schema=LossConfig)


def test_the_old_import_path_losses_presets_still_gives_from_framework():
    from megatron_cispo.losses import presets as old
    from megatron_cispo import presets
    assert old.from_framework is presets.from_framework and old.PRESETS is presets.PRESETS
    for name in ("SkyRL", "MsSwift", "TRL", "Verl", "NemoRL", "Slime"):  # the classes it held before the move
        assert getattr(old, name) is getattr(presets, name)


def test_mapping_doc_names_every_preset_in_its_clip_convention_table():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "mapping.md").read_text()
    table = doc.split("## Clip conventions", 1)[1].split("\n\n", 2)[1]
    assert sorted(PRESETS) == sorted(row.split("|")[2].strip(" `") for row in table.splitlines()[2:]
                                     if row.split("|")[2].strip() != "none")
