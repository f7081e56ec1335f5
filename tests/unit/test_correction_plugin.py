"""A correction is one file plus a registration (losses/corrections.py): a plugin correction, written as a
user would, with its own settings at correction.<its name>, runs in the loss, asks for its inputs, is
served by loss.head=fused_grad without falling back, and a bad name or value is one line."""
import sys
import textwrap

import pytest
import torch

from megatron_cispo.config import ConfigError, LossConfig, from_dict
from megatron_cispo.losses import compute_policy_loss, registry, required_inputs
from megatron_cispo.losses.corrections import CORRECTIONS
from megatron_cispo.losses.token_grad import fused_grad_fallback
from test_token_grad import assert_fused_grad_equals_fused

PLUGIN = textwrap.dedent('''
    """tail_drop: drop a token whose |log ratio| exceeds a bound (the ratio MIS tests)."""
    from dataclasses import dataclass

    from megatron_cispo.losses.corrections import BOTH, Correction, register_correction


    @dataclass(frozen=True)
    class TailDrop:
        max_abs_log_ratio: float = 1.0

        def __post_init__(self):
            if not self.max_abs_log_ratio > 0:
                raise ValueError(f"max_abs_log_ratio must be > 0, got {self.max_abs_log_ratio}")


    def keep(s, ctx):
        hit = ctx.log_ratio.abs() <= s.max_abs_log_ratio
        ctx.m.frac("correction/tail_drop_masked_frac", ~hit, ctx.valid)
        return hit


    def needs(s, anchor):
        return {n: "correction.tail_drop" for n in BOTH} if anchor == "old" else {}


    register_correction(Correction("tail_drop", keep, needs=needs, config=TailDrop))
''')


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    (tmp_path / "cispo_tail_drop.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    import cispo_tail_drop
    try:
        yield cispo_tail_drop
    finally:
        CORRECTIONS.pop("tail_drop", None)
        sys.modules.pop("cispo_tail_drop", None)
        for cached in (registry._checked_anchor, registry._input_reasons):  # decided while it was registered
            cached.cache_clear()


def _cfg(anchor="rollout", **section):
    return from_dict(LossConfig, {"cispo": {"anchor": anchor}, "correction": {"tail_drop": section}}, path="loss")


def test_it_drops_the_tokens_its_rule_names_and_nothing_else(plugin):
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 6, generator=g) - 0.5).requires_grad_()
    rollout = lp.detach() + torch.linspace(-1.5, 1.5, 18).view(3, 6)  # log r from +1.5 down to -1.5
    adv, mask = torch.randn(3, generator=g), torch.ones(3, 6, dtype=torch.bool)
    cfg = _cfg(max_abs_log_ratio=0.8)
    out = compute_policy_loss(cfg, lp, advantages=adv, loss_mask=mask, rollout_logprobs=rollout)
    out.loss_sum.backward()
    dropped = (lp.detach() - rollout).abs() > 0.8
    assert dropped.any() and (~dropped).any()
    assert (lp.grad[dropped] == 0).all() and (lp.grad[~dropped] != 0).all()
    values = out.metrics.values()
    assert values["correction/tail_drop_masked_frac"] == pytest.approx(dropped.float().mean().item())
    assert values["correction/dropped_token_frac"] == pytest.approx(dropped.float().mean().item())
    assert out.denominator.item() == 18  # dropped tokens stay in the denominator


def test_it_asks_for_its_inputs_and_fused_grad_serves_it_chunk_by_chunk(plugin):
    assert required_inputs(_cfg("old")) == {"old_logprobs", "rollout_logprobs"}
    assert required_inputs(_cfg("rollout")) == {"rollout_logprobs"}
    assert fused_grad_fallback(_cfg(max_abs_log_ratio=0.5), False) is None
    assert_fused_grad_equals_fused({"cispo": {"anchor": "rollout"},
                                    "correction": {"tail_drop": {"max_abs_log_ratio": 0.5}}})


@pytest.mark.parametrize("correction,says", [
    ({"tail_drop": {"max_abs_log_ratio": -1}}, "correction.tail_drop: max_abs_log_ratio must be > 0"),
    ({"tail_drop": {"max_abs": 1}}, "correction.tail_drop.max_abs: unknown key; known keys: max_abs_log_ratio"),
    ({"tail_dropp": {}}, "correction.tail_dropp: unknown key; known keys: mis, geo_rs, opsm, opsm_ref, m2po, tail_drop"),
])
def test_a_bad_name_or_value_is_one_line(plugin, correction, says):
    from megatron_cispo.losses import check_loss_config

    with pytest.raises((ConfigError, ValueError)) as e:
        check_loss_config(from_dict(LossConfig, {"correction": correction}, path="loss"))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_without_the_plugin_its_section_is_an_unknown_key():
    from megatron_cispo.losses import check_loss_config

    with pytest.raises(ValueError, match=r"correction.tail_drop: unknown key; known keys: mis, geo_rs, opsm, opsm_ref, m2po$"):
        check_loss_config(from_dict(LossConfig, {"correction": {"tail_drop": {}}}, path="loss"))
