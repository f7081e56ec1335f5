"""install(), the launcher and the vocab-parallel get_logprobs on a stand-in Megatron-LM module tree.

The stand-ins have the real module paths, attribute names and 0.16 signatures (no Megatron code):
megatron.rl.rl_utils, megatron.training (pretrain, get_args), megatron.core.package_info, train_rl;
the model stand-ins have the forward signatures of the installed megatron-core's GPTModel (0.18+
adds output_processor), Float16Module and DistributedDataParallel (checked against it).
"""
import inspect
import argparse
import sys
import types
from functools import partial

import pytest
import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from megatron_cispo.integrations import megatron_lm as mlm
from megatron_cispo.integrations.megatron_lm import dropin, patch, vocab_logprobs
from megatron_cispo.integrations.megatron_lm import run as launcher
from megatron_cispo.integrations.megatron_lm.api import describe_params, entry_point_requirements


def _orig_calculate_grpo_loss(current_logprobs, old_logprobs, ref_logprobs, advantages, clamp_eps_lower,
                              clamp_eps_upper, kl_beta, entropy_weight, inference_logprobs=None,
                              is_truncation_coef=None, seq_starts=None, seq_lengths=None):
    raise AssertionError("the original calculate_grpo_loss must not run once patched")


def _orig_get_logprobs(model, tokens, position_ids, no_grad=False, sequence_packing=False, packed_seq_params=None):
    raise AssertionError("the original get_logprobs must not run once patched")


def _stub(*a, **k):
    return None


def _get_attr_wrapped_model(model, attr):
    """Megatron's helper: the attribute of the first module in the DDP / Float16Module chain that has it."""
    while not hasattr(model, attr) and hasattr(model, "module"):
        model = model.module
    return getattr(model, attr)


class _Tree:
    """Builds the stand-in modules into sys.modules (undone by monkeypatch)."""

    def __init__(self, monkeypatch, version="0.16.1", calculate_grpo_loss=_orig_calculate_grpo_loss, drop=()):
        self.args = None
        rl = types.ModuleType("megatron.rl.rl_utils")
        rl.__file__ = "/fake/megatron/rl/rl_utils.py"
        names = dict(calculate_grpo_loss=calculate_grpo_loss, get_logprobs=_orig_get_logprobs,
                     get_rl_runtime_state=_stub, load_packed_data_by_index=_stub, get_args=lambda: self.args,
                     get_attr_wrapped_model=_get_attr_wrapped_model, is_pp_last_stage=lambda pp: pp == "last",
                     get_default_packed_seq_params=_stub)
        for name, obj in names.items():
            if name not in drop:
                setattr(rl, name, obj)
        self.pretrain = self._pretrain  # one bound-method object, imported by name like a function
        training = types.ModuleType("megatron.training")
        training.pretrain = self.pretrain
        training.get_args = lambda: self.args
        arguments = types.ModuleType("megatron.training.arguments")
        arguments.parse_args = _parse_args
        info = types.ModuleType("megatron.core.package_info")
        info.__version__ = version
        train_rl = types.ModuleType("train_rl")  # what `from megatron.rl.rl_utils import ...` leaves behind
        train_rl.calculate_grpo_loss, train_rl.get_logprobs = calculate_grpo_loss, _orig_get_logprobs
        train_rl.pretrain = self.pretrain
        for name, mod in {"megatron.rl": types.ModuleType("megatron.rl"), "megatron.rl.rl_utils": rl,
                          "megatron.training": training, "megatron.training.arguments": arguments,
                          "megatron.core.package_info": info,
                          "train_rl": train_rl}.items():
            monkeypatch.setitem(sys.modules, name, mod)
        self.rl, self.training, self.train_rl, self.arguments = rl, training, train_rl, arguments
        self.pretrain_calls = 0

    def _pretrain(self, train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                  process_non_loss_data_func=None, extra_args_provider=None, args_defaults={},
                  get_embedding_ranks=None, get_position_embedding_ranks=None, non_loss_data_func=None,
                  store=None, inprocess_call_wrapper=None):
        """Like Megatron's: ft_integration.setup() parses argv without the extra provider, then
        initialize_megatron parses it with it (both through megatron.training.arguments.parse_args,
        as Megatron's modules call it); then one forward/loss."""
        self.pretrain_calls += 1
        self.arguments.parse_args(ignore_unknown_args=True)
        self.args = self.arguments.parse_args(extra_args_provider)
        output, loss_fn = forward_step_func(None, None)
        self.result = loss_fn(output)


def _parse_args(extra_args_provider=None, ignore_unknown_args=False):
    """megatron.training.arguments.parse_args: Megatron's flags, the extra provider's, then argv."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser.add_argument("--grpo-kl-beta", type=float, default=0.0)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser.parse_known_args()[0] if ignore_unknown_args else parser.parse_args()


def _loss_func(loss_mask, output_tensor):
    """train_rl.loss_func's contract: (loss_sum, tokens, {'lm loss': [sum, tokens], ...})."""
    tokens = loss_mask.sum()
    loss = torch.cat([(output_tensor * loss_mask).sum().view(1), tokens.view(1)])
    return loss[0], tokens.int(), {"lm loss": loss.detach().clone(), "rl/kl_term": loss.detach().clone()}


def _forward_step(rl_module_calculate, data_iterator, model):
    g = torch.Generator().manual_seed(0)
    cur = -torch.rand(2, 5, generator=g)
    loss, *_ = rl_module_calculate(current_logprobs=cur, old_logprobs=cur - 0.1, ref_logprobs=cur,
                                   advantages=torch.tensor([-1.0, -2.0]), clamp_eps_lower=0.2, clamp_eps_upper=0.2,
                                   kl_beta=0.0, entropy_weight=0.0, inference_logprobs=cur - 0.3)
    return loss, partial(_loss_func, torch.ones(2, 5))


@pytest.fixture(autouse=True)
def _clean():
    yield
    mlm.uninstall()


def test_install_patches_rl_utils_and_names_train_rl_imported_and_is_idempotent(monkeypatch):
    tree = _Tree(monkeypatch)
    mlm.install()
    mlm.install()
    for mod in (tree.rl, tree.train_rl):
        assert mod.calculate_grpo_loss is mlm.calculate_grpo_loss
        assert mod.get_logprobs is mlm.get_logprobs
    assert mlm.installed()
    assert tree.training.pretrain is tree.train_rl.pretrain
    assert tree.training.pretrain.__wrapped__ is tree.pretrain  # wrapped once, not twice
    mlm.uninstall()
    assert tree.rl.calculate_grpo_loss is _orig_calculate_grpo_loss
    assert tree.train_rl.get_logprobs is _orig_get_logprobs
    assert tree.train_rl.pretrain is tree.pretrain and not mlm.installed()


def test_uninstall_restores_megatrons_names_and_leaves_megatron_cispos_own(monkeypatch):
    tree = _Tree(monkeypatch)
    ours = {"calculate_grpo_loss": dropin.calculate_grpo_loss, "get_logprobs": vocab_logprobs.get_logprobs}
    homes = {"calculate_grpo_loss": (mlm, dropin, patch), "get_logprobs": (mlm, vocab_logprobs, patch)}
    mlm.install()
    mlm.uninstall()
    for name, fn in ours.items():
        for mod in homes[name]:
            assert getattr(mod, name) is fn, f"{mod.__name__}.{name} was rebound to Megatron's"
        assert patch.REPLACEMENTS[name] is fn
    for mod in (tree.rl, tree.train_rl):
        assert mod.calculate_grpo_loss is _orig_calculate_grpo_loss and mod.get_logprobs is _orig_get_logprobs
    mlm.install()  # a second round trip patches with our functions again
    assert tree.train_rl.get_logprobs is ours["get_logprobs"] and mlm.installed()


def test_install_sweep_patches_foreign_modules_but_never_megatron_cispos(monkeypatch):
    tree = _Tree(monkeypatch)
    inside, outside = types.ModuleType("megatron_cispo._holder"), types.ModuleType("user_loop")
    inside.get_logprobs = outside.get_logprobs = _orig_get_logprobs
    monkeypatch.setitem(sys.modules, inside.__name__, inside)
    monkeypatch.setitem(sys.modules, outside.__name__, outside)
    mlm.install()
    assert outside.get_logprobs is mlm.get_logprobs and tree.train_rl.get_logprobs is mlm.get_logprobs
    assert inside.get_logprobs is _orig_get_logprobs
    mlm.uninstall()
    assert outside.get_logprobs is _orig_get_logprobs


def test_install_fails_clearly_on_a_mismatched_signature_and_patches_nothing(monkeypatch):
    def older(current_logprobs, old_logprobs, ref_logprobs, advantages, clamp_eps_lower, clamp_eps_upper,
              kl_beta, entropy_weight, inference_logprobs=None, is_truncation_coef=None):
        pass
    tree = _Tree(monkeypatch, version="0.15.0", calculate_grpo_loss=older)
    with pytest.raises(mlm.MegatronLMVersionError) as e:
        mlm.install()
    msg = str(e.value)
    for part in ("calculate_grpo_loss", "parameter 10: expected seq_starts=None, found nothing",
                 "megatron-core 0.15.0", "/fake/megatron/rl/rl_utils.py", "core_v0.16.1"):
        assert part in msg
    assert tree.rl.calculate_grpo_loss is older and tree.rl.get_logprobs is _orig_get_logprobs


def test_install_fails_clearly_when_a_symbol_is_missing(monkeypatch):
    _Tree(monkeypatch, version="0.17.0rc0", drop=("get_logprobs", "get_rl_runtime_state"))
    with pytest.raises(mlm.MegatronLMVersionError, match=r"lacks get_logprobs, get_rl_runtime_state.*0\.17\.0rc0"):
        mlm.install()


def test_install_without_megatron_lm_says_to_put_it_on_pythonpath(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.rl", None)  # as with only the megatron-core wheel
    with pytest.raises(mlm.MegatronLMVersionError, match="PYTHONPATH") as e:
        mlm.install()
    assert "megatron.rl" in str(e.value) and "pip install" not in str(e.value)


def _megatron_rl_importing(monkeypatch, tmp_path, package):
    """A megatron.rl package on disk whose rl_utils imports `package`, which is not installed."""
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "rl_utils.py").write_text(f"import {package}\n")
    rl = types.ModuleType("megatron.rl")
    rl.__path__ = [str(tmp_path / "rl")]
    monkeypatch.setitem(sys.modules, "megatron.rl", rl)
    monkeypatch.delitem(sys.modules, "megatron.rl.rl_utils", raising=False)
    monkeypatch.setitem(sys.modules, package, None)  # not installed, whatever this machine has


def test_install_with_a_missing_package_names_it_and_the_extra_not_pythonpath(monkeypatch, tmp_path):
    _megatron_rl_importing(monkeypatch, tmp_path, "pydantic")
    with pytest.raises(ImportError) as e:
        mlm.install()
    msg = str(e.value)
    assert "'pydantic'" in msg and 'pip install "megatron_cispo[megatron-lm]"' in msg
    assert "pip install 'pydantic>=2'" in msg and "PYTHONPATH" not in msg and "\n" not in msg


def test_setup_pys_megatron_lm_extra_installs_every_package_megatron_lms_entry_point_needs(monkeypatch):
    """The extra is the union of every recorded ref's list (test_megatron_lm_checkout.py checks each)."""
    import runpy
    from pathlib import Path

    import setuptools

    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "setup.py"))
    wanted = {"pydantic", "wandb", "tensorboard", "flask_restful", "tiktoken", "sentencepiece", "triton",
              "transformers", "fastapi", "uvicorn", "httpx", "datasets", "six", "regex", "tqdm", "openai"}
    assert set(entry_point_requirements()) == wanted
    assert sorted(seen["extras_require"]["megatron-lm"]) == patch.megatron_lm_extra()
    assert {r.split(">")[0].replace("-", "_") for r in patch.megatron_lm_extra()} == wanted


def launch_refused(monkeypatch, tmp_path, capsys) -> str:
    """Run the launcher on a train_rl.py that must not run; assert exit 2; return its stderr."""
    script = tmp_path / "train_rl.py"
    script.write_text("raise AssertionError('the script must not run when install() failed')\n")
    monkeypatch.setattr(sys, "argv", ["run"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert launcher.main([str(script)]) == 2
    return capsys.readouterr().err.strip()


def test_launcher_reports_a_missing_package_in_one_line_and_exits_2(monkeypatch, tmp_path, capsys):
    _megatron_rl_importing(monkeypatch, tmp_path, "pydantic")
    err = launch_refused(monkeypatch, tmp_path, capsys)
    assert len(err.splitlines()) == 1 and "pydantic" in err and "Traceback" not in err


def test_launcher_help_with_a_script_lists_megatrons_and_the_cispo_flags(monkeypatch, tmp_path, capsys):
    """Megatron's ft_integration.setup() parses argv before the --cispo-* flags exist."""
    _Tree(monkeypatch)
    script = tmp_path / "train_rl.py"
    script.write_text("from megatron.training import pretrain\npretrain(None, None, None, None)\n")
    monkeypatch.setattr(sys, "argv", ["run"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as e:
        launcher.main([str(script), "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--grpo-kl-beta", "--cispo-anchor", "--cispo-policy-loss", "--cispo-temperature"):
        assert flag in out, flag


def test_launcher_help_without_a_script_lists_the_cispo_flags(capsys):
    assert launcher.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage" in out and "train_rl.py --help" in out
    for flag in mlm.settings.FLAGS:
        assert flag in out, flag


def test_patched_pretrain_adds_cispo_flags_and_reports_negated_loss(monkeypatch):
    tree = _Tree(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["train_rl.py", "--cispo-anchor", "rollout", "--cispo-eps-high", "0.5"])
    mlm.install()
    tree.train_rl.pretrain(None, None, None, partial(_forward_step, tree.train_rl.calculate_grpo_loss))
    assert mlm.loss_config().cispo.anchor == "rollout" and mlm.loss_config().cispo.eps_high == 0.5
    loss, tokens, report = tree.result
    assert loss < 0  # -w * A * log pi < 0 for A < 0: Megatron's console would hide 'lm loss'
    assert report["neg lm loss"][0] == -report["lm loss"][0] > 0
    assert report["neg lm loss"][1] == report["lm loss"][1] == 10


def test_launcher_runs_the_script_as_main_with_the_patch_in_place(monkeypatch, tmp_path):
    tree = _Tree(monkeypatch)
    script = tmp_path / "train_rl.py"
    script.write_text(
        "from megatron.rl.rl_utils import calculate_grpo_loss, get_logprobs\n"
        "from megatron.training import pretrain\n"
        "import sys\n"
        "sys.modules['megatron.training'].seen = (__name__, calculate_grpo_loss, get_logprobs, pretrain)\n")
    monkeypatch.setattr(sys, "argv", ["run"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert launcher.main([str(script), "--cispo-anchor", "rollout"]) == 0
    name, calc, getlp, pretrain = tree.training.seen
    assert name == "__main__" and calc is mlm.calculate_grpo_loss and getlp is mlm.get_logprobs
    assert pretrain.__wrapped__ is tree.pretrain
    assert sys.argv == [str(script), "--cispo-anchor", "rollout"] and sys.path[0] == str(tmp_path)


def test_launcher_without_a_script_prints_usage(capsys):
    assert launcher.main([]) == 2
    assert "usage" in capsys.readouterr().err


class _Model16:
    """GPTModel's last stage before megatron-core 0.18: forward has GPTModel.forward's exact
    parameters (no **kwargs, no fp32_output), so a keyword it lacks raises TypeError as in Megatron."""

    def __init__(self, logits):
        self.logits, self.calls = logits, []
        self.config = types.SimpleNamespace(flash_decode=True)
        self.pg_collection = types.SimpleNamespace(pp="last", tp=None)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                runtime_gather_output=None, *, inference_params=None, loss_mask=None, padding_mask=None):
        return self._run(runtime_gather_output)

    def _run(self, runtime_gather_output, output_processor=None):
        self.calls.append((self.config.flash_decode, {"runtime_gather_output": runtime_gather_output}))
        return self._output(output_processor)

    def _output(self, output_processor):
        assert output_processor is None, "a logits stand-in has no decoder hidden states"
        return self.logits


class _Model18(_Model16):
    """GPTModel's last stage from megatron-core 0.18 (PR #4686): keyword-only output_processor."""

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                runtime_gather_output=None, *, inference_params=None, loss_mask=None, padding_mask=None,
                output_processor=None, output_processor_context=None):
        return self._run(runtime_gather_output, output_processor)


# The installed tier's GPTModel; the signature test below checks the choice against it.
_Model = _Model18 if "output_processor" in inspect.signature(GPTModel.forward).parameters else _Model16


class Float16Module:
    """megatron.core.transformer.module.Float16Module: upcasts the output unless fp32_output=False."""

    def __init__(self, module):
        self.module, self.config, self.fp32_output = module, module.config, []

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *inputs, fp32_output=True, **kwargs):
        self.fp32_output.append(fp32_output)
        out = self.module(*inputs, **kwargs)
        return out.float() if fp32_output else out


class DistributedDataParallel(Float16Module):
    """megatron.core.distributed.DistributedDataParallel: passes everything through."""

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)


def test_model_stand_ins_have_megatron_cores_forward_signatures():
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.transformer.module import Float16Module as F16

    for ours, theirs in ((_Model, GPTModel), (Float16Module, F16), (DistributedDataParallel, DDP)):
        assert describe_params(ours.forward) == describe_params(theirs.forward), theirs.__name__
    assert "fp32_output" not in inspect.signature(GPTModel.forward).parameters


def _args(bf16):
    return argparse.Namespace(fp16=False, bf16=bf16, rl_sequence_packing_max_sequences_per_bin=8)


def test_get_logprobs_passes_fp32_output_only_through_a_float16module(monkeypatch):
    tree = _Tree(monkeypatch)
    logits = torch.randn(2, 6, 11, generator=torch.Generator().manual_seed(4))
    tokens = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(5))
    # fp32 run: DDP(GPTModel), no Float16Module. Passing fp32_output would be a TypeError.
    tree.args = _args(bf16=False)
    for model in (_Model(logits), DistributedDataParallel(_Model(logits))):
        assert mlm.get_logprobs(model, tokens, None).dtype == torch.float32
    # bf16 run: DDP(Float16Module(GPTModel)) gets Megatron-LM's fp32_output=False, so no fp32 upcast.
    tree.args = _args(bf16=True)
    inner = _Model(logits.bfloat16())
    f16 = Float16Module(inner)
    assert mlm.get_logprobs(DistributedDataParallel(f16), tokens, None).dtype == torch.bfloat16
    assert f16.fp32_output == [False] and inner.calls[0][1] == {"runtime_gather_output": False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_get_logprobs_keeps_the_shard_and_matches_log_softmax(monkeypatch, dtype):
    tree = _Tree(monkeypatch)
    tree.args = _args(bf16=dtype == torch.bfloat16)
    logits = torch.randn(2, 6, 11, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1))
    inner = _Model(logits)
    model = DistributedDataParallel(Float16Module(inner) if dtype == torch.bfloat16 else inner)
    lp = mlm.get_logprobs(model, tokens, torch.arange(6).expand(2, 6))
    flash, kwargs = inner.calls[0]
    assert kwargs["runtime_gather_output"] is False
    assert flash is False and model.config.flash_decode is True  # off for the forward, restored after
    want = torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    assert lp.shape == (2, 5) and lp.dtype == dtype  # Megatron's old-logprob pass asserts this dtype
    torch.testing.assert_close(lp.float(), want.to(dtype).float())
    lp.float().sum().backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape
    inner.pg_collection.pp = "first"
    assert mlm.get_logprobs(model, tokens, None, no_grad=True) is logits  # non-last stage: output as is


def test_vocab_parallel_get_logprobs_scores_the_full_contiguous_shard_without_a_copy(monkeypatch):
    from megatron_cispo.logprobs import IGNORE_INDEX, token_logprobs
    from megatron_cispo.step import head

    tree = _Tree(monkeypatch)
    tree.args = _args(bf16=False)
    logits = torch.randn(2, 6, 11, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    tokens = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(3))
    seen = []

    def spy(x, targets, **kw):
        seen.append((x, targets))
        return token_logprobs(x, targets, **kw)

    monkeypatch.setattr(head, "token_logprobs", spy)  # the drop-in scores through step.head.score_output
    lp = mlm.get_logprobs(_Model(logits), tokens, torch.arange(6).expand(2, 6))
    (x, targets), = seen
    # the model's own buffer, not an [:, :-1] view that token_logprobs would have to copy
    assert x is logits and x.is_contiguous()
    assert torch.equal(targets[:, :-1], tokens[:, 1:]) and (targets[:, -1] == IGNORE_INDEX).all()
    want = torch.log_softmax(logits.detach()[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    assert lp.shape == (2, 5) and lp.is_contiguous()
    torch.testing.assert_close(lp, want)


class _Layer(torch.nn.Module):
    """A ColumnParallelLinear stand-in: forward(hidden [s, b, h], weight=None) -> (logits, bias)."""

    def __init__(self, weight):
        super().__init__()
        self.weight, self.sequence_parallel = torch.nn.Parameter(weight), False

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden, self.weight if weight is None else weight), None


class _GPT(_Model):
    """GPTModel's last stage: decoder hidden states [s, b, h] -> the output layer -> logits
    transposed to [b, s, v]; or, given an output_processor (0.18+), what it returns."""

    def __init__(self, hidden, weight):
        super().__init__(None)
        self.hidden, self.output_layer = hidden, _Layer(weight)

    def _output(self, output_processor):
        if output_processor is not None:  # the keywords GPTModel._postprocess passes
            out = output_processor(
                hidden_states=self.hidden, output_layer=self.output_layer, output_weight=None, labels=None,
                loss_mask=None, input_ids=None, position_ids=None, attention_mask=None, decoder_input=None,
                inference_context=None, packed_seq_params=None, runtime_gather_output=False, context=None,
                compute_language_model_loss=None, scale_logits=lambda x: x, config=self.config)
        else:
            logits, _ = self.output_layer(self.hidden)
            out = logits.transpose(0, 1).contiguous()
        self.returned = tuple(out.shape)
        return out


def test_fused_head_get_logprobs_matches_the_logits_head_without_materialising_logits(monkeypatch):
    from megatron_cispo.config import LossConfig

    tree = _Tree(monkeypatch)
    tree.args = _args(bf16=False)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 11, (2, 6), generator=g)
    hidden, weight = torch.randn(6, 2, 4, generator=g), torch.randn(11, 4, generator=g)
    results = {}
    try:
        for head in ("logits", "fused"):
            mlm.configure(LossConfig(head=head))
            h = hidden.clone().requires_grad_(True)
            model = _GPT(h, weight.clone())
            lp = mlm.get_logprobs(model, tokens, torch.arange(6).expand(2, 6))
            (lp * torch.linspace(-1, 1, 5)).sum().backward()
            results[head] = (lp.detach(), h.grad, model.output_layer.weight.grad)
            assert model.returned == (2, 6, 4 if head == "fused" else 11)  # fused: hidden states, no logits
    finally:
        mlm.configure(LossConfig())
    for want, got in zip(results["logits"], results["fused"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    want = torch.log_softmax(hidden @ weight.t(), -1).transpose(0, 1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    torch.testing.assert_close(results["fused"][0], want, rtol=1e-5, atol=1e-6)
