"""hf/arch.py: what it reads from a config.json, and every refusal with its one-line message.

Each case writes a tiny family's config.json (tools/make_tiny_hf.tiny_config, no weights) into a
tmp dir, edits one key as a real checkpoint might carry it, and reads it back with read_arch.
"""
import json
from pathlib import Path

import pytest

from megatron_cispo.hf.arch import read_arch
from megatron_cispo.tools.make_tiny_hf import tiny_config

ROOT = Path(__file__).resolve().parents[2]
DROP = object()  # an edit that removes the key


def config_dir(tmp_path, family: str, sizes: dict | None = None, **edits) -> str:
    """A model directory holding only the config.json of a tiny `family` model with `edits` applied."""
    d = tmp_path / f"{family}_{len(list(tmp_path.iterdir()))}"
    tiny_config(family, **(sizes or {})).save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    for key, value in edits.items():
        cfg.pop(key, None) if value is DROP else cfg.__setitem__(key, value)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def refusal(path: str) -> str:
    with pytest.raises(ValueError) as e:
        read_arch(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(path), message  # one line, naming the directory
    return message.removeprefix(path)


# ----------------------------------------------------------------- what is read

def test_the_published_qwen3_configs_read_as_their_model_cards_say():
    dense = read_arch(str(ROOT / "yaml_configs/models/qwen3_8b"))
    assert (dense.family, dense.num_layers, dense.hidden_size, dense.num_attention_heads, dense.num_query_groups,
            dense.head_dim, dense.ffn_hidden_size, dense.vocab_size, dense.padded_vocab_size) == \
        ("qwen3", 36, 4096, 32, 8, 128, 12288, 151936, 151936)  # 1187 x 128: no padding
    assert (dense.rope_theta, dense.rope_type, dense.tie_embeddings, dense.qk_norm, dense.qkv_bias, dense.dtype) == \
        (1e6, "default", False, True, False, "bfloat16")
    moe = read_arch(str(ROOT / "yaml_configs/models/qwen3_30b_a3b"))
    assert (moe.family, moe.num_layers, moe.hidden_size, moe.num_query_groups, moe.num_experts, moe.moe_topk,
            moe.norm_topk_prob, moe.ffn_hidden_size) == ("qwen3_moe", 48, 2048, 4, 128, 8, True, 768)


def test_rope_scalings_megatron_expresses_are_read_with_their_factor(tmp_path):
    linear = read_arch(config_dir(tmp_path, "llama", rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                                      "rope_theta": 1e4}))
    assert (linear.rope_type, linear.rope_factor, linear.gpt_kwargs()["seq_len_interpolation_factor"]) == \
        ("linear", 4.0, 4.0)
    legacy = read_arch(config_dir(tmp_path, "llama", rope_parameters=DROP, rope_theta=1e4,
                                  rope_scaling={"type": "linear", "factor": 2.0}))  # transformers 4's spelling
    assert (legacy.rope_type, legacy.rope_factor, legacy.rope_theta) == ("linear", 2.0, 1e4)
    llama3 = read_arch(config_dir(tmp_path, "llama", max_position_embeddings=16384, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert llama3.gpt_kwargs()["rope_scaling_factor"] == 8.0 and llama3.gpt_kwargs()["rope_scaling"] is True


# ----------------------------------------------------------------- refusals: the directory and the family

def test_a_directory_without_config_json_is_refused(tmp_path):
    with pytest.raises(ValueError) as e:
        read_arch(str(tmp_path))
    assert str(e.value) == (f"model.hf_path={str(tmp_path)!r} has no config.json: expected a Hugging Face "
                            "model directory")


def test_an_unreadable_config_json_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert refusal(str(tmp_path)).startswith("/config.json cannot be read: ")


def test_a_model_type_transformers_does_not_know_is_refused_in_one_line(tmp_path):
    message = refusal(config_dir(tmp_path, "llama", model_type="no_such_family"))
    assert message.startswith("/config.json cannot be read: ") and "no_such_family" in message


def test_another_family_is_refused_naming_the_supported_ones(tmp_path):
    assert refusal(config_dir(tmp_path, "llama", model_type="gemma")) == (
        "/config.json: model_type='gemma' is not supported; supported: llama, mistral, qwen2, qwen3, qwen3_moe")


# ----------------------------------------------------------------- refusals: features megatron-core lacks

@pytest.mark.parametrize("family,edits,expected", [
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu' is not supported; these families use silu (SwiGLU)"),
    ("llama", dict(attention_bias=True), "attention_bias=True is not supported; megatron-core has biases on q/k/v "
                                         "only (add_qkv_bias), not on o_proj"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True is not supported; megatron-core has biases on q/k/v "
                                         "only (add_qkv_bias), not on o_proj"),
    ("llama", dict(mlp_bias=True), "mlp_bias=True is not supported; only MLPs without biases"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=64),
     "use_sliding_window=True is not supported; sliding-window attention is not expressed; set it false only "
     "if the model was trained without it"),
    ("mistral", dict(sliding_window=4096),
     "sliding_window=4096 is not supported; sliding-window attention is not expressed; set it null only if "
     "the model was trained without it"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=64, layer_types=["full_attention", "sliding_attention"]),
     "layer_types=['full_attention', 'sliding_attention'] is not supported; only full_attention layers"),
    ("qwen3", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                    "original_max_position_embeddings": 32}),
     "rope_parameters.rope_type='yarn' is not supported; megatron-core expresses default, linear, llama3"),
    ("llama", dict(rope_parameters=DROP, rope_theta=1e4, rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope_parameters.rope_type='dynamic' is not supported; megatron-core expresses default, linear, llama3"),
    ("llama", dict(max_position_embeddings=16384, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
     "rope_parameters.low_freq_factor=2.0 is not supported; megatron-core's llama3 scaling fixes it at 1.0"),
    ("llama", dict(max_position_embeddings=65536, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32768}),
     "rope_parameters.original_max_position_embeddings=32768 is not supported; megatron-core's llama3 scaling "
     "fixes it at 8192"),
    ("qwen3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
     "rope_parameters.partial_rotary_factor=0.5 is not supported; these families rotate the whole head (1.0)"),
    ("qwen2", dict(num_key_value_heads=3), "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ("qwen3_moe", dict(mlp_only_layers=[0]), "mlp_only_layers/decoder_sparse_step=([0], 1) is not supported; "
                                             "every layer sparse ([] and 1)"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "mlp_only_layers/decoder_sparse_step=([], 2) is not supported; "
                                               "every layer sparse ([] and 1)"),
    ("qwen3_moe", dict(num_experts_per_tok=1), "norm_topk_prob=True is not supported; with num_experts_per_tok=1 "
                                               "only false (megatron-core's top-1 router weighs by the softmax over "
                                               "all experts)"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else None)
def test_a_feature_megatron_core_cannot_express_is_refused_naming_the_key(tmp_path, family, edits, expected):
    message = refusal(config_dir(tmp_path, family, **edits))
    assert message == f"/config.json: {expected}"


def test_top1_without_normalised_probabilities_is_accepted(tmp_path):
    arch = read_arch(config_dir(tmp_path, "qwen3_moe", num_experts_per_tok=1, norm_topk_prob=False))
    assert (arch.moe_topk, arch.norm_topk_prob) == (1, False)


# ----------------------------------------------------------------- refusals: the layout

@pytest.mark.parametrize("family,sizes,tp,ep,expected", [
    ("llama", {}, 3, 1, "{d}/config.json: num_attention_heads=4 is not divisible by tp=3"),
    ("llama", {}, 4, 1, "{d}/config.json: num_key_value_heads=2 is not divisible by tp=4"),
    ("llama", dict(heads=8, kv_heads=8, ffn=100), 8, 1, "{d}/config.json: intermediate_size=100 is not divisible by "
                                                        "tp=8"),
    ("qwen3_moe", {}, 2, 3, "{d}/config.json: num_experts=4 is not divisible by ep=3"),
    ("llama", dict(heads=6, kv_heads=3, hidden=60, vocab=200), 3, 1,
     "the padded vocabulary (vocab_size=200 rounded up to a multiple of 128)=256 is not divisible by tp=3"),
])
def test_a_layout_that_cannot_split_the_model_is_refused(tmp_path, family, sizes, tp, ep, expected):
    d = config_dir(tmp_path, family, sizes)
    with pytest.raises(ValueError) as e:
        read_arch(d).check_layout(tp=tp, ep=ep)
    assert str(e.value) == expected.format(d=d)


def test_the_moe_expert_width_is_named_when_tp_does_not_divide_it(tmp_path):
    d = config_dir(tmp_path, "qwen3_moe", dict(kv_heads=4), moe_intermediate_size=30)
    with pytest.raises(ValueError, match=r"moe_intermediate_size=30 is not divisible by tp=4"):
        read_arch(d).check_layout(tp=4, ep=1)
    read_arch(d).check_layout(tp=2, ep=4)  # and a layout that splits it passes
