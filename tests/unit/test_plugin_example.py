"""docs/examples/capped_reinforce.py, the worked plugin of docs/algorithm.md ("Adding a loss"): loaded
as a plugin, it is one file and one registration, and the registry's properties it declares hold."""
import sys
from pathlib import Path

import pytest
import torch

from megatron_cispo.config import LossConfig
from megatron_cispo.integrations import megatron_lm as mlm
from megatron_cispo.integrations.megatron_lm.dropin import clip_bounds
from megatron_cispo.integrations.plugins import load_plugins
from megatron_cispo.losses import compute_policy_loss, get_policy_loss, registry
from megatron_cispo.losses.token_grad import fused_grad_fallback
from test_token_grad import assert_fused_grad_equals_fused  # _step_case's microbatch, both heads

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
CFG = LossConfig(policy_loss="capped_reinforce")


@pytest.fixture(scope="module")
def plugin():
    sys.path.insert(0, str(EXAMPLES))
    saved = dict(registry._REGISTRY)
    try:
        [mod] = load_plugins("capped_reinforce")  # as MEGATRON_CISPO_PLUGINS=capped_reinforce does
        yield mod
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)
        sys.modules.pop("capped_reinforce", None)
        sys.path.remove(str(EXAMPLES))


def test_the_plugin_registers_its_anchor_its_per_token_property_and_its_bounds(plugin):
    spec = get_policy_loss("capped_reinforce")
    assert spec.anchor_for(CFG) == "rollout" and spec.per_token
    assert spec.bounds_for(CFG) == clip_bounds(CFG) == (0.0, plugin.CAP)
    assert fused_grad_fallback(CFG, False) is None  # fused_grad serves it chunk by chunk


def test_the_loss_is_reinforce_with_the_weight_capped_and_its_metrics_named_after_it(plugin):
    g = torch.Generator().manual_seed(0)
    lp, adv = -torch.rand(3, 5, generator=g) - 0.5, torch.randn(3, generator=g)
    rollout = lp.detach() + torch.linspace(-1.5, 1.5, 15).view(3, 5)  # r = exp(lp - rollout) in [0.22, 4.5]
    mask = torch.ones(3, 5, dtype=torch.bool)
    lp.requires_grad_()
    out = compute_policy_loss(CFG, lp, advantages=adv, loss_mask=mask, rollout_logprobs=rollout)
    out.loss_sum.backward()
    weight = (lp.detach() - rollout).exp().clamp(max=plugin.CAP)
    torch.testing.assert_close(lp.grad, -(weight * adv[:, None]))  # token_mean: a sum, then / tokens later
    values = out.metrics.values()
    assert values["capped_reinforce/clip_frac_high"] == pytest.approx(float(((lp - rollout).exp() > 2).float().mean()))
    assert values["capped_reinforce/clip_frac_low"] == 0.0


def test_the_dropin_reports_the_fraction_the_loss_truncates(plugin):
    mlm.configure(CFG)
    try:
        cur = torch.tensor([[-1.0, -1.0, -1.0]])
        sampler = torch.tensor([[-1.0, -2.0, -3.0]])  # r = 1, e, e^2: the last two above CAP = 2
        *_, above, below = mlm.calculate_grpo_loss(cur, cur, cur, torch.tensor([1.0]), 0.2, 0.2, 0.0, 0.0,
                                                   inference_logprobs=sampler)
        assert above.tolist() == [[False, True, True]] and not below.any()
    finally:
        mlm.configure(None)


def test_fused_grad_serves_it_without_falling_back_and_equals_the_fused_head(plugin):
    assert_fused_grad_equals_fused({"policy_loss": "capped_reinforce"})
    # with its own section: a lower cap clips more of the same microbatch, and still nothing falls back
    assert_fused_grad_equals_fused({"policy_loss": "capped_reinforce", "sections": {"capped_reinforce": {"cap": 1.1}}})


def test_its_section_is_read_from_the_yaml_overridden_dumped_and_reloaded(plugin, tmp_path):
    from megatron_cispo.losses import loss_settings
    from megatron_cispo.runner.experiment import dump_yaml, load_experiment

    yaml = tmp_path / "exp.yaml"
    yaml.write_text((ROOT / "yaml_configs" / "demo_cpu.yaml").read_text().replace(
        "  policy_loss: cispo\n", "  policy_loss: capped_reinforce\n  capped_reinforce:\n    cap: 3.0\n"))
    cfg = load_experiment(yaml, [])
    assert loss_settings(cfg.loss) == plugin.CappedReinforceConfig(cap=3.0)
    assert get_policy_loss("capped_reinforce").bounds_for(cfg.loss) == clip_bounds(cfg.loss) == (0.0, 3.0)
    over = load_experiment(yaml, ["loss.capped_reinforce.cap=1.5"])
    assert loss_settings(over.loss).cap == 1.5 and hash(over.loss) != hash(cfg.loss)
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(dump_yaml(over))
    assert "  capped_reinforce:\n    cap: 1.5\n" in dumped.read_text()
    again = load_experiment(dumped, [])
    assert again.loss == over.loss and loss_settings(again.loss).cap == 1.5
    assert loss_settings(CFG) == plugin.CappedReinforceConfig()  # no section: the defaults


@pytest.mark.parametrize("overrides,says", [
    (["loss.capped_reinforce.cap=-1"], "loss.capped_reinforce: cap must be > 0, got -1.0"),
    (["loss.capped_reinforce.cab=1"], "loss.capped_reinforce.cab: unknown key; known keys: cap"),
    (["loss.capped_reinforce.cap=high"], "loss.capped_reinforce.cap"),
    (["loss.policy_loss=cispo", "loss.capped_reinforce.cap=3"], "loss.capped_reinforce: unknown key"),
])
def test_a_bad_section_is_one_line_naming_the_key(plugin, overrides, says):
    from megatron_cispo.config import ConfigError
    from megatron_cispo.runner.experiment import load_experiment

    with pytest.raises(ConfigError) as e:
        load_experiment(ROOT / "yaml_configs" / "demo_cpu.yaml", ["loss.policy_loss=capped_reinforce", *overrides])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_loss_without_a_section_refuses_one():
    from megatron_cispo.losses import loss_settings

    with pytest.raises(ValueError, match="the 'cispo' loss takes no settings of its own"):
        loss_settings(LossConfig(policy_loss="cispo", sections={"cispo": {"x": 1}}))


def test_the_docs_code_block_is_the_example_verbatim():
    doc = (EXAMPLES.parent / "algorithm.md").read_text().split("## Adding a loss: a worked plugin", 1)[1]
    block = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert block in (EXAMPLES / "capped_reinforce.py").read_text()
