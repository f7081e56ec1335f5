"""Where a peer's loss differs from ours by an exact factor or by the ratio it tests, shown against
transcriptions of the peer's own code (repo/file/function@commit), as docs/mapping.md states it:

- AReaL M2PO: masked tokens leave AReaL's per-micro-batch denominator: AReaL = ours x valid/kept.
- AReaL sequence-level rejection also weights each kept sequence by its geometric-mean ratio.
- slime's default reducer divides by every rollout of the step: slime = ours x non-empty/B.
- SkyRL's token and geometric masks test rho = pi_old/pi_rollout under either CISPO anchor; ours
  test the detached r = pi_theta/pi_rollout under the rollout anchor.
- OPSM's reference (correction.opsm_ref): pi_rollout (default) or pi_old, as slime without
  --use-rollout-logprobs.
"""
import pytest
import torch

from megatron_cispo.config import LossConfig, from_dict
from megatron_cispo.losses import compute_policy_loss, per_token_policy_loss, required_inputs
from megatron_cispo.step.m2po import m2po_keep


def config(**loss):
    return from_dict(LossConfig, loss, path="loss")


# ------------------------------------------------------------------ AReaL (inclusionAI/AReaL@4aef98d8)
# areal/trainer/ppo/actor.py::grpo_loss_fn masks with _apply_m2po_masking *before* calling
# ppo_actor_loss_fn, which divides by that masked count; train_batch then scales each micro-batch by
# loss_weight_fn(mb) / total = the *unmasked* loss_mask count (areal/engine/fsdp_engine.py::
# _compute_logprobs_and_loss). Same code at 00ed924 (the commit docs/algorithm.md cites for M2PO).

def areal_get_m2po_loss_mask(sorted_m2, m2_threshold):
    n = sorted_m2.numel()
    suffix_sums = sorted_m2.flip(0).cumsum(0).flip(0)
    counts = torch.arange(n, 0, -1, device=sorted_m2.device, dtype=sorted_m2.dtype)
    avg_m2_suffix = suffix_sums / counts
    below_threshold_indices = torch.where(avg_m2_suffix < m2_threshold)[0]
    num_to_mask = below_threshold_indices[0].item() if len(below_threshold_indices) > 0 else n - 1
    loss_mask = torch.ones_like(sorted_m2, dtype=torch.bool)
    if num_to_mask > 0:
        loss_mask[:num_to_mask] = False
    return loss_mask


def areal_apply_m2po_masking(old_logp, prox_logp, loss_mask, m2_threshold):
    delta = old_logp - prox_logp
    m2 = delta * delta
    mask_flat = loss_mask.view(-1)
    m2_selected = m2.view(-1)[mask_flat]
    sorted_m2, indices = torch.sort(m2_selected, descending=True)
    restored_indices = torch.argsort(indices)
    m2_selected_mask = areal_get_m2po_loss_mask(sorted_m2, m2_threshold)[restored_indices]
    m2_full_flat = torch.zeros_like(mask_flat, dtype=torch.bool)
    m2_full_flat[mask_flat] = m2_selected_mask
    return m2_full_flat.view_as(loss_mask)


def areal_ppo_actor_loss(logprobs, proximal_logprobs, advantages, eps_clip, loss_mask, rejection=None):
    """areal/utils/functional/functional.py::ppo_actor_loss_fn (token level, no dual clip); the
    count is taken from the mask it is handed, before its own rejection sampling. rejection:
    apply_rejection_sampling's (behave_imp_weight, loss_mask), or None."""
    loss_mask_count = loss_mask.count_nonzero() or 1
    if rejection is not None:  # mask mode updates loss_mask
        behave_imp_weight, loss_mask = rejection
    ratio = torch.where(loss_mask, torch.exp(logprobs - proximal_logprobs), 0)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip)
    pg_loss = torch.max(-advantages * ratio, -advantages * clipped_ratio)
    if rejection is not None:
        pg_loss = pg_loss * behave_imp_weight
    per_token = torch.where(loss_mask, pg_loss, 0)
    return per_token.sum() / loss_mask_count, per_token


def _drift_batch(seed, b, s, log_rho):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, s, generator=g) * 2 - 0.1
    old = rollout + log_rho
    lp0 = old + 0.1 * torch.randn(b, s, generator=g)
    adv = torch.randn(b, generator=g)[:, None].expand(b, s).contiguous()
    return lp0, old, rollout, adv


def test_areal_m2po_loss_is_ours_times_valid_over_kept():
    # 120 valid tokens: 48 with (log rho)^2 < 0.02 and 72 with (log rho)^2 >= 1, so at tau = 0.02
    # both rules mask exactly the 72 (masking 71 leaves a mean > 0.98 / 49 > 0.02)
    g = torch.Generator().manual_seed(0)
    small = (torch.rand(48, generator=g) * 2 - 1) * 0.14
    big = (1 + torch.rand(72, generator=g)) * torch.where(torch.rand(72, generator=g) < 0.5, -1.0, 1.0)
    log_rho = torch.cat([small, big])[torch.randperm(120, generator=g)].view(4, 30)
    lp0, old, rollout, adv = _drift_batch(1, 4, 30, log_rho)
    valid = torch.ones(4, 30, dtype=torch.bool)
    tau = 0.02

    keep, _ = m2po_keep(old, rollout, valid, tau, row_ids=torch.arange(4))
    lp = lp0.clone().requires_grad_()
    ours = compute_policy_loss(config(policy_loss="ppo", correction={"m2po": tau}), lp, advantages=adv,
                               loss_mask=valid, old_logprobs=old, rollout_logprobs=rollout, keep=keep).loss
    (g_ours,) = torch.autograd.grad(ours, lp)

    # AReaL, one micro-batch: old_logp is the behaviour (sampler) logprob, prox_logp the recomputed pi_old
    lp = lp0.clone().requires_grad_()
    areal_mask = areal_apply_m2po_masking(rollout, old, valid, tau)
    areal_loss, _ = areal_ppo_actor_loss(lp, old, adv, 0.2, areal_mask)
    # loss_scale = loss_weight_fn(mb) / total_loss_weight, both counted on the unmasked input mask:
    # 1 with one micro-batch, so the whole factor comes from the masked count inside the loss
    local_weight = total_loss_weight = valid.count_nonzero()
    areal = areal_loss * (local_weight / total_loss_weight)
    (g_areal,) = torch.autograd.grad(areal, lp)

    assert torch.equal(areal_mask, keep) and int(keep.sum()) == 48 and int(valid.sum()) == 120
    torch.testing.assert_close(areal, ours * 120 / 48, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_areal, g_ours * 120 / 48, rtol=1e-6, atol=1e-9)


def areal_sequence_rejection(proximal_logprobs, old_logprobs, loss_mask, lower, upper, level):
    """areal/utils/functional/functional.py::apply_rejection_sampling, metric='ratio', agg='mean',
    action='mask', 2D padded: returns (behave_imp_weight, updated loss_mask)."""
    log_ratio = proximal_logprobs.detach().float() - old_logprobs.detach().float()
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    metric = torch.exp(log_ratio)
    behave_imp_weight = torch.exp(log_ratio)
    if level == "sequence":
        masked_agg = torch.where(loss_mask.bool(), log_ratio, 0.0)
        valid_count = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)
        seq_log_mean = masked_agg.sum(dim=-1, keepdim=True) / valid_count
        behave_imp_weight = torch.exp(seq_log_mean).expand_as(log_ratio)
        seq_metric = torch.exp(masked_agg.sum(dim=-1, keepdim=True) / valid_count)
        in_bounds = ((seq_metric >= lower) & (seq_metric <= upper)).expand_as(loss_mask)
    else:
        in_bounds = (metric >= lower) & (metric <= upper)
    updated_mask = loss_mask.bool() & in_bounds
    return torch.where(updated_mask, behave_imp_weight, 0.0), updated_mask


def test_areal_sequence_rejection_weights_each_kept_sequence_by_its_geometric_mean_ratio():
    b, s = 8, 10
    g = torch.Generator().manual_seed(2)
    lp0, old, rollout, adv = _drift_batch(3, b, s, 0.05 * torch.randn(b, s, generator=g))
    mask = torch.arange(s)[None] < torch.randint(3, s + 1, (b,), generator=g)[:, None]
    lo, hi = 0.98, 1.02
    cfg = config(policy_loss="ppo", correction={"geo_rs": [lo, hi]})
    ours, valid, _ = per_token_policy_loss(cfg, lp0, advantages=adv, loss_mask=mask, old_logprobs=old,
                                           rollout_logprobs=rollout)
    weight_and_mask = areal_sequence_rejection(old, rollout, mask, lo, hi, "sequence")
    areal_loss, areal = areal_ppo_actor_loss(lp0, old, adv, 0.2, mask, weight_and_mask)
    geo = torch.exp(((old - rollout) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
    kept = weight_and_mask[1].any(-1)
    assert 0 < kept.sum() < b and (geo[kept] - 1).abs().min() > 1e-4  # some rejected; kept weights are not 1
    torch.testing.assert_close(areal, ours * geo * mask, rtol=1e-6, atol=1e-9)
    # the count is taken before rejection, as ours: the factor is the weight alone
    torch.testing.assert_close(areal_loss, (ours * geo).sum() / valid.sum(), rtol=1e-6, atol=0)
    # token level: weight rho on the kept tokens, i.e. exactly our MIS + token TIS capped at hi (IcePop)
    weight_and_mask = areal_sequence_rejection(old, rollout, mask, 0.97, 1.03, "token")
    _, areal = areal_ppo_actor_loss(lp0, old, adv, 0.2, mask, weight_and_mask)
    icepop = config(policy_loss="ppo", correction={"mis": [0.97, 1.03]}, tis={"level": "token", "cap": 1.03})
    ours, _, _ = per_token_policy_loss(icepop, lp0, advantages=adv, loss_mask=mask, old_logprobs=old,
                                       rollout_logprobs=rollout)
    assert 0 < (mask & ~weight_and_mask[1]).sum()
    torch.testing.assert_close(areal, ours, rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------ slime (THUDM/slime@624b824a)

def slime_sum_of_sample_mean(x, response_lengths, loss_masks, sample_denoms):
    """slime/backends/megatron_utils/cp_utils.py::get_sum_of_sample_mean, cp_size == 1."""
    return sum([(x_i * loss_mask_i).sum() / torch.clamp_min(denom, 1)
                for x_i, loss_mask_i, denom in zip(x.split(response_lengths, dim=0), loss_masks, sample_denoms)])


def test_slime_sequence_reducer_is_ours_times_non_empty_over_rollouts_in_the_step():
    # one sample per rollout (rollout_mask_sums = each sample's own mask sum); two samples have an
    # all-zero loss mask (slime's remove_sample), which count in step_global_batch_size B
    lengths = [5, 3, 4, 6, 2, 5]
    masks = [torch.ones(n) for n in lengths]
    masks[1] = torch.zeros(3)
    masks[4] = torch.zeros(2)
    b, s = len(lengths), max(lengths)
    lp0, old, rollout, adv = _drift_batch(4, b, s, torch.zeros(b, s))
    pad = torch.zeros(b, s)
    for i, m in enumerate(masks):
        pad[i, :lengths[i]] = m
    cfg = config(loss_agg="seq_mean_token_mean", cispo={"eps_low": 0.2, "eps_high": 0.2})
    per_token, _, _ = per_token_policy_loss(cfg, lp0, advantages=adv, loss_mask=pad.bool(), old_logprobs=old)
    ours = compute_policy_loss(cfg, lp0, advantages=adv, loss_mask=pad.bool(), old_logprobs=old).loss
    # slime's per-token pg_loss is ours on its tokens (test_presets pins it); its reducer, then
    # loss_function's scaling: x num_microbatches / step_global_batch_size x dp_size (1 mb, dp 1)
    flat = torch.cat([per_token[i, :n] for i, n in enumerate(lengths)])
    num_microbatches, step_global_batch_size, dp_size = 1, b, 1
    slime = slime_sum_of_sample_mean(flat, lengths, masks, [m.sum() for m in masks])
    slime = slime * num_microbatches / step_global_batch_size * dp_size
    non_empty = sum(int(m.sum() > 0) for m in masks)
    assert non_empty == 4
    torch.testing.assert_close(slime, ours * non_empty / b, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ SkyRL (NovaSky-AI/SkyRL@a9564572)

def skyrl_masks(old_log_probs, rollout_logprobs, loss_mask, token=None, geo=None):
    """skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py::compute_token_mask and
    ::compute_sequence_mask('geometric'), as compute_off_policy_correction chains them; called by
    ppo_utils.py::compute_policy_loss_cispo with old_log_probs whatever cispo_anchor is."""
    token_is_log_ratio = old_log_probs - rollout_logprobs
    ratio = torch.clamp(token_is_log_ratio.float(), -20.0, 20.0).exp()
    if token is not None:
        in_bounds = (ratio >= token[0]) & (ratio <= token[1])
        loss_mask = loss_mask * (in_bounds | (loss_mask == 0)).float()
    if geo is not None:
        num_tokens = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
        seq_tis_log_ratio = (token_is_log_ratio * loss_mask).sum(dim=-1, keepdim=True)
        geo_mean_ratio = torch.clamp(seq_tis_log_ratio / num_tokens, -20.0, 20.0).exp()
        loss_mask = loss_mask * (~(geo_mean_ratio > geo[1]) & ~(geo_mean_ratio < geo[0])).float()
    return loss_mask.bool()


@pytest.mark.parametrize("correction", [{"mis": [0.9, 1.1]}, {"geo_rs": [0.97, 1.03]}])
def test_skyrl_masks_test_rho_under_the_rollout_anchor_ours_test_r(correction):
    b, s = 12, 8
    g = torch.Generator().manual_seed(5)
    _, old, rollout, adv = _drift_batch(6, b, s, 0.08 * torch.randn(b, s, generator=g))
    mask = torch.ones(b, s)
    band = dict(token=correction.get("mis"), geo=correction.get("geo_rs"))
    rollout_anchor = config(cispo={"anchor": "rollout"}, correction=correction)
    old_anchor = config(cispo={"anchor": "old"}, correction=correction)
    assert required_inputs(rollout_anchor) == {"rollout_logprobs"}  # ours needs no pi_old here

    def kept(cfg, lp):
        loss, _, _ = per_token_policy_loss(cfg, lp, advantages=adv, loss_mask=mask.bool(), old_logprobs=old,
                                           rollout_logprobs=rollout)
        return loss != 0
    skyrl = skyrl_masks(old, rollout, mask, **band)
    assert 0 < (~skyrl).sum() < b * s
    # the first optimizer step on a batch: pi_theta = pi_old, so r = rho and the two coincide
    assert torch.equal(kept(rollout_anchor, old.clone()), skyrl)
    # later steps: pi_theta has moved; SkyRL still tests rho (our old-anchor rule), ours r
    lp = old + 0.08 * torch.randn(b, s, generator=g)
    assert torch.equal(kept(old_anchor, lp), skyrl)
    ours = kept(rollout_anchor, lp)
    assert torch.equal(ours, skyrl_masks(lp, rollout, mask, **band)) and not torch.equal(ours, skyrl)


# ------------------------------------------------------------------ OPSM's reference

def test_opsm_ref_old_tests_mean_log_pi_old_over_pi_theta_and_needs_old_logprobs():
    lp = torch.full((3, 2), -1.0)
    old = torch.tensor([[-0.5, -0.5], [-1.0, -1.0], [-0.5, -0.5]])   # mean log(old/theta) = .5, 0, .5
    rollout = torch.tensor([[-1.0, -1.0], [-0.5, -0.5], [-0.5, -0.5]])  # mean log(rollout/theta) = 0, .5, .5
    adv = -torch.ones(3)
    for ref, dropped in (("rollout", [False, True, True]), ("old", [True, False, True])):
        cfg = config(correction={"opsm": 0.25, "opsm_ref": ref})
        loss, _, m = per_token_policy_loss(cfg, lp, advantages=adv, loss_mask=torch.ones(3, 2), old_logprobs=old,
                                           rollout_logprobs=rollout)
        assert loss.eq(0).all(1).tolist() == dropped, ref
        assert m.values()["correction/opsm_dropped_frac"].item() == pytest.approx(2 / 3)
    assert required_inputs(config(cispo={"anchor": "rollout"}, correction={"opsm": 0.1, "opsm_ref": "old"})) == {
        "old_logprobs", "rollout_logprobs"}
    with pytest.raises(ValueError, match=r"^correction.opsm=0.25 with opsm_ref='old' needs old_logprobs"):
        compute_policy_loss(config(cispo={"anchor": "rollout"}, correction={"opsm": 0.25, "opsm_ref": "old"}),
                            lp, advantages=adv, loss_mask=torch.ones(3, 2), rollout_logprobs=rollout)


def test_opsm_ref_old_under_the_rollout_anchor_plans_the_pi_old_pass_and_is_inert_at_one_step():
    from megatron_cispo.step import StepConfig, plan_old_logprobs
    cfg = config(cispo={"anchor": "rollout"}, correction={"opsm": 0.0, "opsm_ref": "old"})
    plan = {n: plan_old_logprobs(cfg, StepConfig(), optimizer_steps=n, have_old=False) for n in (1, 2)}
    assert plan == {1: "from_training_forward", 2: "pass"}
    assert plan_old_logprobs(config(cispo={"anchor": "rollout"}, correction={"opsm": 0.0}), StepConfig(),
                             optimizer_steps=2, have_old=False) == "unused"
    # one step: pi_old is the training forward, detached, so mean log(pi_old / pi_theta) = 0 is never > delta
    lp = torch.randn(4, 5)
    loss, _, m = per_token_policy_loss(cfg, lp, advantages=-torch.ones(4), loss_mask=torch.ones(4, 5),
                                       old_logprobs=lp.detach(), rollout_logprobs=lp - 1.0)
    assert loss.ne(0).all() and m.values()["correction/opsm_dropped_frac"].item() == 0.0
