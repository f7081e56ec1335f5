"""rollout.engine=hf: transformers' own model of the family, on the trainer's streamed weights.

    eng = open_engine(EngineStart(model=model_cfg, precision="bf16", seed=0, max_model_len=64))
    eng.update_weights(buckets, manifest=hf_shapes(arch), bucket_bytes=n)   # HF-named buckets (engine.py)
    engine = HFEngine.from_state(gather_full_state(chunks), read_arch(path), dtype=torch.bfloat16)
    logits = engine.logits(tokens)          # [b, s] int64 -> [b, s, vocab_size], as rollout/torch_engine.TorchGPT

The weights arrive as HF tensors (our export mapping) and load the way an inference engine loads a
checkpoint: export.write_hf_dir writes them (fp32) to a directory of the engine's own and
AutoModelForCausalLM.from_pretrained reads them back, so transformers' own loading (Qwen3-MoE's fused experts included) checks every name
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
from ..hf.arch import HFArch
from ..hf.export import write_hf_dir
from ..hf.mapping import hf_shapes, to_hf
from .engine import EngineStart
from .inprocess import InProcessEngine
from .weight_stream import tensor_buckets

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


class HFEngine(InProcessEngine):
    """Forward-only transformers model (eval, no grad) of `arch`'s family, on the weights last streamed in.

    dtype: the sampler's precision (rollout.precision). The whole prefix is recomputed per call
    (no KV cache): the demo's sequences are a dozen tokens.
    """

    def __init__(self, arch: HFArch, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 seed: int = 0):
        super().__init__(seed=seed, device=device)
        self.arch, self.dtype = arch, dtype
        self.model = None
        self.moe = arch.num_experts is not None

    @classmethod
    def from_state(cls, full: dict[str, Tensor], arch: HFArch, **kw) -> "HFEngine":
        """An engine on `full` ({global megatron name: full tensor}, as gather_full_state returns it)."""
        eng = cls(arch, **kw)
        named = to_hf(canonical_names(full), arch)
        eng.update_weights(tensor_buckets(named, 64 << 20), manifest=hf_shapes(arch), bucket_bytes=64 << 20)
        return eng

    def _load(self, tensors: dict[str, Tensor]) -> None:
        self.model = None  # free the old model before building the next
        with tempfile.TemporaryDirectory(prefix="cispo_hf_engine_") as tmp, _quiet() as transformers:
            # fp32 on disk: the sampler's precision is applied by from_pretrained, never a bf16 source's cast
            exported = write_hf_dir(tensors, self.arch, Path(tmp) / "model", dtype=torch.float32)
            model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=self.dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)

    def _drop(self) -> None:
        self.model = None

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


def open_engine(start: EngineStart) -> HFEngine:
    return HFEngine(start.model.arch, dtype=_DTYPES[start.precision], device=start.device, seed=start.seed)
