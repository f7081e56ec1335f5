"""Registry, entry-point plugins, required_inputs and call-time input validation of the losses."""
import dataclasses
import importlib.metadata
import sys
import types

import pytest
import torch

from megatron_cispo.config import CispoConfig, KLConfig, LossConfig, TISConfig
from megatron_cispo.losses import (
    PolicyLossPluginError,
    available_policy_losses,
    check_loss_config,
    compute_policy_loss,
    get_policy_loss,
    register_policy_loss,
    required_inputs,
)
from megatron_cispo.losses import registry

LP = torch.zeros(2, 3)
ADV = torch.ones(2)
MASK = torch.ones(2, 3)


@pytest.fixture
def clean_registry(monkeypatch):
    """Isolate registrations and the plugins-loaded flag from other tests."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_plugins_loaded", False)


def fake_entry_points(monkeypatch, *eps):
    """Serve `eps` as the plugin group; returns the list of groups queried."""
    queried = []

    def entry_points(group=None):
        queried.append(group)
        return list(eps) if group == "megatron_cispo.policy_losses" else []
    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    return queried


def test_builtins_are_registered():
    assert {"cispo", "ppo", "rollout_is"} <= set(available_policy_losses())


def test_registering_a_name_twice_is_an_error(clean_registry):
    with pytest.raises(ValueError, match="policy loss 'cispo' is already registered"):
        register_policy_loss("cispo", anchor="old")(lambda cfg, x: None)


def test_unknown_loss_lists_known_names(clean_registry, monkeypatch):
    fake_entry_points(monkeypatch)
    with pytest.raises(ValueError, match=r"policy_loss='nope' is not a registered.*known: cispo, ppo, rollout_is"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match="'nope' is not a registered"):
        compute_policy_loss(LossConfig(policy_loss="nope"), logprobs=LP, advantages=ADV, loss_mask=MASK)


def test_entry_point_plugin_is_loaded_lazily_once_and_usable(clean_registry, monkeypatch):
    module = types.ModuleType("fake_plugin")
    loads = []

    def load():
        loads.append(1)

        @register_policy_loss("plain_pg", anchor="old")
        def plain_pg(cfg, x):
            from megatron_cispo.losses import Metrics
            return -x.advantages * x.logprobs, Metrics()
        return plain_pg

    ep = types.SimpleNamespace(name="plain_pg", value="fake_plugin:plain_pg", load=load)
    monkeypatch.setitem(sys.modules, "fake_plugin", module)
    queried = fake_entry_points(monkeypatch, ep)
    assert loads == []  # nothing loaded at import time
    assert "plain_pg" in available_policy_losses()
    available_policy_losses()
    with pytest.raises(ValueError, match="known: cispo, plain_pg, ppo, rollout_is"):
        get_policy_loss("other")
    assert loads == [1] and queried == ["megatron_cispo.policy_losses"]
    lp = torch.full((2, 3), -1.0, requires_grad=True)
    out = compute_policy_loss(LossConfig(policy_loss="plain_pg"), logprobs=lp, advantages=ADV, loss_mask=MASK,
                              old_logprobs=LP)
    assert out.loss.item() == 1.0
    assert required_inputs(LossConfig(policy_loss="plain_pg")) == {"old_logprobs"}


def test_broken_plugin_error_names_the_entry_point(clean_registry, monkeypatch):
    def load():
        raise ImportError("no module named fancy_dep")

    fake_entry_points(monkeypatch, types.SimpleNamespace(name="broken", value="broken_pkg.loss:fn", load=load))
    with pytest.raises(PolicyLossPluginError, match=r"'broken' = 'broken_pkg.loss:fn'.*fancy_dep"):
        available_policy_losses()
    with pytest.raises(PolicyLossPluginError, match="broken"):  # keeps failing, not silently skipped
        get_policy_loss("broken")


def test_plugin_that_does_not_register_its_name_is_an_error(clean_registry, monkeypatch):
    fake_entry_points(monkeypatch, types.SimpleNamespace(name="ghost", value="g:f", load=lambda: None))
    with pytest.raises(PolicyLossPluginError, match="did not register a loss named 'ghost'"):
        available_policy_losses()


@pytest.mark.parametrize("cfg,expected", [
    (LossConfig(), {"old_logprobs"}),
    (LossConfig(cispo=CispoConfig(anchor="rollout")), {"rollout_logprobs"}),
    (LossConfig(policy_loss="ppo"), {"old_logprobs"}),
    (LossConfig(policy_loss="rollout_is"), {"rollout_logprobs"}),
    (LossConfig(tis=TISConfig(level="token")), {"old_logprobs", "rollout_logprobs"}),
    (LossConfig(cispo=CispoConfig(anchor="rollout"), kl=KLConfig(coef=0.1), entropy_coef=0.01),
     {"rollout_logprobs", "ref_logprobs", "entropy"}),
])
def test_required_inputs_follow_loss_anchor_tis_kl_and_entropy(cfg, expected):
    assert required_inputs(cfg) == expected


@pytest.mark.parametrize("cfg,kwargs,message", [
    (LossConfig(cispo=CispoConfig(anchor="rollout")), {"old_logprobs": LP},
     r"cispo with anchor='rollout' needs rollout_logprobs \(the sampler's per-token logprobs\)"),
    (LossConfig(), {"rollout_logprobs": LP}, r"cispo with anchor='old' needs old_logprobs \(pi_old"),
    (LossConfig(policy_loss="rollout_is"), {}, "rollout_is with anchor='rollout' needs rollout_logprobs"),
    (LossConfig(tis=TISConfig(level="token")), {"old_logprobs": LP}, "tis.level='token' needs rollout_logprobs"),
    (LossConfig(kl=KLConfig(coef=0.5)), {"old_logprobs": LP}, "kl.coef=0.5 needs ref_logprobs"),
    (LossConfig(entropy_coef=0.1), {"old_logprobs": LP}, "entropy_coef=0.1 needs entropy"),
])
def test_missing_required_input_says_which_setting_needs_it(cfg, kwargs, message):
    with pytest.raises(ValueError, match=message):
        compute_policy_loss(cfg, logprobs=LP, advantages=ADV, loss_mask=MASK, **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    ({"advantages": torch.ones(3)}, r"advantages shape \(3,\) does not match logprobs shape \(2, 3\)"),
    ({"loss_mask": torch.ones(2, 4)}, r"loss_mask shape \(2, 4\) does not match logprobs shape \(2, 3\)"),
    ({"old_logprobs": torch.zeros(3, 2)}, r"old_logprobs shape \(3, 2\) does not match logprobs shape \(2, 3\)"),
    ({"logprobs": torch.zeros(6)}, r"logprobs must be a floating \[b, s\] tensor"),
])
def test_shape_mismatch_names_both_shapes(kwargs, message):
    args = {"logprobs": LP, "advantages": ADV, "loss_mask": MASK, "old_logprobs": LP, **kwargs}
    with pytest.raises(ValueError, match=message):
        compute_policy_loss(LossConfig(), **args)


def test_plugin_with_rollout_anchor_cannot_stack_tis(clean_registry):
    register_policy_loss("rollout_pg", anchor="rollout")(lambda cfg, x: (x.logprobs, None))
    cfg = LossConfig(policy_loss="rollout_pg", tis=TISConfig(level="token"))
    with pytest.raises(ValueError, match="policy_loss='rollout_pg' cannot be combined with tis.level='token': "
                                         "the loss anchors on rollout_logprobs, so TIS would double-count"):
        compute_policy_loss(cfg, logprobs=LP, advantages=ADV, loss_mask=MASK, old_logprobs=LP, rollout_logprobs=LP)


# The rule lives in losses.check_loss_config only: config.py checks its own fields, the step,
# the runner and the Megatron-LM drop-in all call the registry's check.
@pytest.mark.parametrize("cfg, message", [
    (LossConfig(cispo=CispoConfig(anchor="rollout"), tis=TISConfig(level="token")),
     "cispo.anchor='rollout' cannot be combined with tis.level='token': the loss anchors on rollout_logprobs, "
     "so TIS would double-count the off-policy correction; set tis.level to None or cispo.anchor to 'old'"),
    (LossConfig(policy_loss="rollout_is", tis=TISConfig(level="sequence")),
     "policy_loss='rollout_is' cannot be combined with tis.level='sequence': the loss anchors on "
     "rollout_logprobs, so TIS would double-count the off-policy correction; set tis.level to None$"),
])
def test_rollout_anchor_with_tis_is_refused_by_the_registry_check(cfg, message):
    with pytest.raises(ValueError, match=message):
        check_loss_config(cfg)
    with pytest.raises(ValueError, match=message):
        compute_policy_loss(cfg, LP, advantages=ADV, loss_mask=MASK, old_logprobs=LP, rollout_logprobs=LP)


def test_registry_check_runs_once_per_config_not_per_microbatch(monkeypatch):
    cfg = LossConfig(cispo=CispoConfig(anchor="rollout", eps_high=3.25))  # a config no other test uses
    calls = []
    real = registry.PolicyLoss.anchor_for
    monkeypatch.setattr(registry.PolicyLoss, "anchor_for", lambda self, c: calls.append(c) or real(self, c))
    registry._checked_anchor.cache_clear()
    for _ in range(3):
        check_loss_config(cfg)
    assert len(calls) == 1
    with pytest.raises(ValueError):  # a failing check is not cached: it fails every time
        check_loss_config(dataclasses.replace(cfg, tis=TISConfig(level="token")))
    with pytest.raises(ValueError):
        check_loss_config(dataclasses.replace(cfg, tis=TISConfig(level="token")))
