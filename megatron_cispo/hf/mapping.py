"""Weight names and layouts between megatron-core's GPTModel (local spec) and Hugging Face.

    hf = to_hf(gather_full_state(chunks), arch)          # full megatron tensors -> HF tensors (export)
    full = from_hf(hf_tensors, arch)                     # the inverse (tests, tools)
    for piece in pieces(name, arch, rank=r, size=tp, dim=0): ...   # what one TP rank reads (load.py)

A megatron tensor is a concatenation along dim 0 of `Piece`s, row blocks of HF tensors (or zero
rows: vocabulary padding). The fused QKV interleaves per query group [q heads of group g, k_g, v_g];
the gated fc1 is [gate; up] in full and [gate_r; up_r] on TP rank r; row-parallel weights
(linear_proj, fc2) are split along dim 1. Global names carry the global layer and expert index
(base/param_names.global_param_name).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..base.param_names import tp_split_dim
from .arch import HFArch

ZEROS = ""  # Piece.name of padding rows (vocabulary padding), which HF does not store

# per-layer names: megatron suffix -> HF suffix, for tensors that map one to one
_PLAIN = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of HF tensor `name` (ZEROS: that many zero rows), columns `cols` (None = all)."""

    name: str
    start: int
    stop: int
    cols: Optional[slice] = None

    @property
    def rows(self) -> int:
        return self.stop - self.start


def _layer_names(arch: HFArch, i: int) -> dict[str, str]:
    """megatron global name -> HF name for layer i's one-to-one tensors."""
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    keep = [k for k in _PLAIN if ("layernorm" not in k.split(".")[1] or arch.qk_norm)]
    if arch.num_experts is None:
        keep = [k for k in keep if k != "mlp.router.weight"]
    else:
        keep = [k for k in keep if k != "mlp.linear_fc2.weight"]
    out = {m + k: h + _PLAIN[k] for k in keep}
    for e in range(arch.num_experts or 0):
        out[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = f"{h}mlp.experts.{e}.down_proj.weight"
    return out


def megatron_names(arch: HFArch) -> list[str]:
    """Every megatron global parameter name of the model (the output layer only when untied)."""
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    if not arch.tie_embeddings:
        names.append("output_layer.weight")
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        names += list(_layer_names(arch, i))
        names.append(p + "self_attention.linear_qkv.weight")
        if arch.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if arch.num_experts is None:
            names.append(p + "mlp.linear_fc1.weight")
        else:
            names += [f"{p}mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(arch.num_experts)]
    return names


def hf_shapes(arch: HFArch) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the model needs, with its shape (what config.json implies)."""
    h, hd, nh, ng = arch.hidden_size, arch.head_dim, arch.num_attention_heads, arch.num_query_groups
    f = arch.ffn_hidden_size
    out = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tie_embeddings:
        out["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.k_proj.weight": (ng * hd, h),
                    p + "self_attn.v_proj.weight": (ng * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd)})
        if arch.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (nh * hd,), p + "self_attn.k_proj.bias": (ng * hd,),
                        p + "self_attn.v_proj.bias": (ng * hd,)})
        if arch.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        experts = [f"{p}mlp."] if arch.num_experts is None else \
            [f"{p}mlp.experts.{e}." for e in range(arch.num_experts)]
        for q in experts:
            out.update({q + "gate_proj.weight": (f, h), q + "up_proj.weight": (f, h), q + "down_proj.weight": (h, f)})
        if arch.num_experts is not None:
            out[p + "mlp.gate.weight"] = (arch.num_experts, h)
    return out


def _blocks(name: str, arch: HFArch) -> tuple[list[Piece], str]:
    """The full megatron tensor `name` as row blocks of HF tensors, and how TP splits it:
    "rows" (contiguous dim-0 range), "groups" (QKV: whole query groups), "glu" ([gate_r; up_r]),
    "cols" (dim 1) or "none"."""
    v, vp = arch.vocab_size, arch.padded_vocab_size
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        hf = "model.embed_tokens.weight" if name.startswith("embedding") or arch.tie_embeddings else "lm_head.weight"
        return [Piece(hf, 0, v)] + ([Piece(ZEROS, 0, vp - v)] if vp > v else []), "rows"
    if name == "decoder.final_layernorm.weight":
        return [Piece("model.norm.weight", 0, arch.hidden_size)], "none"
    i = name.split(".")[2]
    p = f"model.layers.{i}."
    plain = _layer_names(arch, int(i))
    if name in plain:
        rows = hf_shapes(arch)[plain[name]][0]
        return [Piece(plain[name], 0, rows)], "cols" if tp_split_dim(name) == 1 else "none"
    if ".linear_qkv." in name:
        kind = name.rsplit(".", 1)[1]
        hd, per = arch.head_dim, arch.num_attention_heads // arch.num_query_groups
        out = []
        for g in range(arch.num_query_groups):
            out += [Piece(f"{p}self_attn.q_proj.{kind}", g * per * hd, (g + 1) * per * hd),
                    Piece(f"{p}self_attn.k_proj.{kind}", g * hd, (g + 1) * hd),
                    Piece(f"{p}self_attn.v_proj.{kind}", g * hd, (g + 1) * hd)]
        return out, "groups"
    if name.endswith("linear_fc1.weight"):
        e = name.split(".")[-3] if ".local_experts." in name else None
        q = f"{p}mlp." if e is None else f"{p}mlp.experts.{e}."
        f = arch.ffn_hidden_size
        return [Piece(q + "gate_proj.weight", 0, f), Piece(q + "up_proj.weight", 0, f)], "glu"
    raise KeyError(f"{name} is not a parameter of a {arch.family} model")


def pieces(name: str, arch: HFArch, *, rank: int = 0, size: int = 1) -> list[Piece]:
    """What TP rank `rank` of `size` holds of megatron tensor `name`, as HF row blocks (dim 0)."""
    blocks, split = _blocks(name, arch)
    if size == 1 or split == "none":
        return blocks
    if split == "cols":
        (b,) = blocks
        w = hf_shapes(arch)[b.name][1] // size
        return [Piece(b.name, b.start, b.stop, slice(rank * w, (rank + 1) * w))]
    if split == "groups":
        per_rank = 3 * arch.num_query_groups // size  # three blocks per query group
        return blocks[rank * per_rank:(rank + 1) * per_rank]
    if split == "glu":
        out = []
        for b in blocks:
            w = b.rows // size
            out.append(Piece(b.name, b.start + rank * w, b.start + (rank + 1) * w))
        return out
    total = sum(b.rows for b in blocks)  # "rows": a contiguous range of the concatenation
    lo, hi = rank * total // size, (rank + 1) * total // size
    out, at = [], 0
    for b in blocks:
        s, e = max(lo, at), min(hi, at + b.rows)
        if s < e:
            out.append(Piece(b.name, b.start + s - at, b.start + e - at))
        at += b.rows
    return out


def assemble(parts: list[Piece], read, like: Tensor | None = None) -> Tensor:
    """Concatenate `parts` along dim 0; read(piece) returns that piece's tensor (ZEROS pieces are zeros
    shaped like the others' rows)."""
    tensors = [read(p) if p.name != ZEROS else None for p in parts]
    ref = next(t for t in tensors if t is not None)
    rows = [t if t is not None else ref.new_zeros((p.rows, *ref.shape[1:])) for p, t in zip(parts, tensors)]
    return torch.cat(rows, 0)


def from_hf(hf: dict[str, Tensor], arch: HFArch) -> dict[str, Tensor]:
    """HF tensors -> full megatron tensors under their global names."""
    def read(p: Piece) -> Tensor:
        t = hf[p.name][p.start:p.stop]
        return t if p.cols is None else t[:, p.cols]
    return {n: assemble(pieces(n, arch), read) for n in megatron_names(arch)}


def to_hf(full: dict[str, Tensor], arch: HFArch) -> dict[str, Tensor]:
    """Full megatron tensors (gather_full_state, canonical names) -> HF tensors, vocabulary padding dropped.
    KeyError naming the first megatron tensor that is missing."""
    shapes = hf_shapes(arch)
    out: dict[str, Tensor] = {}
    for n in megatron_names(arch):
        if n not in full:
            raise KeyError(f"the model state lacks {n} (a {arch.family} model from {arch.path})")
        t, at = full[n], 0
        for p in pieces(n, arch):
            if p.name != ZEROS:
                dst = out.setdefault(p.name, t.new_empty(shapes[p.name]))
                dst[p.start:p.stop] = t[at:at + p.rows]
            at += p.rows
    return out
