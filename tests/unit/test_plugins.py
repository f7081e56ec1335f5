"""MEGATRON_CISPO_PLUGINS import hook: a plugin module's loss becomes usable by name, drop-in included."""
import sys

import pytest
import torch

from megatron_cispo.config import LossConfig
from megatron_cispo.integrations import megatron_lm as mlm
from megatron_cispo.integrations.plugins import ENV_VAR, PluginImportError, load_plugins, plugin_modules
from megatron_cispo.losses import available_policy_losses, registry

PLUGIN = '''
from megatron_cispo.losses import Metrics, register_policy_loss

@register_policy_loss("plain_pg_test", anchor="old")
def plain_pg(cfg, x):
    return -x.advantages * x.logprobs, Metrics()
'''


def test_plugin_modules_splits_on_commas_and_skips_blanks(monkeypatch):
    monkeypatch.setenv(ENV_VAR, " a.b , ,c ")
    assert plugin_modules() == ["a.b", "c"]
    assert plugin_modules("") == []


def test_env_listed_module_registers_a_loss_the_dropin_can_run(monkeypatch, tmp_path):
    (tmp_path / "my_cispo_plugin_mod.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # undone after the test
    monkeypatch.delitem(sys.modules, "my_cispo_plugin_mod", raising=False)
    monkeypatch.setenv(ENV_VAR, "my_cispo_plugin_mod")
    assert "plain_pg_test" not in available_policy_losses()
    [mod] = load_plugins()
    assert mod.__name__ == "my_cispo_plugin_mod" and "plain_pg_test" in available_policy_losses()
    try:
        mlm.configure(LossConfig(policy_loss="plain_pg_test"))
        cur = -torch.rand(2, 3)
        loss, _, _, _, above, below = mlm.calculate_grpo_loss(
            cur, cur, cur, torch.tensor([1.0, -2.0]), 0.2, 0.2, 0.0, 0.0)
        torch.testing.assert_close(loss, -torch.tensor([[1.0], [-2.0]]) * cur)
        assert not above.any() and not below.any()  # no clip section for a plugin loss: nothing truncated
    finally:
        mlm.configure(None)


def test_unimportable_plugin_names_the_variable_and_the_module():
    with pytest.raises(PluginImportError, match=rf"{ENV_VAR}: importing plugin module 'no_such_mod_x1'"):
        load_plugins("no_such_mod_x1")
