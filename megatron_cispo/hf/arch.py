"""A Hugging Face model directory's architecture, as megatron-core's GPTModel expresses it.

    arch = read_arch("models/Qwen3-8B")          # config.json read by transformers; ValueError if unsupported
    arch.transformer_kwargs() / arch.gpt_kwargs()  # what runner/model.py adds to TransformerConfig / GPTModel

Families: llama (and mistral without sliding windows), qwen2, qwen3 (qk-norm) and qwen3_moe (every
layer sparse, no shared expert). Anything megatron-core cannot express is refused in one line that
names the config key and the supported values; nothing is silently approximated.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
ROPE_TYPES = ("default", "linear", "llama3")
VOCAB_PAD = 128  # the embedding is padded to a multiple of this (any tp dividing it), the same on every layout
# megatron-core's llama3 RoPE scaling hard-codes these (rope_utils.apply_rope_scaling defaults)
_MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def check_divisible(sizes: dict[str, int], *, by: int, name: str) -> None:
    """ValueError naming the first of `sizes` (label -> size) that `name`=`by` does not split: the layout
    rule, said once for config.json's widths (HFArch.check_layout) and the synthetic GPT's keys
    (runner.model.ModelConfig.check_layout)."""
    if by < 1:
        raise ValueError(f"{name} must be >= 1, got {by}")
    for label, n in sizes.items():
        if n % by:
            raise ValueError(f"{label}={n} is not divisible by {name}={by}")


@dataclass(frozen=True, kw_only=True)
class HFArch:
    """What runner/model.py needs to build the model and hf/mapping.py to convert its weights."""

    path: str                   # the model directory
    family: str                 # config.json model_type
    vocab_size: int             # real vocabulary (logprob ops take it); the embedding has padded_vocab_size rows
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int       # num_key_value_heads
    head_dim: int               # kv_channels (Qwen3: not hidden/heads)
    ffn_hidden_size: int        # dense MLP width, or each expert's width (qwen3_moe)
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str              # one of ROPE_TYPES
    rope_factor: float          # 1.0 for "default"
    tie_embeddings: bool
    qkv_bias: bool              # qwen2
    qk_norm: bool               # qwen3, qwen3_moe
    num_experts: Optional[int] = None
    moe_topk: int = 1
    norm_topk_prob: bool = False
    dtype: str = "float32"      # the checkpoint's dtype (config.json dtype / torch_dtype)

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_PAD) * VOCAB_PAD

    def check_layout(self, *, tp: int, ep: int = 1) -> None:
        """ValueError when tp or ep cannot split this model."""
        at = f"{self.path}/config.json: "
        ffn = "intermediate_size" if self.num_experts is None else "moe_intermediate_size"
        check_divisible({f"{at}num_attention_heads": self.num_attention_heads,
                         f"{at}num_key_value_heads": self.num_query_groups, f"{at}{ffn}": self.ffn_hidden_size,
                         f"the padded vocabulary (vocab_size={self.vocab_size} rounded up to a multiple of "
                         f"{VOCAB_PAD})": self.padded_vocab_size}, by=tp, name="tp")
        if self.num_experts is not None:
            check_divisible({f"{at}num_experts": self.num_experts}, by=ep, name="ep")

    def transformer_kwargs(self) -> dict:
        """TransformerConfig arguments that define the architecture (parallelism and dtype are the caller's)."""
        import torch.nn.functional as F

        return dict(
            num_layers=self.num_layers, hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups, kv_channels=self.head_dim, ffn_hidden_size=self.ffn_hidden_size,
            normalization="RMSNorm", layernorm_epsilon=self.rms_norm_eps, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, add_qkv_bias=self.qkv_bias, qk_layernorm=self.qk_norm)

    def gpt_kwargs(self) -> dict:
        """GPTModel arguments: RoPE, its scaling, tied output layer, padded vocabulary."""
        kw = dict(vocab_size=self.padded_vocab_size, max_sequence_length=self.max_position_embeddings,
                  position_embedding_type="rope", rotary_percent=1.0, rotary_base=int(self.rope_theta)
                  if float(self.rope_theta).is_integer() else self.rope_theta,
                  share_embeddings_and_output_weights=self.tie_embeddings)
        if self.rope_type == "linear":
            kw["seq_len_interpolation_factor"] = self.rope_factor
        elif self.rope_type == "llama3":
            kw.update(rope_scaling=True, rope_scaling_factor=self.rope_factor)
        return kw


def _refuse(path, key: str, value, supported: str) -> ValueError:
    return ValueError(f"{path}/config.json: {key}={value!r} is not supported; {supported}")


def _rope(cfg, path) -> tuple[float, str, float]:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise ValueError(f"{path}/config.json: no rope_theta (nor rope_parameters.rope_theta)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise _refuse(path, "rope_parameters.rope_type", kind, f"megatron-core expresses {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if partial is not None and float(partial) != 1.0:  # megatron could (rotary_percent); these HF families cannot
        raise _refuse(path, "rope_parameters.partial_rotary_factor", partial,
                      "these families rotate the whole head (1.0)")
    factor = float(params.get("factor", 1.0))
    if kind == "llama3":
        for k, want in _MEGATRON_LLAMA3.items():
            if float(params.get(k, want)) != want:
                raise _refuse(path, f"rope_parameters.{k}", params.get(k),
                              f"megatron-core's llama3 scaling fixes it at {want}")
    return float(theta), kind, factor


def _sliding_window(cfg, path) -> None:
    types = getattr(cfg, "layer_types", None)
    if types and any(t != "full_attention" for t in types):
        raise _refuse(path, "layer_types", sorted(set(types)), "only full_attention layers")
    key, off = ("sliding_window", "null") if cfg.model_type == "mistral" else ("use_sliding_window", "false")
    if getattr(cfg, key, None):
        raise _refuse(path, key, getattr(cfg, key), f"sliding-window attention is not expressed; set it {off} "
                      "only if the model was trained without it")


def _dtype(cfg) -> str:
    d = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "float32"
    return str(d).removeprefix("torch.")


@functools.lru_cache(maxsize=16)
def _read(path: str, stamp: float) -> HFArch:
    import transformers

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ValueError(f"model.hf_path={path!r} has no config.json: expected a Hugging Face model directory")
    try:
        json.loads((directory / "config.json").read_text())
        cfg = transformers.AutoConfig.from_pretrained(path)
    except (ValueError, OSError, KeyError) as e:  # unknown model_type, bad JSON
        raise ValueError(f"{path}/config.json cannot be read: {str(e).splitlines()[0]}") from None
    family = cfg.model_type
    if family not in FAMILIES:
        raise _refuse(path, "model_type", family, f"supported: {', '.join(FAMILIES)}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise _refuse(path, "hidden_act", cfg.hidden_act, "these families use silu (SwiGLU)")
    _sliding_window(cfg, path)
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    if family != "qwen2" and attention_bias:
        raise _refuse(path, "attention_bias", True, "megatron-core has biases on q/k/v only (add_qkv_bias), "
                      "not on o_proj")
    if getattr(cfg, "mlp_bias", False):
        raise _refuse(path, "mlp_bias", True, "only MLPs without biases")
    theta, rope_type, factor = _rope(cfg, path)
    heads = cfg.num_attention_heads
    groups = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % groups:
        raise ValueError(f"{path}/config.json: num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={groups}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    moe = {}
    ffn = cfg.intermediate_size
    if family == "qwen3_moe":
        if getattr(cfg, "mlp_only_layers", None) or getattr(cfg, "decoder_sparse_step", 1) != 1:
            raise _refuse(path, "mlp_only_layers/decoder_sparse_step",
                          (cfg.mlp_only_layers, cfg.decoder_sparse_step), "every layer sparse ([] and 1)")
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
        moe = dict(num_experts=experts, moe_topk=cfg.num_experts_per_tok, norm_topk_prob=bool(cfg.norm_topk_prob))
        ffn = cfg.moe_intermediate_size
        if moe["moe_topk"] == 1 and moe["norm_topk_prob"]:  # a weight of 1; megatron's top-1 router is pre-softmax
            raise _refuse(path, "norm_topk_prob", True, "with num_experts_per_tok=1 only false (megatron-core's "
                          "top-1 router weighs by the softmax over all experts)")
    return HFArch(path=path, family=family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  num_layers=cfg.num_hidden_layers, num_attention_heads=heads, num_query_groups=groups,
                  head_dim=head_dim, ffn_hidden_size=ffn, max_position_embeddings=cfg.max_position_embeddings,
                  rms_norm_eps=float(cfg.rms_norm_eps), rope_theta=theta, rope_type=rope_type, rope_factor=factor,
                  tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
                  qkv_bias=family == "qwen2", qk_norm=family in ("qwen3", "qwen3_moe"), dtype=_dtype(cfg), **moe)


def read_arch(path: str) -> HFArch:
    """The architecture of the model directory `path`; ValueError (one line) if it is not one we can build."""
    config = Path(path) / "config.json"
    return _read(str(path), config.stat().st_mtime if config.is_file() else 0.0)
