"""install() on stand-ins of every recorded Megatron-LM ref (no checkout): it matches the ref by
feature, the --cispo-* flags reach a train_rl.py that parses its arguments before pretrain (0.18+),
get_logprobs hands the model each ref's unpacked PackedSeqParams, and an API it does not know is
refused in one line. The stand-ins' functions are generated from the records (signatures, and the
names and keywords get_logprobs' code uses); test_megatron_lm_checkout*.py check real checkouts.
"""
import argparse
import dataclasses
import sys
import types

import pytest
import torch

from megatron_cispo.integrations import megatron_lm as mlm
from megatron_cispo.integrations.megatron_lm import api, vocab_logprobs


def _signature(params):
    return ", ".join(p if d is None else f"{p}={d}" for p, d in params)


def _function(name, params, body="    raise AssertionError('the original must not run once patched')\n", ns=None):
    namespace = dict(ns or {})
    exec(f"def {name}({_signature(params)}):\n{body}", namespace)
    return namespace[name]


def _megatron_get_logprobs(record, thd=None, cp=None):
    """A get_logprobs whose code builds the record's unpacked PackedSeqParams and CP split."""
    feats = record["get_logprobs_features"]
    thd = feats["unpacked_thd"] if thd is None else thd
    cp = feats["context_parallel"] if cp is None else cp
    body = ""
    if thd is not None:
        extra = "".join(f", {k}=0" for k in thd)
        body += f"    PackedSeqParams(qkv_format='thd', cu_seqlens_q=0, cu_seqlens_kv=0, max_seqlen_q=0, max_seqlen_kv=0{extra})\n"
    if cp:
        body += "    _scatter_for_context_parallel(tokens, position_ids, packed_seq_params, None)\n"
    return _function("get_logprobs", record["functions"]["get_logprobs"]["params"], body + "    raise AssertionError\n")


@dataclasses.dataclass
class PackedSeqParams:  # the fields every ref's get_logprobs sets (0.16.1's wheel lacks the last two)
    qkv_format: str = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_kv: torch.Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    total_tokens: int = None
    pad_between_seqs: bool = None


def _add_inference_args(parser):  # megatron.inference.utils.add_inference_args: train_rl's provider
    parser.add_argument("--inference-max-requests", type=int, default=8)
    return parser


class _Ref:
    """sys.modules stand-ins of one recorded ref: rl_utils, training, arguments and train_rl."""

    def __init__(self, monkeypatch, record, **get_logprobs_change):
        self.record, self.args, self.result = record, None, None
        rl = types.ModuleType(api.RL_UTILS)
        rl.__file__ = "/fake/megatron/rl/rl_utils.py"
        for name in record["rl_utils_helpers"] + record["train_rl_imports_from_rl_utils"]:
            setattr(rl, name, lambda *a, **k: None)
        rl.calculate_grpo_loss = _function("calculate_grpo_loss", record["functions"]["calculate_grpo_loss"]["params"])
        rl.get_logprobs = _megatron_get_logprobs(record, **get_logprobs_change)
        rl.PackedSeqParams, rl.get_args = PackedSeqParams, lambda: self.args
        rl.get_attr_wrapped_model = lambda model, attr: getattr(model, attr)
        rl.is_pp_last_stage = lambda pp: True
        arguments = types.ModuleType(api.ARGUMENTS)
        arguments.parse_args = _function("parse_args", record["parse_args"]["params"], (
            "    parser = argparse.ArgumentParser(allow_abbrev=False)\n"
            "    parser.add_argument('--grpo-kl-beta', type=float, default=0.0)\n"
            "    if extra_args_provider is not None:\n"
            "        parser = extra_args_provider(parser)\n"
            "    return parser.parse_known_args()[0] if ignore_unknown_args else parser.parse_args()\n"),
            {"argparse": argparse})
        training = types.ModuleType(api.TRAINING)
        training.get_args = lambda: self.args
        training.pretrain = _function("pretrain", record["pretrain"]["params"],
                                      "    return run(forward_step_func, locals())\n", {"run": self._pretrain})
        train_rl = types.ModuleType("train_rl")  # what its `from ... import` left behind
        train_rl.calculate_grpo_loss, train_rl.get_logprobs = rl.calculate_grpo_loss, rl.get_logprobs
        for name, mod in {"megatron.rl": types.ModuleType("megatron.rl"), api.RL_UTILS: rl, api.TRAINING: training,
                          api.ARGUMENTS: arguments, "train_rl": train_rl}.items():
            monkeypatch.setitem(sys.modules, name, mod)
        self.rl, self.training, self.arguments, self.train_rl = rl, training, arguments, train_rl

    def _pretrain(self, forward_step_func, bound):
        """0.16/0.17 parse inside pretrain (with its extra_args_provider); 0.18+ parsed before."""
        if "extra_args_provider" in bound:
            self.args = self.arguments.parse_args(bound["extra_args_provider"])
        output, loss_fn = forward_step_func(None, None)
        self.result = loss_fn(output)

    def run_train_rl(self):
        """train_rl.py's __main__ block of this ref, with a one-token loss of -1."""
        step = lambda data, model: (torch.tensor([-1.0]), lambda out: (out.sum(), 1, {"lm loss": torch.tensor([-1.0, 1.0])}))  # noqa: E731
        # positionally, in this ref's order (0.19 and main: model_provider after forward_step_func)
        values = {"cfg_container": object(), "train_valid_test_dataset_provider": None, "model_provider": "provider",
                  "model_type": "encoder_or_decoder", "forward_step_func": step}
        positional = [values[p] for p, _ in self.record["pretrain"]["params"] if p in values]
        if api.flags_via_pretrain(self.record):
            self.training.pretrain(*positional, extra_args_provider=_add_inference_args)
        else:  # 0.18+: parse_and_validate_args(extra_args_provider=add_inference_args), then pretrain
            self.args = self.arguments.parse_args(extra_args_provider=_add_inference_args)
            self.training.pretrain(*positional)


@pytest.fixture(autouse=True)
def _clean():
    yield
    mlm.uninstall()


@pytest.mark.parametrize("record", api.RECORDS, ids=api.ref_name)
def test_install_matches_each_recorded_ref_and_the_cispo_flags_reach_its_train_rl(monkeypatch, record):
    ref = _Ref(monkeypatch, record)
    monkeypatch.setattr(sys, "argv", ["train_rl.py", "--cispo-anchor", "rollout", "--inference-max-requests", "4"])
    assert mlm.install() is record and mlm.installed() is record
    assert ref.train_rl.get_logprobs is mlm.get_logprobs and ref.rl.calculate_grpo_loss is mlm.calculate_grpo_loss
    ref.run_train_rl()
    assert ref.args.cispo_anchor == "rollout" and ref.args.inference_max_requests == 4  # ours and theirs
    assert mlm.loss_config().cispo.anchor == "rollout"
    assert ref.result[2]["neg lm loss"].tolist() == [1.0, 1.0]  # the signed report, on every ref


def test_recorded_refs_differ_in_what_the_dropin_adapts_to():
    by_ref = {r["megatron_lm_tag"]: (r["get_logprobs_features"], api.flags_via_pretrain(r)) for r in api.RECORDS}
    none, thd = {"unpacked_thd": None, "context_parallel": False}, {"unpacked_thd": ["total_tokens"], "context_parallel": False}
    assert by_ref == {"core_v0.16.1": (none, True), "core_v0.17.1": (thd, True), "core_v0.18.2": (thd, False),
                      "core_v0.19.0": (thd, False),
                      "main": ({"unpacked_thd": ["pad_between_seqs"], "context_parallel": True}, False)}
    for record in api.RECORDS:  # every keyword a ref's unpacked PackedSeqParams gets has a value here
        assert set(record["get_logprobs_features"]["unpacked_thd"] or []) <= set(vocab_logprobs.THD_EXTRA)
        assert "perform_rl_step" in record["args"] and all("kv_cache" not in a for a in record["args"])


class _GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(flash_decode=False)
        self.pg_collection, self.seen = types.SimpleNamespace(pp=None, tp=None, cp=None), []
        self.logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))

    def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None, runtime_gather_output=None):
        self.seen.append(packed_seq_params)
        return self.logits


@pytest.mark.parametrize("record", api.RECORDS, ids=api.ref_name)
def test_unpacked_get_logprobs_hands_the_model_each_refs_packed_seq_params(monkeypatch, record):
    ref = _Ref(monkeypatch, record)
    ref.args = argparse.Namespace(fp16=False, bf16=False)
    mlm.install(patch_pretrain=False)
    model, tokens = _GPT(), torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(1))
    lp = mlm.get_logprobs(model, tokens, torch.arange(5).expand(2, 5))
    torch.testing.assert_close(lp, torch.log_softmax(model.logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0])
    seen, = model.seen
    extra = record["get_logprobs_features"]["unpacked_thd"]
    if extra is None:
        assert seen is None  # 0.16
    else:
        cu = [0, 5]
        expected = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5,
                                   **{"total_tokens": 5} if "total_tokens" in extra else {},
                                   **{"pad_between_seqs": False} if "pad_between_seqs" in extra else {})
        got = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in dataclasses.asdict(seen).items()}
        assert got == dataclasses.asdict(expected)
        assert seen.cu_seqlens_q.dtype == torch.int32


@pytest.mark.parametrize("change,function,found", [
    ({"pretrain": "new"}, "megatron.training.pretrain", "parameter 0: expected cfg_container, found new_config"),
    ({"thd": ["total_tokens", "seq_idx"]}, "megatron.rl.rl_utils.get_logprobs", "works differently"),
    ({"cp": True, "thd": ["total_tokens"]}, "megatron.rl.rl_utils.get_logprobs", "'context_parallel': True"),
])
def test_an_api_no_recorded_ref_has_is_refused_in_one_line_naming_the_function_and_the_refs(monkeypatch, change,
                                                                                             function, found):
    newest = api.RECORDS[-1]
    ref = _Ref(monkeypatch, newest, **{k: v for k, v in change.items() if k != "pretrain"})
    if "pretrain" in change:
        ref.training.pretrain = _function("pretrain", [["new_config", None], *newest["pretrain"]["params"][1:]])
    before = ref.rl.get_logprobs
    with pytest.raises(mlm.MegatronLMVersionError) as e:
        mlm.install()
    msg = str(e.value)
    assert "\n" not in msg and function in msg and found in msg, msg
    assert "core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0, main@d98e8a64dd" in msg
    assert ref.rl.get_logprobs is before and not mlm.installed()  # nothing patched


def test_the_launcher_says_an_unknown_api_in_one_line_and_exits_2(monkeypatch, tmp_path, capsys):
    from test_megatron_lm_patch import launch_refused

    _Ref(monkeypatch, api.RECORDS[-1], thd=["seq_idx"])
    err = launch_refused(monkeypatch, tmp_path, capsys)
    assert len(err.splitlines()) == 1 and "get_logprobs" in err and "main@d98e8a64dd" in err


def test_vocab_logprobs_refuses_a_packed_seq_params_keyword_it_has_no_value_for():
    rl = types.SimpleNamespace(PackedSeqParams=PackedSeqParams)
    with pytest.raises(mlm.MegatronLMVersionError, match="get_logprobs builds PackedSeqParams with seq_idx"):
        vocab_logprobs.single_sequence_params(rl, torch.zeros(1, 3, dtype=torch.long), ["seq_idx"])


def test_get_logprobs_splits_context_parallelism_where_megatrons_does_and_gathers_the_full_sequence():
    """main (#5882): each CP rank runs its half of the tokens; the all-gathered logprobs equal the
    full sequence's, and the ranks' gradients sum to the full sequence's summed over their losses."""
    from megatron_cispo.testing import spawn

    from megatron_lm_checkouts import standin_cp2_worker

    for lp_err, grad_err, seen, rank in spawn(standin_cp2_worker, 2, timeout_s=300):
        assert lp_err < 1e-6 and grad_err < 1e-5, (rank, lp_err, grad_err)
        assert seen == [4, 8], rank  # the drop-in's call ran half the tokens; the reference all 8
