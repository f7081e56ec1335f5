"""Against a real Megatron-LM checkout (MEGATRON_LM_DIR): its API matches the record, and the
drop-in with policy_loss=ppo reproduces its own calculate_grpo_loss. Skipped without a checkout.

The checkout's sources are parsed, not imported (rl_utils.py imports GPU-only packages); its
calculate_grpo_loss is compiled alone, with a stub for its logging helper.
"""
import ast
import logging
import os
from pathlib import Path

import pytest
import torch

from megatron_cispo.config import LossConfig
from megatron_cispo.integrations import megatron_lm as mlm
from megatron_cispo.integrations.megatron_lm.patch import signature_mismatch

ROOT = os.environ.get("MEGATRON_LM_DIR")
pytestmark = pytest.mark.skipif(not ROOT, reason="MEGATRON_LM_DIR is not set: no Megatron-LM checkout to test against")


def _module(rel):
    path = Path(ROOT) / rel
    if not path.is_file():
        pytest.fail(f"MEGATRON_LM_DIR={ROOT} has no {rel}; point it at a Megatron-LM checkout")
    return ast.parse(path.read_text())


def _function(tree, name):
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{name} not found"
    return found[0]


def _params(fn):
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    out = [[p.arg, d] for p, d in zip(positional, defaults)]
    return out + [[p.arg, None if d is None else ast.unparse(d)] for p, d in zip(a.kwonlyargs, a.kw_defaults)]


def test_checkout_rl_utils_signatures_match_the_record():
    rl = _module("megatron/rl/rl_utils.py")
    for name, spec in mlm.API["functions"].items():
        assert signature_mismatch(_params(_function(rl, name)), spec["params"]) is None, name


def test_checkout_train_rl_imports_the_recorded_names_and_pretrain_has_the_hooks():
    tree = _module("train_rl.py")
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == mlm.API["rl_utils_module"]
                for a in n.names}
    assert set(mlm.API["train_rl_imports_from_rl_utils"]) <= imported
    pretrain = [p for p, _ in _params(_function(_module("megatron/training/training.py"), "pretrain"))]
    assert set(mlm.API["pretrain"]["required_params"]) <= set(pretrain)


def test_dropin_ppo_reproduces_the_checkouts_calculate_grpo_loss():
    fn = _function(_module("megatron/rl/rl_utils.py"), "calculate_grpo_loss")
    namespace = {"torch": torch, "logging": logging, "logger": logging.getLogger("megatron_lm_checkout"),
                 "log_single_rank": lambda *a, **k: None}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "rl_utils.calculate_grpo_loss", "exec"), namespace)
    theirs = namespace["calculate_grpo_loss"]
    mlm.configure(LossConfig(policy_loss="ppo"))
    try:
        g = torch.Generator().manual_seed(0)
        for packed in (False, True):
            b, s = (1, 10) if packed else (3, 6)
            cur = (-3 * torch.rand(b, s, generator=g)).requires_grad_(True)
            kw = dict(old_logprobs=cur.detach() + 0.5 * torch.randn(b, s, generator=g),
                      ref_logprobs=cur.detach() + 0.2 * torch.randn(b, s, generator=g),
                      advantages=torch.randn(3, generator=g), clamp_eps_lower=0.2, clamp_eps_upper=0.28,
                      kl_beta=0.05, entropy_weight=0.01, is_truncation_coef=1.5,
                      seq_starts=[0, 3, 7] if packed else None, seq_lengths=[3, 4, 5] if packed else None)
            kw["inference_logprobs"] = kw["old_logprobs"] + 0.3 * torch.randn(b, s, generator=g)
            ours, want = mlm.calculate_grpo_loss(cur, **kw), theirs(cur, **kw)
            assert len(ours) == len(want) == 6
            for o, w in zip(ours, want):
                torch.testing.assert_close(o.to(w.dtype), w.detach(), rtol=1e-5, atol=1e-6)
            go, = torch.autograd.grad(ours[0].sum(), cur)
            gw, = torch.autograd.grad(want[0].sum(), cur)
            torch.testing.assert_close(go, gw, rtol=1e-5, atol=1e-6)
    finally:
        mlm.configure(None)
