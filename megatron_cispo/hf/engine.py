"""The hf sampler's engine: transformers' own model of the family, on the trainer's synced weights.

    engine = HFEngine(gather_full_state(chunks), read_arch(path), dtype=torch.bfloat16)
    logits = engine.logits(tokens)          # [b, s] int64 -> [b, s, vocab_size], as demo/gpt.TorchGPT

The weights travel as an inference engine receives them: to_hf (our export mapping) and
export.write_hf_dir write them as run.export_hf does (fp32), and AutoModelForCausalLM.from_pretrained
reads them back, so transformers' own loading (Qwen3-MoE's fused experts included) checks every name
and shape. Nothing here is code of ours about the forward: the mismatch this sampler shows against
the megatron trainer is the mapping's and the precision's.
"""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from ..base.param_names import canonical_names
from .arch import HFArch
from .export import write_hf_dir
from .mapping import to_hf


@contextlib.contextmanager
def _quiet():
    """transformers prints a progress bar and a load report per from_pretrained; one per step is noise."""
    import transformers
    from transformers.utils import logging

    bars, level = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield transformers
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


class HFEngine:
    """Forward-only transformers model (eval, no grad) of `arch`'s family on the full state `full`.

    full: {global megatron name: full tensor} as runner.weights.gather_full_state returns it.
    dtype: the sampler's precision (rollout.precision). The whole prefix is recomputed per call
    (no KV cache): the demo's sequences are a dozen tokens.
    """

    def __init__(self, full: dict[str, Tensor], arch: HFArch, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.arch = arch
        with tempfile.TemporaryDirectory(prefix="cispo_hf_engine_") as tmp, _quiet() as transformers:
            # fp32 on disk: the sampler's precision is applied by from_pretrained, never a bf16 source's cast
            exported = write_hf_dir(to_hf(canonical_names(full), arch), arch, Path(tmp) / "model", dtype=torch.float32)
            model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=dtype)
        self.model = model.to(device).eval().requires_grad_(False)

    @property
    def num_experts(self) -> Optional[int]:
        return self.arch.num_experts

    @torch.no_grad()
    def logits(self, tokens: Tensor, routes: Optional[list] = None) -> Tensor:
        """tokens: [b, s] int64 -> logits [b, s, vocab_size] in the model dtype. routes (MoE): a list
        that gets each MoE layer's experts [b, s, k] int64, the top-k of its router logits."""
        if routes is None:
            return self.model(input_ids=tokens, use_cache=False).logits
        out = self.model(input_ids=tokens, use_cache=False, output_router_logits=True)
        routes += [r.view(*tokens.shape, -1).topk(self.arch.moe_topk, -1).indices for r in out.router_logits]
        return out.logits
