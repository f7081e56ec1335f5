"""Hand-computed values, gradient identities and numeric guards of the built-in policy losses."""
import math

import pytest
import torch

from megatron_cispo.config import CispoConfig, KLConfig, LossConfig, PPOConfig, TISConfig
from megatron_cispo.losses import aggregate, compute_policy_loss

LN = math.log


def probs(*p):
    """[1, n] logprobs of the given probabilities."""
    return torch.log(torch.tensor([list(p)], dtype=torch.float32))


def leaf(t):
    return t.clone().requires_grad_(True)


def run(cfg, lp, adv, mask=None, **kw):
    mask = torch.ones_like(lp) if mask is None else mask
    return compute_policy_loss(cfg, lp, advantages=adv, loss_mask=mask, **kw)


def test_logprobs_may_be_passed_by_position_or_by_name():
    by_position = compute_policy_loss(LossConfig(), NEW, advantages=ADV, loss_mask=torch.ones_like(NEW),
                                      old_logprobs=OLD)
    by_name = compute_policy_loss(LossConfig(), logprobs=NEW, advantages=ADV, loss_mask=torch.ones_like(NEW),
                                  old_logprobs=OLD)
    assert by_position.loss.item() == by_name.loss.item() != 0.0
    with pytest.raises(TypeError):  # everything after logprobs stays keyword-only
        compute_policy_loss(LossConfig(), NEW, ADV, torch.ones_like(NEW))


# ratios pi / pi_old = 2, 0.5, 8, 1
OLD = probs(0.1, 0.4, 0.05, 0.5)
NEW = probs(0.2, 0.2, 0.4, 0.5)
ADV = torch.tensor([[1.0, -1.0, 2.0, 0.5]])


def test_cispo_default_value_is_clamped_weight_times_advantage_times_logprob():
    out = run(LossConfig(), leaf(NEW), ADV, old_logprobs=OLD)
    # weights clamp([2, 0.5, 8, 1], 0, 5) = [2, 0.5, 5, 1]
    hand = -(2 * 1 * LN(0.2) + 0.5 * -1 * LN(0.2) + 5 * 2 * LN(0.4) + 1 * 0.5 * LN(0.5)) / 4
    assert out.loss.item() == pytest.approx(hand, rel=1e-6)
    assert out.denominator.item() == 4.0 and out.denominator.dtype == torch.float32
    assert not out.denominator.requires_grad
    m = out.metrics.values()
    assert m["cispo/ratio_mean"].item() == pytest.approx((2 + 0.5 + 8 + 1) / 4, rel=1e-6)
    assert m["cispo/weight_mean"].item() == pytest.approx((2 + 0.5 + 5 + 1) / 4, rel=1e-6)
    assert m["cispo/clip_frac_high"].item() == 0.25
    assert m["cispo/clip_frac_low"].item() == 0.0
    assert m["cispo/ratio_min"].item() == pytest.approx(0.5, rel=1e-6)
    assert m["cispo/ratio_max"].item() == pytest.approx(8.0, rel=1e-6)
    assert m["policy/tokens"].item() == 4 and m["policy/nonfinite_dropped"].item() == 0
    assert m["policy/loss"].item() == pytest.approx(hand, rel=1e-6)


def test_cispo_gradient_is_minus_clamped_ratio_times_advantage_over_denominator_exactly():
    lp = leaf(NEW)
    cfg = LossConfig(cispo=CispoConfig(eps_low=0.2, eps_high=0.28))
    out = run(cfg, lp, ADV, old_logprobs=OLD)
    out.loss.backward()
    weight = torch.exp(NEW - OLD).clamp(0.8, 1.28)
    assert torch.equal(lp.grad, -(weight * ADV) / 4)


def test_cispo_token_mask_zeroes_ppo_clipped_tokens_but_keeps_them_in_denominator():
    # ratios 2, 0.5, 0.5, 2 with A = +, +, -, -: tokens 0 (A>0, r>1.28) and 2 (A<0, r<0.8) are masked
    old, adv = probs(0.1, 0.4, 0.4, 0.1), torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    lp = leaf(probs(0.2, 0.2, 0.2, 0.2))
    out = run(LossConfig(cispo=CispoConfig(token_mask=True)), lp, adv, old_logprobs=old)
    assert out.loss.item() == pytest.approx(-(0.5 * 1 * LN(0.2) + 2 * -1 * LN(0.2)) / 4, rel=1e-6)
    assert out.metrics.values()["cispo/masked_frac"].item() == 0.5
    out.loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -0.5 / 4, 0.0, 2.0 / 4]]), rtol=1e-6, atol=0)


def test_ppo_clipped_surrogate_hand_values_and_zero_grad_on_clipped_tokens():
    lp = leaf(NEW)
    out = run(LossConfig(policy_loss="ppo"), lp, ADV, old_logprobs=OLD)
    # max(-rA, -clip(r, .8, 1.2)A): -1.2, 0.8, -2.4, -0.5 ; only the last token's branch is live
    assert out.loss.item() == pytest.approx((-1.2 + 0.8 - 2.4 - 0.5) / 4, rel=1e-6)
    out.loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, 0.0, 0.0, -0.5 / 4]]), atol=1e-7, rtol=0)
    assert out.metrics.values()["ppo/masked_frac"].item() == 0.75
    m = out.metrics.values()
    assert m["ppo/clip_frac_high"].item() == 0.5 and m["ppo/clip_frac_low"].item() == 0.25


def test_ppo_dual_clip_bounds_negative_advantage_loss_by_c_times_minus_a():
    old, adv = probs(0.05, 0.1), torch.tensor([[-1.0, -1.0]])
    lp = leaf(probs(0.4, 0.15))  # r = 8 -> loss 8 > 3 is dual-clipped; r = 1.5 -> loss 1.5 stays
    out = run(LossConfig(policy_loss="ppo", ppo=PPOConfig(dual_clip=3.0)), lp, adv, old_logprobs=old)
    assert out.loss.item() == pytest.approx((3.0 + 1.5) / 2, rel=1e-6)
    assert out.metrics.values()["ppo/dual_clip_frac"].item() == 0.5
    out.loss.backward()
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 1].item() == pytest.approx(1.5 / 2, rel=1e-6)


def test_rollout_is_zeroes_out_of_band_tokens_with_raw_ratio_weight_in_band():
    rollout = probs(0.1, 0.4, 0.4, 0.5)
    lp = leaf(probs(0.2, 0.2, 0.5, 0.5))  # r = 2, 0.5, 1.25, 1 ; band [0.8, 1.28]
    out = run(LossConfig(policy_loss="rollout_is"), lp, ADV, rollout_logprobs=rollout)
    assert out.loss.item() == pytest.approx(-(1.25 * 2 * LN(0.5) + 1 * 0.5 * LN(0.5)) / 4, rel=1e-6)
    assert out.metrics.values()["rollout_is/masked_frac"].item() == 0.5
    out.loss.backward()
    r = torch.exp(lp.detach() - rollout)
    keep = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    assert torch.equal(lp.grad, -(r * keep * ADV) / 4)


def test_async_old_anchor_weights_are_exactly_one_and_rollout_anchor_clamps():
    lp = leaf(probs(0.5, 0.2, 0.9, 0.3))
    stale = lp.detach() - torch.tensor([[LN(8.0), 0.0, LN(1.5), LN(10.0)]])  # pi / pi_rollout = 8, 1, 1.5, 10
    adv = torch.tensor([[1.0, -2.0, 0.5, 1.0]])
    old_out = run(LossConfig(), lp, adv, old_logprobs=lp.detach(), rollout_logprobs=stale)
    old_out.loss.backward()
    assert torch.equal(lp.grad, -adv / 4)  # every weight exactly 1
    old_m = old_out.metrics.values()
    assert old_m["cispo/clip_frac_high"].item() == 0 and old_m["cispo/clip_frac_low"].item() == 0
    assert old_m["cispo/ratio_min"].item() == 1.0 == old_m["cispo/ratio_max"].item()
    assert old_m["mismatch/abs_logprob_diff_mean"].item() > 0

    lp.grad = None
    roll_out = run(LossConfig(cispo=CispoConfig(anchor="rollout")), lp, adv, rollout_logprobs=stale)
    roll_out.loss.backward()
    assert roll_out.metrics.values()["cispo/clip_frac_high"].item() == 0.5
    assert torch.allclose(lp.grad, -torch.tensor([[5.0, 1.0, 1.5, 5.0]]) * adv / 4, rtol=1e-6, atol=0)


def test_compat_ms_swift_epsilon_high_5_equals_eps_low_1_eps_high_4():
    lp, old = leaf(probs(0.2, 0.2, 0.4, 0.5, 0.01)), probs(0.1, 0.4, 0.05, 0.5, 0.5)
    adv = torch.tensor([[1.0, -1.0, 2.0, 0.5, -3.0]])
    # ms-swift, --loss_type cispo --epsilon_high 5.0 (absolute cap, no floor):
    #   w = clamp(exp(logps - old_logps), max=epsilon_high).detach(); loss = -w * A * logps
    w = torch.clamp(torch.exp(lp.detach() - old), max=5.0)
    swift = (-w * adv * lp.detach()).sum() / 5
    ours = run(LossConfig(cispo=CispoConfig(eps_low=1.0, eps_high=4.0)), lp, adv, old_logprobs=old)
    assert ours.loss.item() == pytest.approx(swift.item(), rel=1e-6)


@pytest.mark.parametrize("low,high", [(0.2, 0.28), (1.0, 4.0), (0.0, 5.0)])
def test_compat_skyrl_cispo_eps_clip_offsets_map_one_to_one(low, high):
    lp, old = leaf(probs(0.2, 0.2, 0.4, 0.5)), OLD
    # SkyRL compute_policy_loss_cispo, cispo_eps_clip_low/high = low/high:
    #   clamped = clamp(ratio, 1 - low, 1 + high); loss = -A * clamped.detach() * log_probs
    clamped = torch.clamp(torch.exp(lp.detach() - old), 1 - low, 1 + high)
    skyrl = (-ADV * clamped * lp.detach()).sum() / 4
    ours = run(LossConfig(cispo=CispoConfig(eps_low=low, eps_high=high)), lp, ADV, old_logprobs=old)
    assert ours.loss.item() == pytest.approx(skyrl.item(), rel=1e-6)


# ---------------------------------------------------------------- aggregation

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, float("inf"), 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("mode,loss_sum,denom", [
    ("token_mean", 10.0, 4.0),
    ("seq_mean_token_mean", 6.0 / 3 + 4.0 / 1, 2.0),
    ("seq_mean_token_sum", 10.0, 2.0),
    ("seq_mean_token_sum_norm", 10.0 / 5, 2.0),
])
def test_aggregation_modes_hand_values_ignore_masked_garbage_and_empty_sequences(mode, loss_sum, denom):
    s, d = aggregate(PER_TOKEN, MASK, mode, max_len=5)
    assert (s.item(), d.item()) == (pytest.approx(loss_sum), denom)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_aggregation_sums_over_microbatches_equal_the_full_batch(mode):
    full = aggregate(PER_TOKEN, MASK, mode, max_len=5)
    parts = [aggregate(PER_TOKEN[i:j], MASK[i:j], mode, max_len=5) for i, j in ((0, 1), (1, 3))]
    assert sum(p[0] for p in parts).item() == pytest.approx(full[0].item())
    assert sum(p[1] for p in parts).item() == full[1].item()


def test_seq_mean_token_mean_through_compute_policy_loss_hand_value():
    old = torch.zeros(2, 3)
    lp = leaf(torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = run(LossConfig(loss_agg="seq_mean_token_mean", cispo=CispoConfig(eps_low=1.0, eps_high=0.0)), lp,
              torch.tensor([1.0, 2.0]), mask, old_logprobs=old)
    # weights clamp(exp(lp), 0, 1) = exp(lp); seq 0 mean of -w*1*lp, seq 1 single token
    s0 = (math.exp(-1) * 1 + math.exp(-2) * 2) / 2
    s1 = math.exp(-4) * 2 * 4
    assert out.loss.item() == pytest.approx((s0 + s1) / 2, rel=1e-6)
    assert out.denominator.item() == 2.0


def test_zero_valid_tokens_give_zero_loss_and_zero_grad():
    lp = leaf(NEW)
    out = run(LossConfig(), lp, ADV, torch.zeros(1, 4), old_logprobs=OLD)
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.denominator.item() == 0.0
    assert torch.equal(lp.grad, torch.zeros_like(lp))
    assert out.metrics.mins["cispo/ratio_min"].item() == math.inf
    assert out.metrics.maxs["cispo/ratio_max"].item() == -math.inf


# ---------------------------------------------------------------- numerics, TIS, KL, entropy


def test_minus_inf_rollout_logprob_drops_token_counted_and_no_nan_anywhere():
    lp = leaf(probs(0.2, 0.2, 0.4, 0.5))
    rollout = probs(0.1, 0.4, 0.05, 0.5)
    rollout[0, 1] = -math.inf
    garbage = lp.detach().clone()
    garbage[0, 1] = math.nan  # padding-like garbage on the dropped token must not leak
    cfg = LossConfig(cispo=CispoConfig(anchor="rollout"))
    out = run(cfg, lp, ADV, rollout_logprobs=rollout, old_logprobs=garbage)
    out.loss.backward()
    assert out.metrics.values()["policy/nonfinite_dropped"].item() == 1 and out.denominator.item() == 3
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all() and lp.grad[0, 1].item() == 0.0
    assert all(torch.isfinite(v) for v in out.metrics.values().values())
    hand = -(2 * 1 * LN(0.2) + 5 * 2 * LN(0.4) + 1 * 0.5 * LN(0.5)) / 3
    assert out.loss.item() == pytest.approx(hand, rel=1e-6)


def test_garbage_at_padded_positions_never_reaches_loss_or_grad():
    nan = math.nan
    lp = leaf(torch.tensor([[-1.0, nan], [-2.0, -math.inf]]))
    old = torch.tensor([[-1.5, nan], [-1.0, nan]])
    adv = torch.tensor([[1.0, nan], [-1.0, math.inf]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    for name in ("cispo", "ppo"):
        lp.grad = None
        out = run(LossConfig(policy_loss=name), lp, adv, mask, old_logprobs=old, ref_logprobs=old,
                  entropy=torch.tensor([[0.5, nan], [0.5, nan]]))
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all(), name
        assert lp.grad[:, 1].abs().sum().item() == 0.0 and out.denominator.item() == 2
        assert out.metrics.values()["policy/nonfinite_dropped"].item() == 0  # padding is not "dropped"


def test_extreme_log_ratio_is_clamped_so_ppo_ratio_and_grad_stay_finite():
    lp = leaf(torch.tensor([[0.0, -1.0]]))
    old = torch.tensor([[-500.0, -1.0]])
    out = run(LossConfig(policy_loss="ppo", ppo=PPOConfig(eps_high=1e12)), lp, torch.tensor([[1.0, 1.0]]),
              old_logprobs=old)
    out.loss.backward()
    assert out.metrics.values()["ppo/ratio_max"].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()


def test_token_tis_caps_old_over_rollout_weight_and_multiplies_the_loss():
    lp, adv = leaf(probs(0.2, 0.2)), torch.tensor([[1.0, 1.0]])
    old, rollout = probs(0.2, 0.2), probs(0.2 / 3, 0.4)  # pi_old / pi_rollout = 3 -> capped 2, and 0.5
    out = run(LossConfig(tis=TISConfig(level="token", cap=2.0)), lp, adv, old_logprobs=old, rollout_logprobs=rollout)
    assert out.loss.item() == pytest.approx(-(2.0 + 0.5) * LN(0.2) / 2, rel=1e-6)
    assert out.metrics.values()["tis/capped_frac"].item() == 0.5
    assert out.metrics.values()["tis/weight_mean"].item() == pytest.approx(1.25, rel=1e-6)


def test_sequence_tis_uses_product_of_token_ratios_per_sequence():
    lp, adv = leaf(torch.full((2, 2), LN(0.2))), torch.tensor([1.0, 1.0])
    old = lp.detach().clone()
    # seq 0: ratios 1.5 * 0.5 = 0.75 ; seq 1: 3 * 2 = 6 -> capped 4
    rollout = old - torch.log(torch.tensor([[1.5, 0.5], [3.0, 2.0]]))
    out = run(LossConfig(tis=TISConfig(level="sequence", cap=4.0)), lp, adv, old_logprobs=old,
              rollout_logprobs=rollout)
    assert out.loss.item() == pytest.approx(-(0.75 * 2 + 4.0 * 2) * LN(0.2) / 4, rel=1e-6)
    assert out.metrics.values()["tis/capped_frac"].item() == 0.5


@pytest.mark.parametrize("estimator,per_token", [
    ("k1", lambda d: -d), ("k2", lambda d: 0.5 * d * d), ("k3", lambda d: math.exp(d) - d - 1)])
def test_kl_penalty_estimators_hand_values_and_entropy_bonus(estimator, per_token):
    lp, adv = leaf(probs(0.5, 0.25)), torch.zeros(1, 2)  # A = 0: only KL and entropy remain
    ref = probs(0.25, 0.75)
    ent = torch.tensor([[1.0, 3.0]])
    cfg = LossConfig(kl=KLConfig(coef=0.1, estimator=estimator), entropy_coef=0.01)
    out = run(cfg, lp, adv, old_logprobs=lp.detach(), ref_logprobs=ref, entropy=ent)
    kl = [per_token(LN(0.5)), per_token(LN(3.0))]  # d = log(pi_ref / pi)
    assert out.metrics.values()["policy/kl"].item() == pytest.approx(sum(kl) / 2, rel=1e-5)
    assert out.metrics.values()["policy/entropy"].item() == 2.0
    assert out.loss.item() == pytest.approx((0.1 * sum(kl) - 0.01 * 4.0) / 2, rel=1e-5)


def test_metric_parts_reduce_to_the_local_values():
    out = run(LossConfig(), leaf(NEW), ADV, old_logprobs=OLD, rollout_logprobs=OLD - 0.1)
    for key, (s, c) in out.metrics.sums.items():
        assert not s.requires_grad and s.dtype == torch.float32
        assert out.metrics.values()[key].item() == pytest.approx((s / c.clamp(min=1)).item())
    assert set(out.metrics.mins) == {"cispo/ratio_min"} and set(out.metrics.maxs) == {"cispo/ratio_max"}
    assert out.metrics.values()["mismatch/abs_logprob_diff_mean"].item() == pytest.approx(0.1, rel=1e-5)
    assert out.metrics.values()["mismatch/k3_kl"].item() == pytest.approx(math.exp(0.1) - 0.1 - 1, rel=1e-3)


def test_advantages_per_sequence_broadcast_like_per_token():
    lp = leaf(torch.tensor([[-1.0, -2.0], [-0.5, -0.1]]))
    old = lp.detach() + 0.3
    a = run(LossConfig(), lp, torch.tensor([1.0, -2.0]), old_logprobs=old).loss
    b = run(LossConfig(), lp, torch.tensor([[1.0, 1.0], [-2.0, -2.0]]), old_logprobs=old).loss
    assert torch.equal(a, b)


def test_bfloat16_logprobs_are_upcast_and_grad_returns_in_bfloat16():
    lp = leaf(NEW.to(torch.bfloat16))
    out = run(LossConfig(), lp, ADV, old_logprobs=OLD)
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and lp.grad.dtype == torch.bfloat16
