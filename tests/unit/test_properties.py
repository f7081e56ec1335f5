"""Hypothesis properties of compute_policy_loss and token_logprobs on random shapes and extreme
values (logits up to +-1e4 and -inf, logprobs down to -1e3 so ratios overflow fp32, -inf/nan
anchor logprobs, advantages up to 1e3): outputs are finite, masked tokens get exactly zero
gradient, masked padding changes nothing, and CISPO's per-token gradient is bounded by
(1 + eps_high) * |A| / denominator. About 10 s at 150 examples a property."""
import math

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_cispo.config import CispoConfig, KLConfig, LossConfig, PPOConfig, TISConfig
from megatron_cispo.logprobs import token_logprobs
from megatron_cispo.losses import check_loss_config, compute_policy_loss, per_token_policy_loss, valid_tokens

SETTINGS = settings(max_examples=150, deadline=None, database=None)  # no failure database on disk
LOGPROB = st.floats(-1e3, 0.0, width=32)  # ratios up to e^1000: past fp32, so LOG_RATIO_CLAMP is needed
ADVANTAGE = st.floats(-1e3, 1e3, width=32)


@st.composite
def batches(draw, max_b=3, max_s=6, nonfinite_anchors=False):
    """A [b, s] batch: current/old/rollout/ref logprobs, entropy, [b] or [b, s] advantages, mask.
    nonfinite_anchors: old/rollout/ref logprobs may be -inf or nan (a sampler's -inf), which
    drops the token."""
    b, s = draw(st.integers(1, max_b)), draw(st.integers(1, max_s))
    anchor = st.one_of(LOGPROB, st.sampled_from([-math.inf, math.nan])) if nonfinite_anchors else LOGPROB

    def grid(elements):
        return torch.tensor(draw(st.lists(elements, min_size=b * s, max_size=b * s))).view(b, s)

    adv_shape = draw(st.sampled_from([(b,), (b, s)]))
    adv = torch.tensor(draw(st.lists(ADVANTAGE, min_size=math.prod(adv_shape), max_size=math.prod(adv_shape))))
    return dict(logprobs=grid(LOGPROB), old_logprobs=grid(anchor), rollout_logprobs=grid(anchor),
                ref_logprobs=grid(anchor), entropy=grid(st.floats(0.0, 12.0, width=32)),
                advantages=adv.view(adv_shape), loss_mask=grid(st.booleans()))


@st.composite
def loss_configs(draw):
    agg = draw(st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                "seq_mean_token_sum_norm"]))
    cfg = LossConfig(
        policy_loss=draw(st.sampled_from(["cispo", "ppo", "rollout_is"])), loss_agg=agg,
        max_len=draw(st.integers(1, 8)) if agg == "seq_mean_token_sum_norm" else None,
        entropy_coef=draw(st.sampled_from([0.0, 0.01])),
        cispo=CispoConfig(eps_low=draw(st.floats(0.0, 1.0)), eps_high=draw(st.floats(0.0, 10.0)),
                          anchor=draw(st.sampled_from(["old", "rollout"])), token_mask=draw(st.booleans())),
        ppo=PPOConfig(dual_clip=draw(st.sampled_from([None, 3.0]))),
        tis=TISConfig(level=draw(st.sampled_from([None, "token", "sequence"]))),
        kl=KLConfig(coef=draw(st.sampled_from([0.0, 0.1])), estimator=draw(st.sampled_from(["k1", "k2", "k3"]))))
    try:
        check_loss_config(cfg)  # e.g. a rollout anchor stacked with TIS is refused by the registry
    except ValueError:
        assume(False)
    return cfg


def _loss_and_grad(cfg, batch):
    lp = batch["logprobs"].clone().requires_grad_()
    out = compute_policy_loss(cfg, lp, **{k: v for k, v in batch.items() if k != "logprobs"})
    out.loss.backward()
    return out, lp.grad


def _pad(batch, rows, cols, junk):
    """The batch with `rows` extra rows and `cols` extra columns, all masked, holding `junk`."""
    out = {}
    for k, v in batch.items():
        if k == "advantages" and v.dim() == 1:
            out[k] = torch.cat([v, torch.full((rows,), junk)])
            continue
        fill = False if k == "loss_mask" else junk
        v = torch.cat([v, torch.full((v.shape[0], cols), fill, dtype=v.dtype)], 1)
        out[k] = torch.cat([v, torch.full((rows, v.shape[1]), fill, dtype=v.dtype)], 0)
    return out


@SETTINGS
@given(cfg=loss_configs(), batch=batches(nonfinite_anchors=True))
def test_policy_loss_outputs_and_gradients_are_finite_and_masked_tokens_get_exactly_zero(cfg, batch):
    out, grad = _loss_and_grad(cfg, batch)
    assert torch.isfinite(out.loss) and torch.isfinite(out.loss_sum) and torch.isfinite(out.denominator)
    assert torch.isfinite(grad).all()
    # untrained tokens, and trained ones dropped for a non-finite anchor, get exactly zero
    anchors = {k: batch[k] for k in ("old_logprobs", "rollout_logprobs", "ref_logprobs")}
    valid = valid_tokens(cfg, batch["loss_mask"], **anchors)
    assert out.denominator.item() <= valid.sum().item() and not grad[~valid].any()
    values = out.metrics.values()
    for key in [*out.metrics.sums, *out.metrics.totals]:
        assert torch.isfinite(values[key]), key
    if valid.any():  # a min or max over no token is +-inf by design
        for key in [*out.metrics.mins, *out.metrics.maxs]:
            assert torch.isfinite(values[key]), key


@SETTINGS
@given(batch=batches(), eps_low=st.floats(0.0, 1.0), eps_high=st.floats(0.0, 10.0),
       anchor=st.sampled_from(["old", "rollout"]), token_mask=st.booleans())
def test_cispo_token_gradient_is_at_most_one_plus_eps_high_times_advantage_over_the_token_count(
        batch, eps_low, eps_high, anchor, token_mask):
    cfg = LossConfig(cispo=CispoConfig(eps_low=eps_low, eps_high=eps_high, anchor=anchor, token_mask=token_mask))
    out, grad = _loss_and_grad(cfg, batch)
    tokens = int(batch["loss_mask"].sum())
    assert out.denominator.item() == tokens  # token_mean: the valid tokens of the batch
    adv = batch["advantages"] if batch["advantages"].dim() == 2 else batch["advantages"][:, None]
    bound = (1.0 + eps_high) * adv.double().abs() / max(tokens, 1)
    # fp32 rounding of w * A / D: relative, or one subnormal step (2^-149) for a tiny A
    assert (grad.double().abs() <= bound * (1 + 1e-6) + 2.0 ** -148).all()


@SETTINGS
@given(cfg=loss_configs(), batch=batches(), rows=st.integers(0, 2), cols=st.integers(0, 3),
       junk=st.sampled_from([0.0, -50.0, 1e3, math.nan, -math.inf]))
def test_masked_padding_rows_and_columns_change_neither_the_loss_nor_the_gradient(cfg, batch, rows, cols, junk):
    assume(rows or cols)
    out, grad = _loss_and_grad(cfg, batch)
    padded, padded_grad = _loss_and_grad(cfg, _pad(batch, rows, cols, junk))
    b, s = grad.shape
    assert padded.denominator.item() == out.denominator.item()
    # The same terms summed over a longer tensor: equal up to the order of the fp32 additions, so
    # within a few ulps of the sum of |terms| (every aggregation weight is <= 1). Sequence TIS
    # exponentiates a row sum of log-ratios, so that sum's rounding (a few 1e-8 of its |terms|)
    # becomes a relative error of the weight.
    rtol = 1e-6
    if cfg.tis.level == "sequence":
        rtol += 1e-6 * float((batch["old_logprobs"] - batch["rollout_logprobs"]).abs().sum(-1).max())
    per_token, _, _ = per_token_policy_loss(cfg, **batch)
    tol = 10 * rtol * float(per_token.abs().sum()) / max(out.denominator.item(), 1.0)
    assert abs(padded.loss.item() - out.loss.item()) <= tol
    torch.testing.assert_close(padded_grad[:b, :s], grad, rtol=rtol, atol=0)
    assert not padded_grad[b:].any() and not padded_grad[:, s:].any()


@st.composite
def logits_batches(draw):
    """[n, v] logits in +-scale (scale up to 1e4), some -inf (a masked-out vocabulary entry) except
    at the target, targets, a mask, and a temperature."""
    n, v = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    scale = draw(st.sampled_from([1.0, 30.0, 1e4]))
    logits = torch.tensor(draw(st.lists(st.floats(-1.0, 1.0, width=32), min_size=n * v, max_size=n * v)))
    logits = (logits * scale).view(n, v)
    targets = torch.tensor(draw(st.lists(st.integers(0, v - 1), min_size=n, max_size=n)))
    minus_inf = torch.tensor(draw(st.lists(st.booleans(), min_size=n * v, max_size=n * v))).view(n, v)
    if draw(st.booleans()):
        minus_inf[torch.arange(n), targets] = False
        logits[minus_inf] = -math.inf
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    return dict(logits=logits, targets=targets, mask=mask, temperature=draw(st.sampled_from([0.1, 1.0, 7.0])))


def _logprobs_and_grad(logits, targets, mask, temperature, weights):
    x = logits.clone().requires_grad_()
    lp, ent = token_logprobs(x, targets, mask=mask, temperature=temperature, return_entropy=True)
    (lp * weights + torch.where(mask, ent, 0.0) * weights).sum().backward()
    return lp, ent, x.grad


@SETTINGS
@given(data=logits_batches(), seed=st.integers(0, 2 ** 16))
def test_token_logprobs_are_finite_match_fp64_and_masked_rows_get_exactly_zero_gradient(data, seed):
    n = data["targets"].shape[0]
    weights = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    lp, ent, grad = _logprobs_and_grad(**data, weights=weights)
    mask = data["mask"]
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(grad).all()
    assert (lp <= 0).all() and (ent >= -1e-4).all()
    ref = torch.log_softmax(data["logits"].double() / data["temperature"], -1)
    ref = ref.gather(1, data["targets"][:, None]).squeeze(1)
    torch.testing.assert_close(lp.double(), torch.where(mask, ref, 0.0), rtol=1e-5, atol=1e-4)
    assert (lp[~mask] == 0).all() and not grad[~mask].any()


@SETTINGS
@given(data=logits_batches(), rows=st.integers(1, 4), junk=st.sampled_from([0.0, 1e4, -1e4, -math.inf]),
       bad_target=st.sampled_from([-1, 10 ** 6, -100]))
def test_masked_padding_rows_with_out_of_range_targets_change_no_logprob_and_no_gradient(
        data, rows, junk, bad_target):
    n, v = data["logits"].shape
    weights = torch.linspace(-1.0, 1.0, n)
    lp, ent, grad = _logprobs_and_grad(**data, weights=weights)
    padded = dict(logits=torch.cat([data["logits"], torch.full((rows, v), junk)]),
                  targets=torch.cat([data["targets"], torch.full((rows,), bad_target)]),
                  mask=torch.cat([data["mask"], torch.zeros(rows, dtype=torch.bool)]),
                  temperature=data["temperature"])
    lp_p, ent_p, grad_p = _logprobs_and_grad(**padded, weights=torch.cat([weights, torch.ones(rows)]))
    # Same math per row, but a vectorised exp over another length (and the backward's gathered
    # path for skipped rows) may round the last bit differently.
    torch.testing.assert_close(lp_p[:n], lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_p[:n], grad, rtol=1e-6, atol=1e-6)
    assert (lp_p[n:] == 0).all() and not grad_p[n:].any()
