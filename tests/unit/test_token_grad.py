"""losses/token_grad.py: the per-chunk coefficients of loss.head=fused_grad equal torch.autograd.grad
of the whole loss for every separable config, and each config fused_grad_fallback names really
needs the fallback (the generic per-chunk coefficient is wrong for it) or says why it falls back;
and make_loss_func with the real op equals the fused head on one process, fallback included.
"""
from functools import partial

import pytest
import torch

from megatron_cispo.config import LossConfig, from_dict
from megatron_cispo.losses import register_policy_loss, token_weights
from megatron_cispo.losses.token_grad import (chunk_coef_fn, chunk_local, fused_grad_fallback, microbatch_loss,
                                              rows_loss)
from megatron_cispo.step.forward import _segment_sum

B, S = 3, 7
KEY_FALLBACK = "head/fused_grad_fallback"


def cfg_of(**d):
    return from_dict(LossConfig, d, path="loss")


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, S, generator=g, dtype=torch.float64).float() * 3 - 0.05
    noise = lambda: 0.4 * torch.randn(B, S, generator=g)  # noqa: E731
    mask = torch.rand(B, S, generator=g) > 0.2
    mask[:, 0] = True
    return lp, torch.rand(B, S, generator=g) * 2, dict(
        advantages=torch.randn(B, generator=g), loss_mask=mask, old_logprobs=lp + noise(),
        rollout_logprobs=lp + noise(), ref_logprobs=lp + noise(), keep=torch.rand(B, S, generator=g) > 0.3)


def loss_of_for(cfg, given, *, agg=None, seq_sum=None, old_from_current=False):
    """The scalar the step differentiates: agg=None is compute_policy_loss's loss_sum, agg='weights'
    the policy step's (per_token * agg_weight).sum() * loss_scale over a segment sum."""
    given = {k: v for k, v in given.items() if k != "keep" or cfg.correction.m2po is not None}
    extra = {}
    if agg == "weights":
        weight, share, _ = token_weights(given["loss_mask"], cfg.loss_agg, cfg.max_len)
        extra = dict(agg_weight=weight, agg_share=share, loss_scale=0.37, seq_sum=seq_sum)

    def loss_of(lp, ent):
        g = dict(given, entropy=ent)
        if old_from_current:
            g["old_logprobs"] = lp.detach()
        return microbatch_loss(cfg, lp, given=g, **extra)[0]
    return loss_of


def rows_loss_for(cfg, given):
    """The chunk-local loss (rows_loss) of loss_of_for(cfg, given, agg='weights')."""
    given = {k: v for k, v in given.items() if k != "keep" or cfg.correction.m2po is not None}
    weight = token_weights(given["loss_mask"], cfg.loss_agg, cfg.max_len)[0]
    return lambda lp, ent, pick: rows_loss(cfg, lp, ent, pick, given=given, agg_weight=weight, loss_scale=0.37)


def full_grad(loss_of, lp, ent, entropy_grad):
    lp, ent = lp.clone().requires_grad_(True), ent.clone().requires_grad_(entropy_grad)
    wrt = [lp, ent] if entropy_grad else [lp]
    grads = torch.autograd.grad(loss_of(lp, ent), wrt, allow_unused=True)
    return [torch.zeros(B, S) if g is None else g for g in grads]


def chunked_grad(loss_of, lp, ent, entropy_grad, rows=4, local=False):
    """coef_fn over increasing row ranges of the op's s-major [s * b] positions, reassembled [b, s]."""
    fn = chunk_coef_fn(loss_of, (B, S), device=lp.device, entropy=True, entropy_grad=entropy_grad, local=local)
    lp_rows, ent_rows = lp.t().reshape(-1), ent.t().reshape(-1)
    out = [torch.zeros(S * B), torch.zeros(S * B)]
    for r0 in range(0, S * B, rows):
        r1 = min(r0 + rows, S * B)
        with torch.no_grad():  # as inside an autograd.Function's forward
            g_lp, g_ent = fn(r0, r1, lp_rows[r0:r1], ent_rows[r0:r1])
        out[0][r0:r1] = g_lp
        assert (g_ent is None) == (not entropy_grad)
        if g_ent is not None:
            out[1][r0:r1] = g_ent
    return [o.view(S, B).t() for o in out][: 2 if entropy_grad else 1]


SEPARABLE = {
    "cispo_old": dict(cispo={"anchor": "old", "token_mask": True}),
    "cispo_rollout": dict(cispo={"anchor": "rollout"}),
    "ppo": dict(policy_loss="ppo"),
    "ppo_dual_clip": dict(policy_loss="ppo", ppo={"dual_clip": 3.0}),
    "rollout_is": dict(policy_loss="rollout_is"),
    "kl_k1": dict(kl={"coef": 0.1, "estimator": "k1"}),
    "kl_k2": dict(kl={"coef": 0.1, "estimator": "k2"}),
    "kl_k3": dict(kl={"coef": 0.1, "estimator": "k3"}),
    "kl_k3_is_weight": dict(kl={"coef": 0.1, "estimator": "k3", "is_weight": True}),
    "entropy_bonus": dict(entropy_coef=0.05),
    "ppo_kl_entropy": dict(policy_loss="ppo", kl={"coef": 0.2, "estimator": "k2"}, entropy_coef=-0.03),
    "seq_mean_token_mean": dict(loss_agg="seq_mean_token_mean"),
    "seq_mean_token_sum": dict(loss_agg="seq_mean_token_sum"),
    "seq_mean_token_sum_norm": dict(loss_agg="seq_mean_token_sum_norm", max_len=9),
    "tis_token": dict(tis={"level": "token"}),
    "mis_old": dict(correction={"mis": [0.7, 1.3]}),
    "mis_rollout": dict(cispo={"anchor": "rollout"}, correction={"mis": [0.7, 1.3]}),
    "m2po_keep": dict(correction={"m2po": 0.1}),
    # sequence quantities of given inputs only: exact per chunk while a rank holds whole sequences
    "tis_sequence_given_old": dict(tis={"level": "sequence", "cap": 1.5}),
    "geo_rs_old_given_old": dict(correction={"geo_rs": [0.8, 1.2]}),
}


@pytest.mark.parametrize("agg", [None, "weights"])
@pytest.mark.parametrize("name", sorted(SEPARABLE))
def test_chunk_coefficients_equal_autograd_of_the_whole_loss(name, agg):
    cfg = cfg_of(**SEPARABLE[name])
    assert fused_grad_fallback(cfg, False) is None
    lp, ent, given = inputs()
    seq = torch.arange(B)[:, None].expand(B, S)  # one sequence per row, through the step's segment sum
    loss_of = loss_of_for(cfg, given, agg=agg, seq_sum=_segment_sum(seq, B, None))
    eg = cfg.entropy_coef != 0
    want, got = full_grad(loss_of, lp, ent, eg), chunked_grad(loss_of, lp, ent, eg)
    assert want[0].abs().max() > 0
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    # the step's chunk-local mode (the chunk's rows alone) where no sequence total reaches the gradient
    sequence_total = name in ("tis_sequence_given_old", "geo_rs_old_given_old")
    assert chunk_local(cfg, torch.ones(1) if agg else None) == (agg is not None and not sequence_total)
    if chunk_local(cfg, torch.ones(1) if agg else None):
        for w, g in zip(want, chunked_grad(rows_loss_for(cfg, given), lp, ent, eg, local=True)):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["tis_token", "mis_old", "cispo_old"])
def test_old_from_current_token_level_is_exact(name):
    cfg = cfg_of(**SEPARABLE[name])
    assert fused_grad_fallback(cfg, True) is None
    lp, ent, given = inputs(1)
    loss_of = loss_of_for(cfg, given, old_from_current=True)
    torch.testing.assert_close(chunked_grad(loss_of, lp, ent, False)[0], full_grad(loss_of, lp, ent, False)[0],
                               rtol=0, atol=1e-6)


def _wrong_per_chunk(cfg, given, lp, old_from_current=False):
    loss_of = loss_of_for(cfg, given, old_from_current=old_from_current)
    return (chunked_grad(loss_of, lp, lp, False)[0] - full_grad(loss_of, lp, lp, False)[0]).abs().max()


def test_fallbacks_that_read_the_current_policys_sequence_are_wrong_per_chunk():
    lp, _, given = inputs(2)
    given["advantages"] = -given["advantages"].abs()  # OPSM drops negative sequences only
    given["rollout_logprobs"] = lp + 0.3  # full mean log(pi_ref / pi) = 0.3 > delta; the buffer's zeros say < 0
    cases = {
        "opsm": (cfg_of(correction={"opsm": 0.1}), False),
        "opsm_old_ref": (cfg_of(correction={"opsm": 0.1, "opsm_ref": "old"}), False),
        "geo_rs_rollout": (cfg_of(cispo={"anchor": "rollout"}, correction={"geo_rs": [0.5, 1.5]}), False),
        "tis_sequence_old_from_current": (cfg_of(tis={"level": "sequence", "cap": 10.0}), True),
        "geo_rs_old_from_current": (cfg_of(correction={"geo_rs": [0.5, 1.5]}), True),
    }
    given["old_logprobs"] = lp + 0.3
    for name, (cfg, ofc) in cases.items():
        reason = fused_grad_fallback(cfg, ofc)
        assert reason is not None and "current policy" in reason, name
        assert _wrong_per_chunk(cfg, given, lp, ofc) > 1e-3, name


def test_sequence_totals_under_cp_are_wrong_per_chunk():
    """One CP rank holds half of every sequence: its per-chunk coefficients, without the CP
    all-reduce, differ from the whole loss's gradient on its half."""
    lp, _, given = inputs(3)
    half = S // 2 + 1
    for cfg in (cfg_of(tis={"level": "sequence", "cap": 10.0}), cfg_of(correction={"geo_rs": [0.9, 1.1]})):
        assert fused_grad_fallback(cfg, False) is None
        assert "context parallelism" in fused_grad_fallback(cfg, False, cp_size=2)
        want = full_grad(loss_of_for(cfg, given), lp, lp, False)[0][:, :half]
        mine = {k: (v if v.dim() < 2 else v[:, :half]) for k, v in given.items()}
        local = loss_of_for(cfg, mine)
        fn = chunk_coef_fn(local, (B, half), device=lp.device)
        got = fn(0, B * half, lp[:, :half].t().reshape(-1), None)[0].view(half, B).t()
        assert (got - want).abs().max() > 1e-3


def _register_once(name, **kw):
    def reinforce(cfg, x):  # -A * log pi, token by token
        from megatron_cispo.losses import Metrics

        return -x.advantages * x.logprobs, Metrics()
    try:
        register_policy_loss(name, anchor="old", **kw)(reinforce)
    except ValueError:  # registered by an earlier run in this process
        pass


def test_losses_that_do_not_declare_per_token_and_kept_sets_fall_back_with_their_reason():
    _register_once("token_grad_test_plugin")
    assert "not registered per_token=True" in fused_grad_fallback(cfg_of(policy_loss="token_grad_test_plugin"), False)
    assert "kept sets" in fused_grad_fallback(cfg_of(), False, kept_set=True)


def test_a_plugin_that_declares_per_token_runs_fused_grad_without_falling_back():
    """The registry owns the property: a plugin loss registered per_token=True gets the chunked gradient,
    equal to the fused head's, and no fallback is counted."""
    _register_once("token_grad_test_per_token", per_token=True)
    over = {"policy_loss": "token_grad_test_per_token"}
    assert fused_grad_fallback(cfg_of(**over), False) is None
    assert_fused_grad_equals_fused(over)


def assert_fused_grad_equals_fused(over: dict) -> None:
    """fused_grad on _step_case's microbatch: no fallback counted, and the fused head's value and gradients."""
    want, got = _step_case("fused", over), _step_case("fused_grad", over)
    assert got[1].pop(KEY_FALLBACK) == 0.0
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    for a, b in zip(got[2:], want[2:]):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _step_case(head, cfg_over, seed=5, fused=True):
    """make_loss_func on a tiny fused-head microbatch with the policy step's weights, one process:
    (loss value, metrics, d loss / d hidden, d loss / d weight)."""
    from megatron_cispo.step import Microbatch
    from megatron_cispo.step.forward import make_loss_func
    from megatron_cispo.step.head import FusedHead

    g = torch.Generator().manual_seed(seed)
    b, s, h, v = 2, 6, 8, 16
    hidden = torch.randn(b, s, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).requires_grad_()
    mask = torch.rand(b, s, generator=g) > 0.2
    agg_weight, share, _ = token_weights(mask, "seq_mean_token_mean")
    mb = Microbatch(targets=torch.randint(0, v, (b, s), generator=g), loss_mask=mask,
                    advantages=torch.randn(b, s, generator=g), rollout_logprobs=-2.8 + torch.randn(b, s, generator=g),
                    old_logprobs=-2.8 + torch.randn(b, s, generator=g),
                    ref_logprobs=-2.8 + torch.randn(b, s, generator=g), seq_index=torch.arange(b)[:, None].expand(b, s),
                    n_seqs=b, agg_weight=agg_weight, agg_share=share, loss_scale=0.7, num_tokens=torch.tensor(b * s),
                    fused=FusedHead(weight, False) if fused else None)
    cfg = cfg_of(**cfg_over, loss_agg="seq_mean_token_mean", head=head)
    output = hidden if fused else hidden @ weight.t()  # no fused head: the model's logits
    loss, num_tokens, m = make_loss_func(cfg, vocab_size=v)(mb, output)
    loss.backward()
    return loss.detach(), m.values(), hidden.grad, weight.grad


def test_make_loss_func_fused_grad_matches_the_fused_head_and_counts_fallbacks():
    import warnings

    for over in ({"cispo": {"anchor": "old"}, "entropy_coef": 0.1}, {"correction": {"opsm": 0.0}}):
        want = _step_case("fused", over)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = _step_case("fused_grad", over)
        fell = "correction" in over
        assert got[1].pop(KEY_FALLBACK) == float(fell)
        assert [str(w.message) for w in seen if "fused_grad" in str(w.message)] == (
            ["loss.head=fused_grad falls back to 'fused': correction.opsm=0.0 reads the current policy's "
             "sequence mean of log(pi_ref / pi_theta)"] if fell else [])
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
        assert set(got[1]) == set(want[1])
        for key in want[1]:
            torch.testing.assert_close(got[1][key], want[1][key], rtol=0, atol=1e-6, msg=key)
        for a, b in zip(got[2:], want[2:]):
            assert b.abs().max() > 0
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("over,local", [
    ({"cispo": {"anchor": "old"}}, True), ({"policy_loss": "ppo", "kl": {"coef": 0.1, "estimator": "k3"}}, True),
    ({"entropy_coef": 0.1, "tis": {"level": "token"}, "correction": {"mis": [0.5, 2.0]}}, True),
    ({"tis": {"level": "sequence", "cap": 2.0}}, False)])
def test_step_runs_the_chunk_local_loss_unless_a_sequence_total_reaches_the_gradient(monkeypatch, over, local):
    """Which [*, n] logprobs the policy loss sees on make_loss_func's agg_weight path: per chunk only
    the chunk's rows [1, rows] (linear in s), not the whole [b, s] microbatch (quadratic in s);
    the whole microbatch once more for the value and metrics."""
    import megatron_cispo.losses.compute as compute
    import megatron_cispo.losses.token_grad as token_grad

    import megatron_cispo.step.head as head

    seen, real = [], compute.per_token_policy_loss
    monkeypatch.setattr(token_grad, "per_token_policy_loss",
                        lambda cfg, lp, **kw: seen.append(tuple(lp.shape)) or real(cfg, lp, **kw))
    monkeypatch.setattr(head, "fused_grad_logprobs", partial(head.fused_grad_logprobs, chunk_rows=4))
    _step_case("fused_grad", over)
    assert seen[-1] == (2, 6)  # the value: the whole microbatch
    assert seen[:-1] == ([(1, 4)] * 3 if local else [(2, 6)] * 3), seen


def test_fused_grad_without_an_output_layer_to_fuse_counts_the_logits_fallback():
    """head=fused_grad, but the forward found no output layer (mb.fused None): the logits head ran,
    and that is counted in head/fused_grad_fallback with its reason."""
    import warnings

    want = _step_case("logits", {}, fused=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _step_case("fused_grad", {}, fused=False)
    assert got[1].pop(KEY_FALLBACK) == 1.0
    assert [str(w.message) for w in seen if "fused_grad" in str(w.message)] == [
        "loss.head=fused_grad falls back to 'logits': no output layer was found to fuse (mb.fused is None): "
        "the logits head ran"]
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for a, b in zip(got[2:], want[2:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fused_grad_refuses_an_fp16_model_config_in_one_line():
    """fp16: the gradients formed in forward would be rounded to fp16 before the loss scale."""
    import types

    from megatron_cispo.step import check_megatron_config

    config = types.SimpleNamespace(calculate_per_token_loss=True, fp16=True, grad_scale_func=abs, no_sync_func=None,
                                   finalize_model_grads_func=print)
    chunk = types.SimpleNamespace(config=config, ddp_config=types.SimpleNamespace(
        average_in_collective=False, overlap_grad_reduce=False))
    check_megatron_config([chunk], head="fused")
    with pytest.raises(ValueError, match=r"^loss.head=fused_grad does not support fp16 \(got TransformerConfig.fp16"):
        check_megatron_config([chunk], head="fused_grad")
