"""Build a megatron-core GPTModel, its DDP wrapper and optimizer, with layout-independent init.

`build_model(cfg, dist_env)` returns the list of DDP-wrapped model chunks for this rank's
pipeline stage(s); `build_optimizer(cfg, chunks)` the megatron optimizer. Weights are drawn
per parameter from a seed keyed by the parameter's *global* name and then sliced to this
rank's TP shard, so every (tp, pp, dp) layout starts from the same model.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT built from megatron-core's own layer specs."""

    vocab_size: int = field(default=64, metadata={"doc": "vocabulary size (a multiple of tp)"})
    seq_length: int = field(default=32, metadata={"doc": "max sequence length (learned positions)"})
    hidden_size: int = field(default=32, metadata={"doc": "model width"})
    num_layers: int = field(default=2, metadata={"doc": "transformer layers (a multiple of pp*vp)"})
    num_attention_heads: int = field(default=4, metadata={"doc": "attention heads (a multiple of tp)"})
    ffn_hidden_size: int | None = field(default=None, metadata={"doc": "MLP width; None = 4*hidden"})
    dtype: Literal["fp32", "bf16"] = field(default="fp32", metadata={"doc": "parameter/compute dtype"})
    transformer_impl: Literal["local", "te"] = field(
        default="local", metadata={"doc": "layer spec: megatron-core local modules or Transformer Engine"})
    init_std: float = field(default=0.02, metadata={"doc": "normal init std for weight matrices"})

    def __post_init__(self):
        for name in ("vocab_size", "seq_length", "hidden_size", "num_layers", "num_attention_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by "
                             f"model.num_attention_heads={self.num_attention_heads}")

    def check_layout(self, *, tp: int, pp: int, vp: int | None) -> None:
        """Raise ValueError when this model cannot be split over (tp, pp, vp)."""
        if self.vocab_size % tp:
            raise ValueError(f"model.vocab_size={self.vocab_size} is not divisible by tp={tp}")
        if self.num_attention_heads % tp:
            raise ValueError(f"model.num_attention_heads={self.num_attention_heads} is not divisible by tp={tp}")
        if self.num_layers % (pp * (vp or 1)):
            raise ValueError(f"model.num_layers={self.num_layers} is not divisible by pp*vp={pp}*{vp or 1}")


def _torch_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def transformer_config(cfg: ModelConfig, *, tp: int, pp: int, vp: int | None = None, cp: int = 1):
    from megatron.core.transformer import TransformerConfig

    dtype = _torch_dtype(cfg.dtype)
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp, context_parallel_size=cp,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(),
        calculate_per_token_loss=True,  # the loss contract megatron_cispo relies on
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False,
    )


def _layer_spec(cfg: ModelConfig):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if cfg.transformer_impl == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec()
    return specs.get_gpt_layer_local_spec()


def build_model(cfg: ModelConfig, *, tp: int, pp: int, vp: int | None = None, seed: int = 0,
                wrap_ddp: bool = True):
    """Return this rank's model chunks ([one per virtual stage]), DDP-wrapped by default."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel

    cfg.check_layout(tp=tp, pp=pp, vp=vp)
    tcfg = transformer_config(cfg, tp=tp, pp=pp, vp=vp)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    chunks = []
    for v in range(vp or 1):
        vp_stage = v if vp else None
        chunk = GPTModel(
            config=tcfg, transformer_layer_spec=_layer_spec(cfg), vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.seq_length,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=False, parallel_output=True, vp_stage=vp_stage,
        ).to(device)
        init_layout_independent(chunk, seed=seed, std=cfg.init_std)
        chunks.append(chunk)
    if not wrap_ddp:
        return chunks
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False,
        average_in_collective=False)  # per-token loss: megatron divides by the global token count
    from megatron.core.distributed import finalize_model_grads

    wrapped = [DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=c,
                                       disable_bucketing=(i > 0)) for i, c in enumerate(chunks)]
    # The schedules read these hooks off the config, as Megatron-LM's training loop sets them:
    # finalize_model_grads does the DP all-reduce and the 1/global-token scaling.
    tcfg.finalize_model_grads_func = finalize_model_grads
    no_sync = [c.no_sync for c in wrapped]
    tcfg.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    return wrapped


def global_param_name(module: torch.nn.Module, name: str) -> str:
    """Map a local parameter name to its layout-independent name (global layer index)."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        owner = module.get_submodule(".".join(parts[: i + 2]))
        parts[i + 1] = str(owner.layer_number - 1)
    return ".".join(parts)


def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_layout_independent(module: torch.nn.Module, *, seed: int, std: float) -> None:
    """Fill every parameter from a generator keyed by its global name, then take the TP shard."""
    from megatron.core import parallel_state as mpu

    tp_rank = mpu.get_tensor_model_parallel_rank()
    tp = mpu.get_tensor_model_parallel_world_size()
    for name, p in module.named_parameters():
        gname = global_param_name(module, name)
        dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
        full_shape = list(p.shape)
        if dim >= 0:
            full_shape[dim] *= tp
        gen = torch.Generator().manual_seed(_seed_for(seed, gname))
        if name.endswith("bias"):
            full = torch.zeros(full_shape)
        elif "layernorm" in name or name.endswith("norm.weight") or p.dim() == 1:
            full = torch.ones(full_shape)
        else:
            full = torch.randn(full_shape, generator=gen) * std
        if dim >= 0:
            full = full.chunk(tp, dim=dim)[tp_rank]
        p.copy_(full.to(dtype=p.dtype, device=p.device))


def build_optimizer(chunks, *, lr: float, optimizer: str = "adam", weight_decay: float = 0.0,
                    clip_grad: float = 1.0, adam_beta1: float = 0.9, adam_beta2: float = 0.999,
                    bf16: bool = False):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ocfg = OptimizerConfig(optimizer=optimizer, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                           adam_beta1=adam_beta1, adam_beta2=adam_beta2, bf16=bf16,
                           use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(ocfg, chunks)
    chunks[0].config.grad_scale_func = optimizer.scale_loss
    return optimizer


@torch.no_grad()
def gather_full_state(chunks) -> dict[str, torch.Tensor]:
    """All parameters under their global names, TP shards concatenated, from every PP stage.

    Collective over the whole world (all ranks must call it); every rank gets the full dict.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    tp_group = mpu.get_tensor_model_parallel_group()
    tp = mpu.get_tensor_model_parallel_world_size()
    local = {}
    for chunk in chunks:
        mod = getattr(chunk, "module", chunk)
        for name, p in mod.named_parameters():
            t = p.detach().float().cpu()
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                src = p.detach().float().contiguous()
                parts = [torch.empty_like(src) for _ in range(tp)]
                dist.all_gather(parts, src, group=tp_group)
                t = torch.cat([x.cpu() for x in parts], dim=p.partition_dim)
            local[global_param_name(mod, name)] = t
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    full = {}
    for d in everyone:
        full.update(d)
    return full
