"""rollout.engine=torch: a plain-PyTorch GPT that runs megatron-core GPTModel weights (the synthetic GPT).

    logits = TorchGPT(gather_full_state(chunks), model_cfg, dtype=torch.bfloat16).logits(tokens)
    eng = open_engine(EngineStart(model=model_cfg, precision="bf16", seed=0, max_model_len=16))
    eng.update_weights(buckets, manifest=..., bucket_bytes=n)   # megatron-named buckets (engine.py)

It reads the full (unsharded) state under megatron's global parameter names, from the local
or the Transformer Engine layer spec, and reproduces GPTModel's forward (learned positions,
pre-LayerNorm blocks, per-head interleaved QKV, GeLU MLP or top-k MoE, untied output layer).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..base.param_names import canonical_names
from .engine import EngineStart
from .inprocess import InProcessEngine

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class TorchGPT:
    """Forward-only GPT over a dict of full tensors; no autograd, no process groups.

    cfg: runner.model.ModelConfig. With `num_moe_experts` set, every layer's MLP is megatron's
    MoELayer (TopKRouter, softmax score, no shared expert) with `moe_router_topk` experts per token.
    """

    def __init__(self, state: dict[str, Tensor], cfg, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", eps: float = 1e-5):
        self.cfg, self.eps = cfg, eps
        self.num_experts = getattr(cfg, "num_moe_experts", None)
        self.topk = getattr(cfg, "moe_router_topk", 1)
        # runner.model builds top-1 routers with the softmax before the top-k (megatron refuses
        # top-1 without it) and top-k > 1 routers with the softmax over the k chosen logits.
        self.pre_softmax = self.topk == 1
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in canonical_names(state).items()}
        missing = [k for k in self._expected() if k not in self.w]
        if missing:
            raise KeyError(f"state lacks {len(missing)} GPTModel parameters, e.g. {missing[:3]}")

    def _expected(self) -> list[str]:
        names = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                 "decoder.final_layernorm.weight", "output_layer.weight"]
        if self.num_experts is None:
            mlp = ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
        else:
            mlp = ["mlp.router.weight"] + [f"mlp.experts.local_experts.{e}.linear_fc{j}.weight"
                                           for e in range(self.num_experts) for j in (1, 2)]
        for i in range(self.cfg.num_layers):
            names += [f"decoder.layers.{i}.{n}" for n in (
                "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                "pre_mlp_layernorm.weight", *mlp)]
        return names

    def _ln(self, x: Tensor, prefix: str) -> Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[prefix + ".weight"], self.w.get(prefix + ".bias"), self.eps)

    def _linear(self, x: Tensor, prefix: str) -> Tensor:
        return F.linear(x, self.w[prefix + ".weight"], self.w.get(prefix + ".bias"))

    def _attention(self, x: Tensor, p: str) -> Tensor:
        b, s, _ = x.shape
        nh = self.cfg.num_attention_heads
        hn = self.cfg.hidden_size // nh
        # megatron's QKV rows are grouped per query group: [q, k, v] blocks of hn rows per head.
        qkv = self._linear(x, p + ".linear_qkv").view(b, s, nh, 3 * hn)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(hn, dim=-1))  # [b, nh, s, hn]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hn)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        ctx = (probs @ v).transpose(1, 2).reshape(b, s, nh * hn)
        return self._linear(ctx, p + ".linear_proj")

    def _mlp(self, x: Tensor, p: str) -> Tensor:
        return self._linear(F.gelu(self._linear(x, p + ".linear_fc1")), p + ".linear_fc2")

    def _route(self, x: Tensor, p: str) -> tuple[Tensor, Tensor]:
        """x: [t, h] -> (probs [t, k] fp32, experts [t, k] int64), as TopKRouter in fp32."""
        logits = F.linear(x.float(), self.w[p + ".router.weight"].float(), None)  # moe_router_dtype=fp32
        if self.pre_softmax:
            return torch.topk(torch.softmax(logits, -1), self.topk, dim=-1)
        top, experts = torch.topk(logits, self.topk, dim=-1)
        return torch.softmax(top, -1), experts

    def _moe(self, x: Tensor, p: str, routes: Optional[list] = None) -> Tensor:
        """megatron's MoELayer with SequentialMLP experts: each token's output is the sum over its
        k experts of fc2(gelu(fc1(x)) * prob); the router prob scales the activation (and an fc2 bias)."""
        flat = x.reshape(-1, x.shape[-1])
        probs, experts = self._route(flat, p)
        if routes is not None:  # the experts each token went to, [b, s, k], for routing replay
            routes.append(experts.view(*x.shape[:2], -1))
        out = torch.zeros_like(flat)
        for e in range(self.num_experts):
            tok, slot = (experts == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            q = f"{p}.experts.local_experts.{e}"
            scale = probs[tok, slot].unsqueeze(-1)
            act = (F.gelu(self._linear(flat[tok], q + ".linear_fc1")) * scale).to(flat.dtype)
            y = F.linear(act, self.w[q + ".linear_fc2.weight"])
            bias = self.w.get(q + ".linear_fc2.bias")
            if bias is not None:
                y = (y + bias * scale).to(flat.dtype)
            out.index_add_(0, tok, y)
        return out.view_as(x)

    @torch.no_grad()
    def logits(self, tokens: Tensor, routes: Optional[list] = None) -> Tensor:
        """tokens: [b, s] int64 -> logits [b, s, vocab] in the model dtype. routes: a list that gets
        each MoE layer's experts [b, s, k] int64, in layer order."""
        s = tokens.shape[1]
        pos = torch.arange(s, device=tokens.device)
        h = self.w["embedding.word_embeddings.weight"][tokens] + self.w["embedding.position_embeddings.weight"][pos]
        for i in range(self.cfg.num_layers):
            p = f"decoder.layers.{i}"
            h = h + self._attention(self._ln(h, p + ".input_layernorm"), p + ".self_attention")
            normed = self._ln(h, p + ".pre_mlp_layernorm")
            h = h + (self._mlp(normed, p + ".mlp") if self.num_experts is None else self._moe(normed, p + ".mlp", routes))
        return F.linear(self._ln(h, "decoder.final_layernorm"), self.w["output_layer.weight"])


class TorchEngine(InProcessEngine):
    """The engine protocol (engine.py) over TorchGPT: megatron-named full tensors in, samples out."""

    def __init__(self, model_cfg, *, dtype: torch.dtype, seed: int, device="cpu"):
        super().__init__(seed=seed, device=device)
        self.model_cfg, self.dtype = model_cfg, dtype
        self.gpt: Optional[TorchGPT] = None
        self.moe = getattr(model_cfg, "num_moe_experts", None) is not None

    def _load(self, tensors: dict[str, Tensor]) -> None:
        self.gpt = TorchGPT(tensors, self.model_cfg, dtype=self.dtype, device=self.device)

    def logits(self, tokens: Tensor, routes: Optional[list] = None) -> Tensor:
        return self.gpt.logits(tokens, routes=routes)

    def _drop(self) -> None:
        self.gpt = None


def open_engine(start: EngineStart) -> TorchEngine:
    return TorchEngine(start.model, dtype=_DTYPES[start.precision], seed=start.seed, device=start.device)
