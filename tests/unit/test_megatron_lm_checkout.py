"""Against a real Megatron-LM checkout (MEGATRON_LM_DIR): its API matches the record, the extra
[megatron-lm] covers what its train_rl.py imports, and the drop-in with policy_loss=ppo reproduces
its own calculate_grpo_loss. Skipped without a checkout.

    MEGATRON_LM_DIR=/path/to/Megatron-LM python -m pytest tests/unit/test_megatron_lm_checkout.py

Most tests parse the checkout's sources; its calculate_grpo_loss is compiled alone, with a stub
for its logging helper. Two run the launcher on the checkout's train_rl.py in a subprocess: they
need the extra installed (pip install "megatron_cispo[megatron-lm]") and are skipped without it.
"""
import ast
import importlib.util
import logging
import os
import subprocess
import sys
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
    parse_args = [p for p, _ in _params(_function(_module("megatron/training/arguments.py"), "parse_args"))]
    assert set(mlm.API["parse_args"]["required_params"]) <= set(parse_args)


# Needed by train_rl.py but installed with megatron_cispo itself (torch, megatron-core, pyyaml).
_BASE = {"torch", "numpy", "packaging", "yaml", "typing_extensions", "megatron"}
# Imported through torch: the package that module needs.
_VIA_TORCH = {"torch.utils.tensorboard": "tensorboard"}


def _module_level_imports(tree):
    """(node, guarded) for imports that run when the module loads; guarded = inside a try that
    catches the failure, or under `if TYPE_CHECKING` / `if HAVE_...`."""
    out = []

    def visit(nodes, guarded):
        for n in nodes:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                out.append((n, guarded))
            elif isinstance(n, ast.Try):
                visit(n.body, guarded or bool(n.handlers))
                for part in (n.orelse, n.finalbody, *[h.body for h in n.handlers]):
                    visit(part, guarded)
            elif isinstance(n, ast.If):
                test = ast.unparse(n.test)
                visit(n.body, guarded or "TYPE_CHECKING" in test or "HAVE_" in test)
                visit(n.orelse, guarded)
            elif isinstance(n, (ast.ClassDef, ast.With)):
                visit(n.body, guarded)
    visit(tree.body, False)
    return out


def _packages_train_rl_imports():
    """Top-level packages outside the checkout that loading train_rl.py imports unconditionally."""
    root = Path(ROOT)

    def source(name):
        p = root.joinpath(*name.split("."))
        return next((f for f in (p / "__init__.py", p.with_suffix(".py")) if f.is_file()), None)

    seen, found, todo = set(), set(), [(root / "train_rl.py", "train_rl")]
    while todo:
        path, name = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node, guarded in _module_level_imports(ast.parse(path.read_text())):
            if guarded:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for full in names:
                parts = full.split(".")
                local = [(source(".".join(parts[:i])), ".".join(parts[:i])) for i in range(1, len(parts) + 1)]
                todo += [(f, n) for f, n in local if f is not None]
                top = parts[0]
                if _VIA_TORCH.get(full):
                    found.add(_VIA_TORCH[full])
                elif not (root / top).exists() and source(top) is None and top not in sys.stdlib_module_names:
                    found.add(top)
    return found - _BASE


def test_the_megatron_lm_extra_covers_what_the_checkouts_train_rl_imports():
    extra = set(mlm.API["entry_point_requirements"])
    loaded = _packages_train_rl_imports()
    assert loaded <= extra, f"train_rl.py imports {sorted(loaded - extra)}, which the extra lacks"
    # The rest are imported when a feature runs (a tokenizer kind, the text server, dataset agents).
    later = extra - loaded
    assert later == {"tiktoken", "sentencepiece", "flask_restful", "datasets"}, sorted(later)
    for name in later:
        hits = [p for p in Path(ROOT, "megatron").rglob("*.py")
                if any(isinstance(n, (ast.Import, ast.ImportFrom))
                       and name in ([a.name.split(".")[0] for a in n.names] if isinstance(n, ast.Import)
                                    else [(n.module or "").split(".")[0]])
                       for n in ast.walk(ast.parse(p.read_text())))]
        assert hits, f"nothing in the checkout imports {name}: drop it from the extra"


def _launch(args, env_extra, timeout=600):
    missing = [n for n in mlm.API["entry_point_requirements"] if importlib.util.find_spec(n) is None]
    if missing:
        pytest.skip(f"the extra [megatron-lm] is not installed (missing {', '.join(missing)}): "
                    'pip install "megatron_cispo[megatron-lm]"')
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **env_extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env_extra.get("PYTHONPATH"), repo, os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "megatron_cispo.integrations.megatron_lm.run",
                           str(Path(ROOT) / "train_rl.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_launcher_help_on_the_checkout_lists_megatrons_and_the_cispo_flags():
    proc = _launch(["--help"], {})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for flag in ("--perform-rl-step", "--grpo-kl-beta", *mlm.settings.FLAGS, mlm.settings.TEMPERATURE_FLAG):
        assert flag in proc.stdout, flag


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU train_rl.py would start training")
def test_launcher_patches_the_checkouts_rl_utils_and_train_rl_stops_at_megatrons_cuda_assert(tmp_path):
    """On CPU: train_rl.py loads with the extra, install() accepts the real modules, and pretrain
    reaches initialize_megatron, which asserts CUDA."""
    (tmp_path / "report_patch.py").write_text(
        "import atexit, sys\n"
        "def _report():\n"
        "    from megatron_cispo.integrations import megatron_lm as m\n"
        "    rl, tr = sys.modules['megatron.rl.rl_utils'], sys.modules['megatron.training']\n"
        "    print('PATCHED', rl.calculate_grpo_loss is m.calculate_grpo_loss, rl.get_logprobs is m.get_logprobs,\n"
        "          hasattr(tr.pretrain, '__wrapped__'), flush=True)\n"
        "atexit.register(_report)\n")
    proc = _launch(["--perform-rl-step", "--cispo-anchor", "rollout"],
                   {"PYTHONPATH": str(tmp_path), "MEGATRON_CISPO_PLUGINS": "report_patch"})
    assert proc.returncode != 0
    assert "Megatron requires CUDA" in proc.stderr and "initialize_megatron" in proc.stderr, proc.stderr[-3000:]
    assert "PATCHED True True True" in proc.stdout, proc.stdout[-2000:]


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
