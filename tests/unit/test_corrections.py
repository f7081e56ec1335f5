"""Off-policy corrections (losses/corrections.py): token MIS, Geo-RS, OPSM and M2PO's keep mask.

Each rule against its formula on hand-made tensors (inclusive / strict boundaries, the ratio each
anchor uses, -inf anchors, [b] and [b, s] advantages, a packed row of two sequences), then
transcriptions of the peers' code, the registry rules, and the contract that dropped tokens stay
in the denominator and get exactly zero gradient.
"""
import math

import pytest
import torch

from megatron_cispo.config import LossConfig, from_dict
from megatron_cispo.losses import (check_loss_config, compute_policy_loss, per_token_policy_loss, required_inputs,
                                   valid_tokens)
from megatron_cispo.losses.corrections import correction_keep
from megatron_cispo.losses.metrics import Metrics
from megatron_cispo.step.forward import _segment_sum

LN = math.log


def config(anchor="old", loss="cispo", tis=None, **correction):
    d = {"policy_loss": loss, "correction": correction}
    if loss == "cispo":
        d["cispo"] = {"anchor": anchor}
    if tis is not None:
        d["tis"] = tis
    return from_dict(LossConfig, d, path="loss")


def per_token(cfg, lp, adv, mask=None, **kw):
    mask = torch.ones(lp.shape, dtype=torch.bool) if mask is None else mask
    return per_token_policy_loss(cfg, lp, advantages=adv, loss_mask=mask, **kw)


def keep_of(cfg, lp, adv, mask, old=None, rollout=None, seq_sum=None):
    """The corrections' keep mask alone, as per_token_policy_loss builds it."""
    m = Metrics()
    kw = {} if seq_sum is None else {"seq_sum": seq_sum}
    adv = adv if adv.dim() == 2 else adv[:, None].expand_as(lp)
    keep = correction_keep(cfg.correction, check_loss_config(cfg).anchor_for(cfg), logprobs=lp, old=old,
                           rollout=rollout, advantages=adv, valid=mask, m=m, **kw)
    return keep & mask, m.values()


# --------------------------------------------------------------------------------- MIS


def test_mis_keeps_tokens_inside_the_band_inclusive_on_rho_under_the_old_anchor():
    # rho = 1 exactly (old == rollout) on tokens 0 and 3; 3 and 1/3 elsewhere. pi_theta is far off
    # (r = e^2) everywhere, so a rule on r instead of rho would drop every token.
    rollout = torch.tensor([[-1.0, -1.0, -1.0, -2.0]])
    old = rollout + torch.tensor([[0.0, LN(3.0), -LN(3.0), 0.0]])
    lp = (rollout + 2.0).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 1.0, 2.0]])
    base, valid0, _ = per_token(config(), lp, adv, old_logprobs=old, rollout_logprobs=rollout)
    for band, kept in [((1.0, 3.5), [1, 1, 0, 1]), ((0.25, 1.0), [1, 0, 1, 1]), ((1.0, 1.0), [1, 0, 0, 1]),
                       ((math.nextafter(1.0, 2.0), 3.5), [0, 1, 0, 0]), ((0.0, math.inf), [1, 1, 1, 1])]:
        loss, valid, m = per_token(config(mis=list(band)), lp, adv, old_logprobs=old, rollout_logprobs=rollout)
        want = torch.tensor([kept], dtype=torch.bool)
        assert torch.equal(valid, valid0) and valid.all()
        assert torch.equal(loss, torch.where(want, base, 0.0)), band
        values = m.values()
        assert values["correction/mis_masked_frac"].item() == 1 - sum(kept) / 4
        assert values["correction/mis_ratio_min"].item() == pytest.approx(1 / 3, rel=1e-6)
        assert values["correction/mis_ratio_max"].item() == pytest.approx(3.0, rel=1e-6)


def test_mis_under_the_rollout_anchor_acts_on_r_and_needs_no_pi_old():
    rollout = torch.tensor([[-1.0, -1.0, -1.0]])
    lp = rollout + torch.tensor([[0.0, LN(3.0), -LN(3.0)]])  # r = 1, 3, 1/3
    cfg = config("rollout", mis=[0.5, 2.0])
    assert required_inputs(cfg) == {"rollout_logprobs"}
    loss, _, m = per_token(cfg, lp, torch.ones(1, 3), rollout_logprobs=rollout)  # no old_logprobs
    assert loss[0, 0].item() != 0.0 and loss[0, 1:].eq(0).all()
    assert m.values()["correction/mis_masked_frac"].item() == pytest.approx(2 / 3)
    # ... and so does rollout_is, whose anchor is always the sampler
    loss, _, _ = per_token(config(loss="rollout_is", mis=[0.5, 2.0]), lp, torch.ones(1, 3), rollout_logprobs=rollout)
    assert loss[0, 1:].eq(0).all()


def test_mis_with_token_tis_capped_at_or_above_hi_is_icepop_exactly():
    # IcePop (slime THUDM/slime@624b824a slime/backends/megatron_utils/loss.py::icepop_function; NeMo-RL's
    # truncated_importance_sampling_type="icepop" is the same rule): pg_loss * ice_weight, with
    #   ice_ratio = torch.exp(train_log_probs - rollout_log_probs)
    #   ice_weight = torch.where((ice_ratio >= args.tis_clip_low) & (ice_ratio <= args.tis_clip), ice_ratio, 0)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 9, generator=g) * 3
    rollout = old - 0.6 * torch.randn(4, 9, generator=g)
    lp0 = old + 0.2 * torch.randn(4, 9, generator=g)
    adv = torch.randn(4, generator=g)
    lo, hi = 0.5, 2.0
    lp = lp0.clone().requires_grad_()
    pg, _, _ = per_token(config(), lp, adv, old_logprobs=old, rollout_logprobs=rollout)
    ice_ratio = torch.exp(old - rollout)
    ice_weight = torch.where((ice_ratio >= lo) & (ice_ratio <= hi), ice_ratio, torch.zeros_like(ice_ratio))
    want = pg * ice_weight
    (want_grad,) = torch.autograd.grad(want.sum(), lp)
    assert 0 < (ice_weight == 0).sum() < ice_weight.numel()  # the band really drops some tokens
    for cap in (hi, 10.0):
        lp = lp0.clone().requires_grad_()
        got, _, _ = per_token(config(mis=[lo, hi], tis={"level": "token", "cap": cap}), lp, adv,
                              old_logprobs=old, rollout_logprobs=rollout)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), lp)[0], want_grad, rtol=1e-6, atol=0)


# --------------------------------------------------------------------------------- Geo-RS


def test_geo_rs_drops_sequences_by_the_geometric_mean_over_valid_tokens_inclusive():
    rollout = torch.full((3, 4), -1.0)
    d = torch.tensor([[0.1, -0.1, 0.3, 5.0],     # valid mean 0.1 -> 1.105; token 3 untrained
                      [0.0, 0.0, 0.0, 0.0],      # geo exactly 1
                      [0.04, 0.04, 0.04, 0.04]])  # geo 1.041 (the product 1.17 would be out)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    old = rollout + d
    for band, kept in [((0.9, 1.05), [0, 1, 1]), ((1.0, 1.0), [0, 1, 0]), ((1.0, 1.2), [1, 1, 1]),
                       ((0.5, math.nextafter(1.0, 0.0)), [0, 0, 0])]:
        keep, m = keep_of(config(geo_rs=list(band)), old.clone(), torch.ones(3), mask, old, rollout)
        assert torch.equal(keep, mask & torch.tensor(kept, dtype=torch.bool)[:, None]), band
        assert m["correction/geo_rs_dropped_frac"].item() == pytest.approx(1 - sum(kept) / 3)
    assert m["correction/geo_rs_ratio_max"].item() == pytest.approx(math.exp(0.1), rel=1e-6)
    assert m["correction/geo_rs_ratio_min"].item() == 1.0


def test_geo_rs_and_opsm_fractions_count_sequences_and_tokens_separately():
    # sequence 0 has 1 valid token, sequence 1 has 3; only sequence 1 is out of band
    rollout = torch.zeros(2, 3)
    old = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    _, m = keep_of(config(geo_rs=[0.9, 1.1]), old, torch.ones(2), mask, old, rollout)
    assert m["correction/geo_rs_dropped_frac"].item() == pytest.approx(0.5)
    assert m["correction/geo_rs_dropped_token_frac"].item() == pytest.approx(0.75)
    _, m = keep_of(config(opsm=0.25), rollout - old, -torch.ones(2), mask, old, rollout)
    assert m["correction/opsm_dropped_frac"].item() == pytest.approx(0.5)
    assert m["correction/opsm_dropped_token_frac"].item() == pytest.approx(0.75)


def test_geo_rs_under_the_rollout_anchor_uses_r_and_a_minus_inf_sampler_token_is_dropped_as_before():
    rollout = torch.tensor([[-1.0, -1.0, -float("inf")], [-1.0, -1.0, -1.0]])
    lp = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -0.5, -0.5]]).requires_grad_()  # r = 1 | e^0.5
    cfg = config("rollout", geo_rs=[0.9, 1.1])
    loss, valid, m = per_token(cfg, lp, torch.ones(2), rollout_logprobs=rollout)
    # the -inf token leaves `valid` as today; the rest of its sequence has geo mean 1 and is kept
    assert valid.tolist() == [[True, True, False], [True, True, True]]
    assert m.values()["policy/nonfinite_dropped"].item() == 1
    assert (loss[0, :2] != 0).all() and loss[1].eq(0).all()
    loss.sum().backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[1].eq(0).all() and lp.grad[0, 2] == 0


# --------------------------------------------------------------------------------- OPSM


def test_opsm_drops_negative_sequences_whose_mean_log_rollout_over_theta_exceeds_delta_strictly():
    lp = torch.full((4, 2), -1.0)
    rollout = torch.tensor([[-0.5, -0.5], [-0.5, -0.5], [-0.5, -0.5], [-1.0, -1.0]])  # mean 0.5, ..., 0
    adv = torch.tensor([-1.0, 0.0, 1.0, -1.0])
    mask = torch.ones(4, 2, dtype=torch.bool)
    keep, m = keep_of(config(opsm=0.25), lp, adv, mask, old=lp, rollout=rollout)
    assert keep.all(dim=1).tolist() == [False, True, True, True]  # A = 0 is not negative
    keep, _ = keep_of(config(opsm=0.5), lp, adv, mask, old=lp, rollout=rollout)
    assert keep.all()  # mean 0.5 is not > 0.5
    assert m["correction/opsm_seq_kl_max"].item() == 0.5 and m["correction/opsm_seq_kl_min"].item() == 0.0


def test_opsm_sequence_advantage_is_the_mean_of_per_token_advantages_over_valid_tokens():
    # ms-swift's rule: (A * mask).sum(-1) / mask.sum(-1); the untrained token's +9 must not count
    lp, rollout = torch.full((2, 3), -2.0), torch.full((2, 3), -1.0)  # mean log(rollout/theta) = 1
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([[1.0, -2.0, 9.0], [-1.0, -1.0, 3.0]])  # means -0.5 and +1/3
    keep, _ = keep_of(config(opsm=0.5), lp, adv, mask, old=lp, rollout=rollout)
    assert keep.any(dim=1).tolist() == [False, True]
    keep_b, _ = keep_of(config(opsm=0.5), lp, torch.tensor([-0.5, 1 / 3]), mask, old=lp, rollout=rollout)
    assert torch.equal(keep, keep_b)


def test_opsm_is_the_same_rule_under_both_anchors_and_uses_the_detached_current_policy():
    g = torch.Generator().manual_seed(1)
    rollout = -torch.rand(6, 5, generator=g) * 2
    lp = (rollout - 0.3 * torch.randn(6, 5, generator=g)).requires_grad_()
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0, -1.0, -1.0])
    old = rollout + 0.5  # a different pi_old must not matter: OPSM reads pi_rollout and pi_theta
    a, _, _ = per_token(config("old", opsm=0.05), lp, adv, old_logprobs=old, rollout_logprobs=rollout)
    b, _, _ = per_token(config("rollout", opsm=0.05), lp, adv, rollout_logprobs=rollout)
    dropped_a, dropped_b = a.detach().eq(0).all(1), b.detach().eq(0).all(1)
    assert torch.equal(dropped_a, dropped_b) and 0 < dropped_a.sum() < 6
    a.sum().backward()
    assert lp.grad[dropped_a].eq(0).all() and lp.grad[~dropped_a].ne(0).all()


# ------------------------------------------------------------------ packing: two sequences, one row


def test_packed_row_with_two_sequences_matches_padded_rows():
    g = torch.Generator().manual_seed(2)
    lengths = [3, 4]
    rollout = -torch.rand(2, 4, generator=g) * 2
    old = rollout + 0.4 * torch.randn(2, 4, generator=g)
    lp = old + 0.3 * torch.randn(2, 4, generator=g)
    adv = torch.tensor([[-1.0] * 4, [-0.5] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    cfg = config(mis=[0.6, 1.6], geo_rs=[0.8, 1.25], opsm=0.0, tis={"level": "sequence", "cap": 3.0})

    def packed(t):  # [2, 4] -> [1, 8]: seq 0's 3 tokens, its pad, then seq 1's 4 tokens
        return torch.cat([t[0, :3], t[0, 3:], t[1]])[None]
    seq_index = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    padded_loss, _, pm = per_token(cfg, lp, adv, mask, old_logprobs=old, rollout_logprobs=rollout)
    packed_loss, _, qm = per_token(cfg, packed(lp), packed(adv), packed(mask), old_logprobs=packed(old),
                                   rollout_logprobs=packed(rollout), seq_sum=_segment_sum(seq_index, 2, None))
    torch.testing.assert_close(packed_loss, packed(padded_loss), rtol=1e-6, atol=0)
    pv, qv = pm.values(), qm.values()
    assert set(pv) == set(qv)
    for key in pv:
        assert qv[key].item() == pytest.approx(pv[key].item(), rel=1e-6, abs=1e-7), key
    # the bands cut: something is dropped and something is kept
    assert 0 < pv["correction/dropped_token_frac"].item() < 1
    assert lengths == mask.sum(1).tolist()


# ----------------------------------------------------- denominator, gradient and composition contract


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_dropped_tokens_keep_the_denominator_and_get_exactly_zero_gradient(agg):
    g = torch.Generator().manual_seed(3)
    rollout = -torch.rand(5, 6, generator=g) * 2
    old = rollout + 0.3 * torch.randn(5, 6, generator=g)
    lp0 = old + 0.2 * torch.randn(5, 6, generator=g)
    adv = torch.randn(5, 6, generator=g)
    mask = torch.rand(5, 6, generator=g) > 0.2
    ref, ent = lp0 - 0.1, torch.rand(5, 6, generator=g)
    common = {"loss_agg": agg, "kl": {"coef": 0.1}, "entropy_coef": 0.01}
    plain = from_dict(LossConfig, common, path="loss")
    fixed = from_dict(LossConfig, {**common, "correction": {"mis": [0.8, 1.25], "geo_rs": [0.9, 1.1],
                                                            "opsm": 0.02}}, path="loss")
    outs, grads = [], []
    for cfg in (plain, fixed):
        lp = lp0.clone().requires_grad_()
        out = compute_policy_loss(cfg, lp, advantages=adv, loss_mask=mask, old_logprobs=old,
                                  rollout_logprobs=rollout, ref_logprobs=ref, entropy=ent)
        out.loss.backward()
        outs.append(out)
        grads.append(lp.grad)
    assert outs[0].denominator.item() == outs[1].denominator.item() > 0
    keep, _ = keep_of(fixed, lp0, adv, mask & torch.ones_like(mask), old, rollout)
    dropped = mask & ~keep
    assert 0 < dropped.sum() < mask.sum()
    # dropped: nothing at all (no policy-gradient, KL or entropy term); kept: exactly as before
    assert grads[1][dropped].eq(0).all()
    assert torch.equal(grads[1][keep], grads[0][keep])


def test_corrections_compose_with_tis_and_the_cispo_token_mask_as_a_product_of_keeps():
    g = torch.Generator().manual_seed(4)
    rollout = -torch.rand(6, 7, generator=g) * 2
    old = rollout + 0.25 * torch.randn(6, 7, generator=g)
    lp = old + 0.4 * torch.randn(6, 7, generator=g)
    adv = torch.randn(6, generator=g)
    mask = torch.ones(6, 7, dtype=torch.bool)
    base = {"cispo": {"token_mask": True}, "tis": {"level": "token", "cap": 1.5}}
    plain = from_dict(LossConfig, base, path="loss")
    both = from_dict(LossConfig, {**base, "correction": {"mis": [0.7, 1.4], "geo_rs": [0.95, 1.05]}}, path="loss")
    want, _, _ = per_token(plain, lp, adv, old_logprobs=old, rollout_logprobs=rollout)
    got, _, _ = per_token(both, lp, adv, old_logprobs=old, rollout_logprobs=rollout)
    rho = torch.exp(old - rollout)
    mis = (rho >= 0.7) & (rho <= 1.4)
    geo = torch.exp((old - rollout).mean(1, keepdim=True))
    geo_keep = (geo >= 0.95) & (geo <= 1.05)
    assert 0 < (~mis).sum() and 0 < (~geo_keep).sum() < 6
    assert torch.equal(got, torch.where(mis & geo_keep, want, 0.0))


def test_mismatch_per_sequence_log_rho_metrics():
    rollout = torch.zeros(2, 3)
    old = torch.tensor([[0.3, 0.1, 9.0], [-0.2, -0.4, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    _, _, m = per_token(config(mis=[0.0, math.inf]), old.clone(), torch.ones(2), mask, old_logprobs=old,
                        rollout_logprobs=rollout)
    v = m.values()
    assert v["mismatch/seq_log_rho_mean"].item() == pytest.approx((0.2 - 0.2) / 2, abs=1e-7)
    assert v["mismatch/seq_log_rho_min"].item() == pytest.approx(-0.2)
    assert v["mismatch/seq_log_rho_max"].item() == pytest.approx(0.2)
    assert v["correction/mis_masked_frac"].item() == 0.0


# --------------------------------------------------------------------------------- M2PO's keep


def test_keep_selection_zeroes_tokens_counts_them_and_keeps_the_denominator():
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(2, 4, generator=g)
    rollout = old - 0.1
    adv = torch.tensor([1.0, -1.0])
    keep = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    cfg = config(m2po=0.04)
    assert required_inputs(cfg) == {"old_logprobs", "rollout_logprobs"}
    with pytest.raises(ValueError, match=r"correction.m2po=0.04 needs keep"):
        compute_policy_loss(cfg, old.clone(), advantages=adv, loss_mask=torch.ones(2, 4), old_logprobs=old,
                            rollout_logprobs=rollout)
    lp = old.clone().requires_grad_()
    out = compute_policy_loss(cfg, lp, advantages=adv, loss_mask=torch.ones(2, 4), old_logprobs=old,
                              rollout_logprobs=rollout, keep=keep)
    out.loss.backward()
    assert out.denominator.item() == 8
    assert lp.grad[~keep].eq(0).all() and lp.grad[keep].ne(0).all()
    assert out.metrics.values()["correction/m2po_masked_frac"].item() == 0.25
    with pytest.raises(ValueError, match=r"keep shape \(2, 3\) does not match logprobs shape \(2, 4\)"):
        compute_policy_loss(cfg, lp, advantages=adv, loss_mask=torch.ones(2, 4), old_logprobs=old,
                            rollout_logprobs=rollout, keep=keep[:, :3])


# --------------------------------------------------------------------------------- registry rules


@pytest.mark.parametrize("cfg, message", [
    (config("rollout", m2po=0.04),
     "^cispo.anchor='rollout' cannot be combined with correction.m2po=0.04: the loss anchors on rollout_logprobs, "
     "so M2PO would double-count the off-policy correction; set correction.m2po to None or cispo.anchor to 'old'$"),
    (config(loss="rollout_is", m2po=0.5),
     "^policy_loss='rollout_is' cannot be combined with correction.m2po=0.5: the loss anchors on "
     "rollout_logprobs, so M2PO would double-count the off-policy correction; set correction.m2po to None$"),
])
def test_m2po_on_the_rollout_anchor_is_refused_in_one_line(cfg, message):
    with pytest.raises(ValueError, match=message):
        check_loss_config(cfg)
    with pytest.raises(ValueError, match=message):
        required_inputs(cfg)


@pytest.mark.parametrize("cfg, expected", [
    (config(mis=[0.5, 2.0]), {"old_logprobs", "rollout_logprobs"}),
    (config("rollout", mis=[0.5, 2.0]), {"rollout_logprobs"}),
    (config(geo_rs=[0.9, 1.1]), {"old_logprobs", "rollout_logprobs"}),
    (config("rollout", geo_rs=[0.9, 1.1]), {"rollout_logprobs"}),
    (config(loss="ppo", geo_rs=[0.9, 1.1]), {"old_logprobs", "rollout_logprobs"}),
    (config(opsm=0.5), {"old_logprobs", "rollout_logprobs"}),
    (config("rollout", opsm=0.5), {"rollout_logprobs"}),
    (config(m2po=0.04), {"old_logprobs", "rollout_logprobs"}),
    (config("rollout", mis=[0.5, 2.0], geo_rs=[0.9, 1.1], opsm=0.1), {"rollout_logprobs"}),
])
def test_required_inputs_follow_the_ratio_each_correction_uses(cfg, expected):
    assert required_inputs(cfg) == expected


@pytest.mark.parametrize("cfg, message", [
    (config(mis=[0.5, 2.0]), r"^correction.mis=\[0.5, 2.0\] needs rollout_logprobs \(the sampler's"),
    (config(loss="ppo", geo_rs=[0.9, 1.1]), r"^correction.geo_rs=\[0.9, 1.1\] needs rollout_logprobs"),
    (config(opsm=0.5), r"^correction.opsm=0.5 needs rollout_logprobs"),
    (config(m2po=0.04), r"^correction.m2po=0.04 needs rollout_logprobs"),
])
def test_a_missing_input_names_the_correction_key(cfg, message):
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=message):
        compute_policy_loss(cfg, lp, advantages=torch.ones(1), loss_mask=torch.ones(1, 2), old_logprobs=lp,
                            keep=torch.ones(1, 2, dtype=torch.bool))


def test_pre_step_valid_tokens_are_the_loss_denominator_with_a_correction_that_needs_the_sampler():
    # cispo(old) + OPSM: a -inf sampler logprob leaves the denominator before the step, as TIS's does
    rollout = torch.tensor([[-1.0, -float("inf"), -1.0]])
    old = torch.full((1, 3), -1.0)
    cfg = config(opsm=0.5)
    valid = valid_tokens(cfg, torch.ones(1, 3), old_logprobs=old, rollout_logprobs=rollout)
    assert valid.tolist() == [[True, False, True]]
    out = compute_policy_loss(cfg, old.clone(), advantages=torch.ones(1), loss_mask=torch.ones(1, 3),
                              old_logprobs=old, rollout_logprobs=rollout)
    assert out.denominator.item() == valid.sum().item() == 2 and torch.isfinite(out.loss)


# -------------------------------------------------------------- transcriptions of the peers' code


def _random_batch(seed, b=16, s=12, spread=0.15):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, s, generator=g) * 3
    old = rollout + spread * torch.randn(b, s, generator=g)
    old[0, :4] = rollout[0, :4]  # ratio exactly 1 on a few tokens: the inclusive boundary
    lp = old + spread * torch.randn(b, s, generator=g)
    lengths = torch.randint(2, s + 1, (b,), generator=g)
    mask = torch.arange(s)[None] < lengths[:, None]
    return lp, old, rollout, mask, torch.randn(b, generator=g)


@pytest.mark.parametrize("band", [(0.85, 1.15), (1.0, 1.2), (0.8, 1.0)])
def test_mis_matches_areal_and_skyrl_token_keep_rules(band):
    lp, old, rollout, mask, adv = _random_batch(10)
    lo, hi = band
    keep, _ = keep_of(config(mis=list(band)), lp, adv, mask, old, rollout)
    # AReaL areal-project/AReaL@12372a8b areal/utils/functional/functional.py,
    # apply_rejection_sampling (level="token", metric="ratio", action="mask") + _check_bounds
    log_ratio = old.detach().float() - rollout.detach().float()
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    metric = torch.exp(log_ratio)
    areal = (metric >= lo) & (metric <= hi)
    # SkyRL NovaSky-AI/SkyRL@a9564572 skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py
    # compute_token_mask, with safe_exp_delta from utils/torch_utils.py (read @14143cc7)
    token_is_ratio = torch.clamp((old - rollout).to(torch.float32), -20.0, 20.0).exp().to(old.dtype)
    in_bounds = (token_is_ratio >= lo) & (token_is_ratio <= hi)
    skyrl = (in_bounds | (mask == 0)).float()
    assert torch.equal(keep, areal & mask) and torch.equal(keep, skyrl.bool() & mask)
    assert 0 < (mask & ~keep).sum() < mask.sum()
    assert keep[0, :4].all() == (lo <= 1.0 <= hi)


def _margin_ok(seq_value, bounds, eps=1e-4):
    """Peers compute in fp32, we in fp64: keep the data away from the bounds."""
    return all((seq_value - b).abs().min() > eps for b in bounds)


@pytest.mark.parametrize("band", [(0.97, 1.03), (0.99, 1.05)])
def test_geo_rs_matches_verl_geometric_skyrl_geometric_and_areal_sequence_mask(band):
    lp, old, rollout, mask, adv = _random_batch(11, spread=0.1)
    lo, hi = band
    keep, _ = keep_of(config(geo_rs=list(band)), lp, adv, mask, old, rollout)
    m = mask.float()
    log_ratio = old - rollout
    # verl volcengine/verl@2f2996b7 verl/trainer/ppo/rollout_corr_helper.py::compute_rollout_rejection_mask,
    # rollout_rs="geometric", with verl_F.masked_mean = (v * m).sum(axis) / (m.sum(axis) + 1e-8)
    log_ratio_mean = ((log_ratio * m).sum(-1) / (m.sum(-1) + 1e-8)).unsqueeze(-1)
    log_ratio_mean_safe = torch.clamp(log_ratio_mean, min=-20.0, max=20.0)
    rollout_is_weights = torch.exp(log_ratio_mean_safe).expand_as(log_ratio)
    verl = (rollout_is_weights >= lo) & (rollout_is_weights <= hi)
    # SkyRL NovaSky-AI/SkyRL@a9564572 off_policy_correction_utils.py::compute_sequence_mask("geometric")
    num_tokens = m.sum(dim=-1, keepdim=True).clamp(min=1.0)
    seq_tis_log_ratio = (log_ratio * m).sum(dim=-1, keepdim=True)
    geo_mean_ratio = torch.clamp(seq_tis_log_ratio / num_tokens, -20.0, 20.0).exp()
    skyrl = ~(geo_mean_ratio > hi) & ~(geo_mean_ratio < lo)
    # AReaL areal-project/AReaL@12372a8b functional.py::apply_rejection_sampling, 2D padded path,
    # level="sequence", metric="ratio", agg="mean", action="mask"
    masked_agg = torch.where(mask, log_ratio, 0.0)
    seq_agg = masked_agg.sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    areal = (torch.exp(seq_agg) >= lo) & (torch.exp(seq_agg) <= hi)
    assert _margin_ok(geo_mean_ratio, band)
    for peer in (verl, skyrl.expand_as(mask), areal.expand_as(mask)):
        assert torch.equal(keep, peer & mask)
    dropped = ~keep.any(1)
    assert 0 < dropped.sum() < mask.shape[0]


@pytest.mark.parametrize("delta", [0.0, 0.05])
def test_opsm_matches_trl_get_off_policy_mask_slime_compute_opsm_mask_and_ms_swift(delta):
    lp, old, rollout, mask, adv = _random_batch(12, spread=0.2)
    keep, _ = keep_of(config("rollout", opsm=delta), lp, adv, mask, None, rollout)
    m = mask.float()
    # TRL huggingface/trl@f2cd5771 trl/trainer/grpo_trainer.py::GRPOTrainer.get_off_policy_mask
    kl_div = rollout - lp.detach()
    avg_seq_kl = (kl_div * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1.0)
    trl = ((adv[:, None] >= 0) | (avg_seq_kl <= delta)).to(dtype=m.dtype)
    # slime THUDM/slime@624b824a slime/utils/ppo_utils.py::compute_opsm_mask (one sample at a time),
    # called by loss.py::policy_loss_function with full_old_log_probs = its ratio's denominator:
    # rollout_log_probs with --use-rollout-logprobs (ours by default), else pi_old (opsm_ref: old)
    def slime_opsm(old_log_probs):
        out = []
        for full_log_prob, full_old_log_prob, advantage, loss_mask in zip(lp, old_log_probs, adv, m):
            seq_kl = ((full_old_log_prob - full_log_prob) * loss_mask).sum() / torch.clamp_min(loss_mask.sum(), 1)
            out.append(1 - ((advantage < 0) & (seq_kl > delta)).float())
        return torch.stack(out).bool()[:, None].expand_as(mask) & mask
    slime = slime_opsm(rollout)
    keep_old_ref, _ = keep_of(config("old", opsm=delta, opsm_ref="old"), lp, adv, mask, old, rollout)
    assert torch.equal(keep_old_ref, slime_opsm(old))
    # ms-swift modelscope/ms-swift@3602360a swift/rlhf_trainers/grpo_trainer.py: per-token advantages
    # reduced by (A * mask).sum(-1) / mask.sum(-1).clamp(min=1), then _compute_off_policy_sequence_mask
    per_token_adv = adv[:, None] * torch.linspace(0.5, 1.5, lp.shape[1])[None]  # varies, same sign
    seq_advantages = (per_token_adv * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    seq_mean_log_ratio = ((rollout - lp) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    swift = ~((seq_mean_log_ratio > delta) & (seq_advantages < 0))
    keep_tok, _ = keep_of(config("old", opsm=delta), lp, per_token_adv, mask, old, rollout)
    assert _margin_ok(avg_seq_kl, [delta])
    assert torch.equal(keep, trl.bool().expand_as(mask) & mask)
    assert torch.equal(keep, slime)
    assert torch.equal(keep_tok, swift[:, None].expand_as(mask) & mask)
    dropped = ~keep.any(1)
    assert 0 < dropped.sum() < (adv < 0).sum()
