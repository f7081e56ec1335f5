"""rollout.vllm: options for vLLM's engine. The keys megatron_cispo sets are refused naming where their
value comes from, several engine processes are refused, an unknown key names the nearest accepted one,
and what is left reaches vllm.LLM as given (enforce_eager included), beside megatron_cispo's own keys.
No vLLM needed: the accepted keys are handed in, and vllm.LLM is a stand-in that records its keywords."""
import sys
import types

import pytest

from megatron_cispo.rollout import vllm_options, vllm_worker
from megatron_cispo.rollout.vllm_options import OWNED, check_options, engine_len

ACCEPTED = {"gpu_memory_utilization", "max_model_len", "enforce_eager", "max_num_seqs", "tensor_parallel_size",
            *OWNED}


@pytest.mark.parametrize("key", sorted(OWNED))
def test_each_key_megatron_cispo_sets_is_refused_naming_where_its_value_comes_from(key):
    with pytest.raises(ValueError) as e:
        check_options({key: "x"}, accepted=ACCEPTED)
    assert str(e.value) == f"rollout.vllm.{key} is set by megatron_cispo ({OWNED[key]}); remove it"


def test_one_engine_process_only():
    check_options({"tensor_parallel_size": 1}, accepted=ACCEPTED)
    with pytest.raises(ValueError, match=r"rollout.vllm.pipeline_parallel_size=2: the engine is one process"):
        check_options({"pipeline_parallel_size": 2}, accepted=ACCEPTED)


def test_an_unknown_key_names_the_nearest_accepted_one():
    with pytest.raises(ValueError) as e:
        check_options({"gpu_memory_util": 0.3}, accepted=ACCEPTED)
    assert str(e.value).startswith("rollout.vllm.gpu_memory_util: vLLM's engine has no such option; did you mean "
                                   "gpu_memory_utilization? it accepts the")
    with pytest.raises(ValueError, match="no such option; it accepts the"):  # nothing near: no guess
        check_options({"zzz": 1}, accepted=ACCEPTED)


def test_without_vllm_only_the_rules_of_megatron_cispo_are_checked(monkeypatch):
    monkeypatch.setattr(vllm_options, "engine_args", lambda: None)
    check_options({"anything_at_all": 1})  # the engine's start then says vLLM is missing
    with pytest.raises(ValueError, match="rollout.vllm.seed is set by megatron_cispo"):
        check_options({"seed": 1})


@pytest.mark.parametrize("value", [0, "64", True, 1.5])
def test_max_model_len_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match=f"rollout.vllm.max_model_len must be an integer >= 1, got {value!r}"):
        check_options({"max_model_len": value}, accepted=ACCEPTED)


def test_the_engine_length_is_max_model_len_else_the_sequence_length():
    assert engine_len({}, 128) == 128 and engine_len({"max_model_len": 64}, 128) == 64


def test_the_options_reach_vllm_llm_beside_megatron_cispos_own_keys(monkeypatch, tmp_path):
    seen = {}
    fake = types.ModuleType("vllm")
    fake.LLM = lambda **kw: seen.update(kw) or "llm"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(vllm_worker, "_check_cpu_head_dim", lambda model_dir: None)
    cfg = {"model_dir": str(tmp_path), "dtype": "bfloat16", "max_model_len": 64, "seed": 3, "stream": False,
           "engine_kwargs": {"enforce_eager": False, "gpu_memory_utilization": 0.35}}
    assert vllm_worker._build(cfg) == "llm"
    assert seen == {"model": str(tmp_path), "skip_tokenizer_init": True, "enforce_eager": False, "dtype": "bfloat16",
                    "distributed_executor_backend": "uni", "logprobs_mode": "processed_logprobs", "max_logprobs": -1,
                    "max_model_len": 64, "seed": 3, "gpu_memory_utilization": 0.35}
