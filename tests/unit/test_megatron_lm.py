"""Megatron-LM drop-in: the recorded APIs, numerics against Megatron-LM's formula and our losses,
and the measured bf16 logprob rounding that docs/integration.md section 2 quotes.

No Megatron-LM checkout needed; tests/unit/test_megatron_lm_patch.py covers install() and the
launcher on a stand-in module tree, test_megatron_lm_checkout.py a real checkout (MEGATRON_LM_DIR).
"""
import argparse
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from megatron_cispo.config import ConfigError, CorrectionConfig, KLConfig, LossConfig, TISConfig
from megatron_cispo.integrations import megatron_lm as mlm
from megatron_cispo.integrations.megatron_lm.api import describe_params, signature_mismatch
from megatron_cispo.integrations.megatron_lm.dropin import clip_bounds
from megatron_cispo.losses import compute_policy_loss

B, S = 3, 7


@pytest.fixture(autouse=True)
def _reset():
    yield
    mlm.configure(None)


def _inputs(seed=0, b=B, s=S):
    g = torch.Generator().manual_seed(seed)
    lp = lambda: -torch.rand(b, s, generator=g, dtype=torch.float64) * 3  # noqa: E731
    cur = lp().requires_grad_(True)
    old = (cur.detach() + 0.6 * torch.randn(b, s, generator=g, dtype=torch.float64)).clamp(max=0)
    return dict(
        current_logprobs=cur, old_logprobs=old,
        ref_logprobs=(cur.detach() + 0.3 * torch.randn(b, s, generator=g, dtype=torch.float64)).clamp(max=0),
        advantages=torch.randn(b, generator=g, dtype=torch.float64),
        inference_logprobs=(old + 0.4 * torch.randn(b, s, generator=g, dtype=torch.float64)).clamp(max=0),
    )


def megatron_formula(current_logprobs, old_logprobs, ref_logprobs, advantages, clamp_eps_lower,
                     clamp_eps_upper, kl_beta, entropy_weight, inference_logprobs=None,
                     is_truncation_coef=None, seq_starts=None, seq_lengths=None):
    """Straight transcription of the formula documented for Megatron-LM core_v0.16 calculate_grpo_loss."""
    r = torch.exp(current_logprobs - old_logprobs)
    rc = torch.clamp(r, 1 - clamp_eps_lower, 1 + clamp_eps_upper)
    if seq_starts is not None:
        a = torch.zeros_like(current_logprobs)
        for i, (st, n) in enumerate(zip(seq_starts, seq_lengths)):
            a[0, st:min(st + n - 1, a.shape[1])] = advantages[i]
    else:
        a = advantages.view(-1, 1)
    d = ref_logprobs - current_logprobs
    kl = torch.exp(d) - d - 1
    ent = -torch.exp(current_logprobs) * current_logprobs
    w = 1.0
    if inference_logprobs is not None:
        w = torch.exp(old_logprobs - inference_logprobs)
        if is_truncation_coef is not None:
            w = torch.clamp(w, max=is_truncation_coef)
    loss = -w * torch.minimum(r * a, rc * a) + kl_beta * kl - entropy_weight * ent
    return loss, kl, r, ent, r > 1 + clamp_eps_upper, r < 1 - clamp_eps_lower


# ------------------------------------------------------------ recorded API


def test_dropin_signature_and_get_logprobs_signature_match_every_recorded_ref():
    assert [r["megatron_lm_tag"] for r in mlm.RECORDS] == [
        "core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0", "main"]
    for record in mlm.RECORDS:
        for name, fn in (("calculate_grpo_loss", mlm.calculate_grpo_loss), ("get_logprobs", mlm.get_logprobs)):
            assert describe_params(fn) == record["functions"][name]["params"], (record["file"], name)
        assert len(record["functions"]["calculate_grpo_loss"]["returns"]) == 6


def test_signature_mismatch_names_the_differing_parameter():
    def renamed(current_logprobs, old_logprobs, ref_logprobs, advantages, clamp_eps, clamp_eps_upper,
                kl_beta, entropy_weight, inference_logprobs=None, is_truncation_coef=None,
                seq_starts=None, seq_lengths=None):
        pass
    why = signature_mismatch(describe_params(renamed), mlm.RECORDS[0]["functions"]["calculate_grpo_loss"]["params"])
    assert why == "parameter 4: expected clamp_eps_lower, found clamp_eps"
    short = lambda current_logprobs, old_logprobs: None  # noqa: E731
    assert "expected ref_logprobs, found nothing" in signature_mismatch(
        describe_params(short), mlm.RECORDS[0]["functions"]["calculate_grpo_loss"]["params"])


def test_dropin_returns_six_unreduced_per_token_tensors_called_like_train_rl():
    mlm.configure(LossConfig(policy_loss="cispo"))
    x = _inputs()
    x["current_logprobs"] = x["current_logprobs"].float().detach().requires_grad_(True)
    out = mlm.calculate_grpo_loss(**{k: v.float() if k != "current_logprobs" else v for k, v in x.items()},
                                  clamp_eps_lower=0.2, clamp_eps_upper=0.2, kl_beta=0.01,
                                  entropy_weight=0.0, is_truncation_coef=2.0, seq_starts=None, seq_lengths=None)
    assert isinstance(out, tuple) and len(out) == 6
    for t in out:
        assert tuple(t.shape) == (B, S)
    assert [t.dtype for t in out] == [torch.float32] * 4 + [torch.bool] * 2
    assert out[0].requires_grad and not out[2].requires_grad


# ------------------------------------------------------------ ppo == Megatron-LM's formula


@pytest.mark.parametrize("use_is,coef", [(False, None), (True, None), (True, 1.5)])
def test_dropin_ppo_reproduces_megatron_formula_values_and_grads(use_is, coef):
    mlm.configure(LossConfig(policy_loss="ppo"))
    kw = dict(clamp_eps_lower=0.2, clamp_eps_upper=0.28, kl_beta=0.05, entropy_weight=0.01,
              is_truncation_coef=coef)
    ours_in, ref_in = _inputs(1), _inputs(1)
    if not use_is:
        ours_in.pop("inference_logprobs"), ref_in.pop("inference_logprobs")
    ours = mlm.calculate_grpo_loss(**ours_in, **kw)
    want = megatron_formula(**ref_in, **kw)
    for got, exp in zip(ours, want):
        if exp.dtype == torch.bool:
            assert torch.equal(got, exp)
        else:
            torch.testing.assert_close(got.double(), exp.detach(), rtol=1e-6, atol=1e-6)
    assert want[4].any() and want[5].any()  # the inputs exercise both clip sides
    g = torch.randn(B, S, dtype=torch.float64)
    (ours[0] * g).sum().backward()
    (want[0] * g).sum().backward()
    # the drop-in computes in fp32, the transcription in fp64
    torch.testing.assert_close(ours_in["current_logprobs"].grad, ref_in["current_logprobs"].grad, rtol=1e-5, atol=1e-6)


def test_dropin_ppo_packed_sequences_map_advantages_like_megatron():
    mlm.configure(LossConfig(policy_loss="ppo"))
    x = _inputs(2, b=1, s=12)
    x["advantages"] = torch.tensor([0.5, -1.25, 2.0], dtype=torch.float64)
    kw = dict(clamp_eps_lower=0.1, clamp_eps_upper=0.1, kl_beta=0.0, entropy_weight=0.0,
              seq_starts=[0, 4, 9], seq_lengths=[4, 5, 5])  # the last one runs past the bin
    ours = mlm.calculate_grpo_loss(**x, **kw)
    want = megatron_formula(**x, **kw)
    torch.testing.assert_close(ours[0].double(), want[0].detach(), rtol=1e-6, atol=1e-6)
    adv = mlm.dropin.token_advantages(x["advantages"], x["current_logprobs"], [0, 4, 9], [4, 5, 5])
    assert adv[0].tolist() == [0.5] * 3 + [0.0] + [-1.25] * 4 + [0.0] + [2.0] * 3


# ------------------------------------------------------------ cispo == our compute_policy_loss


@pytest.mark.parametrize("anchor", ["old", "rollout"])
def test_dropin_cispo_masked_token_mean_equals_compute_policy_loss(anchor):
    base = LossConfig(policy_loss="cispo", cispo=dataclasses.replace(LossConfig().cispo, anchor=anchor,
                                                                        eps_low=0.5, eps_high=0.3))
    mlm.configure(base)
    kl_beta, ent_w, coef = 0.05, 0.02, (1.5 if anchor == "old" else None)
    x, y = _inputs(3), _inputs(3)
    mask = torch.rand(B, S, generator=torch.Generator().manual_seed(9)) > 0.3
    out = mlm.calculate_grpo_loss(**x, clamp_eps_lower=0.2, clamp_eps_upper=0.2, kl_beta=kl_beta,
                                  entropy_weight=ent_w, is_truncation_coef=coef)
    # what train_rl.loss_func does with the per-token loss
    got = (out[0] * mask).sum() / mask.sum()

    cur = y["current_logprobs"]
    ref_cfg = dataclasses.replace(base, kl=KLConfig(coef=kl_beta, estimator="k3"), entropy_coef=ent_w,
                                  tis=TISConfig(level="token", cap=coef) if coef else TISConfig())
    want = compute_policy_loss(ref_cfg, logprobs=cur, advantages=y["advantages"], loss_mask=mask,
                               old_logprobs=y["old_logprobs"], rollout_logprobs=y["inference_logprobs"],
                               ref_logprobs=y["ref_logprobs"], entropy=-cur.exp() * cur)
    torch.testing.assert_close(got.double(), want.loss.double(), rtol=1e-6, atol=1e-7)
    got.backward(), want.loss.backward()
    torch.testing.assert_close(x["current_logprobs"].grad, cur.grad.to(x["current_logprobs"].grad.dtype),
                               rtol=1e-6, atol=1e-7)
    anchor_lp = x["old_logprobs"] if anchor == "old" else x["inference_logprobs"]
    torch.testing.assert_close(out[2].double(), (x["current_logprobs"] - anchor_lp).exp().detach(), rtol=1e-6, atol=0)
    assert torch.equal(out[4], out[2] > 1.3) and torch.equal(out[5], out[2] < 0.5)


@pytest.mark.parametrize("clip, low, high", [
    (dict(clip_max=0.2), 0.0, 0.2),  # ms-swift/TRL's cap (presets): below 1, the floor at 0 (eps_low 1)
    (dict(eps_low=10.0, eps_high=0.5), 0.0, 1.5),  # verl's "no floor": 1 - eps_low < 0 floors at 0
    (dict(clip_min=0.7, clip_max=1.1, eps_low=0.1, eps_high=9.0), 0.7, 1.1),  # absolute bounds replace offsets
], ids=["clip_max", "eps_low_over_1", "clip_min_and_max"])
def test_dropin_truncation_flags_are_the_clamps_bounds(clip, low, high):
    """truncated_from_above/below use CispoConfig.bounds(), the clamp's own [low, high]: the flagged
    tokens are exactly those whose weight the loss clamps (1 - eps_low, 1 + eps_high would disagree)."""
    cfg = LossConfig(policy_loss="cispo", cispo=dataclasses.replace(LossConfig().cispo, **clip))
    mlm.configure(cfg)
    assert clip_bounds(cfg) == cfg.cispo.bounds() == (low, high)  # eps_low > 1 floors at 0, not 1 - eps_low
    x = _inputs(4)
    x["old_logprobs"] = x["current_logprobs"].detach() + torch.linspace(-2, 2, B * S, dtype=torch.float64).reshape(B, S)
    x["inference_logprobs"] = None  # no sampler correction (w_is): the loss is the clamp alone
    out = mlm.calculate_grpo_loss(**x, clamp_eps_lower=0.2, clamp_eps_upper=0.2, kl_beta=0.0, entropy_weight=0.0)
    ratios = out[2]
    assert (ratios > high).any() and (low == 0.0 or (ratios < low).any())  # both sides are exercised
    assert torch.equal(out[4], ratios > high) and torch.equal(out[5], ratios < low)
    # the loss's weight is sg(clamp(r, low, high)) * A: its gradient wrt log pi, per token, says where it clamps
    out[0].sum().backward()
    weight = -x["current_logprobs"].grad / x["advantages"].reshape(-1, 1)
    torch.testing.assert_close(weight, ratios.clamp(low, high).to(weight.dtype), rtol=1e-6, atol=1e-9)


def test_rollout_anchor_needs_inference_logprobs_and_rejects_truncation_coef():
    mlm.configure(LossConfig(cispo=dataclasses.replace(LossConfig().cispo, anchor="rollout")))
    x = _inputs(4)
    kw = dict(clamp_eps_lower=0.2, clamp_eps_upper=0.2, kl_beta=0.0, entropy_weight=0.0)
    with pytest.raises(ValueError, match="--rl-inference-logprobs-is-correction"):
        mlm.calculate_grpo_loss(**{**x, "inference_logprobs": None}, **kw)
    with pytest.raises(ValueError, match="double-count.*Drop the flag"):
        mlm.calculate_grpo_loss(**x, **kw, is_truncation_coef=2.0)


def test_nonfinite_sampler_logprob_drops_token_with_finite_grad():
    mlm.configure(LossConfig(cispo=dataclasses.replace(LossConfig().cispo, anchor="rollout")))
    x = _inputs(5)
    x["inference_logprobs"][1, 2] = -math.inf
    x["inference_logprobs"][0, 0] = math.nan
    loss, _, ratios, *_ = mlm.calculate_grpo_loss(**x, clamp_eps_lower=0.2, clamp_eps_upper=0.2,
                                                  kl_beta=0.0, entropy_weight=0.0)
    assert loss[1, 2] == 0 and loss[0, 0] == 0 and ratios[1, 2] == 1
    loss.sum().backward()
    g = x["current_logprobs"].grad
    assert torch.isfinite(g).all() and g[1, 2] == 0 and g[0, 1] != 0


# ------------------------------------------------------------ --cispo-* flags


def test_extra_args_provider_flags_map_onto_loss_config():
    parser = mlm.extra_args_provider(argparse.ArgumentParser())
    assert mlm.extra_args_provider(parser) is parser  # a second call adds nothing (no argparse conflict)
    args = parser.parse_args(["--cispo-anchor", "rollout", "--cispo-eps-high", "3", "--cispo-token-mask",
                              "--cispo-policy-loss", "cispo", "--cispo-ppo-dual-clip", "3.0",
                              "--cispo-temperature", "0.7"])
    cfg = mlm.loss_config_from_args(args)
    assert (cfg.cispo.anchor, cfg.cispo.eps_high, cfg.cispo.token_mask, cfg.ppo.dual_clip) == ("rollout", 3.0, True, 3.0)
    assert cfg.cispo.eps_low == LossConfig().cispo.eps_low  # unset flags keep LossConfig's defaults
    assert mlm.loss_config_from_args(parser.parse_args([])) == LossConfig()
    with pytest.raises(SystemExit):
        parser.parse_args(["--cispo-anchor", "newest"])


def test_invalid_flag_value_error_names_the_flag_and_the_field():
    args = argparse.Namespace(cispo_eps_low=-1.5)
    with pytest.raises(ConfigError, match=r"--cispo-eps-low=-1\.5.*eps_low must be finite and >= 0"):
        mlm.loss_config_from_args(args)


@pytest.mark.parametrize("change,flag", [
    (dict(loss_agg="seq_mean_token_mean"), "token_mean"),
    (dict(tis=TISConfig(level="token")), "--rl-importance-sampling-truncation-coef"),
    (dict(kl=KLConfig(coef=0.1)), "--grpo-kl-beta"),
    (dict(entropy_coef=0.1), "--grpo-entropy-term-weight"),
    (dict(correction=CorrectionConfig(geo_rs=(0.9, 1.1))), "off-policy corrections need the policy step"),
    (dict(correction=CorrectionConfig(mis=(0.5, 2.0))), "off-policy corrections need the policy step"),
    (dict(head="fused_grad"), "get_logprobs never receives.*use --cispo-head fused"),
])
def test_configs_the_dropin_cannot_honour_are_rejected_with_the_megatron_flag(change, flag):
    with pytest.raises(ConfigError, match=flag):
        mlm.configure(dataclasses.replace(LossConfig(), **change))


def test_dropin_does_not_mask_a_nonfinite_current_logprob_like_compute_policy_loss():
    # One rule for both paths: a sampler's -inf is dropped, the current policy's surfaces.
    mlm.configure(LossConfig(policy_loss="cispo"))
    x = _inputs(6)
    cur = x["current_logprobs"].detach().clone()
    cur[0, 1] = -math.inf
    x["current_logprobs"] = cur.requires_grad_(True)
    loss = mlm.calculate_grpo_loss(**x, clamp_eps_lower=0.2, clamp_eps_upper=0.2, kl_beta=0.0,
                                   entropy_weight=0.0)[0]
    finite = torch.isfinite(loss)
    assert not finite[0, 1] and finite.sum() == B * S - 1
    want = compute_policy_loss(LossConfig(policy_loss="cispo"), logprobs=cur.detach(), advantages=x["advantages"],
                               loss_mask=torch.ones(B, S, dtype=torch.bool), old_logprobs=x["old_logprobs"])
    assert want.metrics.values()["policy/nonfinite_dropped"] == 0 and not torch.isfinite(want.loss)


# ------------------------------------------------------------ bf16 logprob precision (documented)

DOC = Path(__file__).resolve().parents[2] / "docs" / "integration.md"


def bf16_ratio_error(magnitude: float, n: int = 200_000, seed: int = 0) -> dict[str, float]:
    """Relative error |r_bf16 / r - 1| of the ratio r = exp(lp - lp_anchor) when logprobs with
    |lp| uniform in [magnitude, 2 * magnitude) are rounded to bf16: the current one only (anchor
    exact, e.g. fp32 sampler logprobs), or both independently. fp64 truth; percentages."""
    g = torch.Generator().manual_seed(seed)
    lp = -magnitude * (1 + torch.rand(2, n, generator=g, dtype=torch.float64))
    err = lp.to(torch.bfloat16).double() - lp  # rounding error of each logprob
    one, both = err[0].exp().sub(1).abs(), (err[0] - err[1]).exp().sub(1).abs()
    return {"one_max": 100 * one.max().item(), "one_mean": 100 * one.mean().item(),
            "both_max": 100 * both.max().item(), "both_mean": 100 * both.mean().item()}


@pytest.mark.parametrize("magnitude", [1, 8, 16])
def test_bf16_logprob_ratio_error_is_the_one_documented(magnitude):
    e = bf16_ratio_error(magnitude)
    # bf16 keeps 8 significant bits: half a spacing is |lp| * 2**-8 at the bottom of the range
    bound = math.expm1(magnitude * 2.0 ** -8)
    assert 0.99 * bound < e["one_max"] / 100 <= bound * (1 + 1e-9)
    row = (f"| [{magnitude}, {2 * magnitude}) | {e['one_max']:.2f}% | {e['one_mean']:.2f}% | "
           f"{e['both_max']:.2f}% | {e['both_mean']:.2f}% |")
    assert row in DOC.read_text(), f"docs/integration.md section 2's precision table lacks the measured row {row}"
