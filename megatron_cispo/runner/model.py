"""Build a megatron-core GPTModel (dense or MoE), its DDP wrapper and optimizer, with layout-independent init.

`build_model(cfg, tp=, pp=, ...)` returns the list of DDP-wrapped model chunks for this rank's
pipeline stage(s); `build_optimizer(chunks, ...)` the megatron optimizer. Weights are drawn
per parameter from a seed keyed by the parameter's *global* name (global layer and expert index)
and then sliced to this rank's TP / expert-TP shard (weights.py), so every (tp, pp, dp, ep, sp)
layout starts from the same model; `weights.gather_full_state` inverts that. Layer specs: specs.py.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Literal, Optional

import torch

from ..config import check_field_types, config_field
from ..step.hooks import set_megatron_hooks
from .specs import block_spec, grouped_gemm, layer_spec
from ..base.weights import init_layout_independent


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT built from megatron-core's own layer specs."""

    vocab_size: int = config_field(64, "vocabulary size (a multiple of tp)")
    seq_length: int = config_field(32, "max sequence length (learned positions)")
    hidden_size: int = config_field(32, "model width")
    num_layers: int = config_field(2, "transformer layers (a multiple of pp*vp)")
    num_attention_heads: int = config_field(4, "attention heads (a multiple of tp)")
    ffn_hidden_size: int | None = config_field(None, "MLP width; None = 4*hidden")
    dtype: Literal["fp32", "bf16"] = config_field("fp32", "parameter/compute dtype")
    transformer_impl: Literal["local", "te"] = config_field(
        "local", "layer spec: megatron-core local modules or Transformer Engine")
    init_std: float = config_field(0.02, "normal init std for weight matrices")
    num_moe_experts: int | None = config_field(
        None, "MoE experts per layer (a multiple of ep); None = dense MLP. MoE layers have no linear biases")
    moe_router_topk: int = config_field(
        2, "experts per token, 1..num_moe_experts (top-1 takes the softmax over all experts first)")
    moe_aux_loss_coeff: float = config_field(0.0, "load-balancing aux loss coefficient (megatron's aux_loss); 0 = off")
    moe_z_loss_coeff: float = config_field(0.0, "router z-loss coefficient; 0 = off")
    hf_path: Optional[str] = config_field(
        None, "A Hugging Face model directory (config.json, *.safetensors): families llama, mistral, qwen2, "
        "qwen3, qwen3_moe. The architecture and weights come from it, and the shape keys above (vocab_size "
        "... moe_router_topk) take its values: leave them unset (a value that differs is refused)")

    def __post_init__(self):
        check_field_types(self)
        if self.hf_path is not None:
            # absolute, so a run's saved config.yaml points at the model from any working directory
            object.__setattr__(self, "hf_path", os.path.abspath(self.hf_path))
            self._take_shape_from_hf()  # then the checks below, on config.json's values
        for name in ("vocab_size", "seq_length", "hidden_size", "num_layers", "num_attention_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.hf_path is None and self.hidden_size % self.num_attention_heads:  # Qwen3's head_dim need not divide
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by "
                             f"model.num_attention_heads={self.num_attention_heads}")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"model.{name} must be finite and >= 0, got {v}")
        if self.num_moe_experts is None:
            for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
                if getattr(self, name):
                    fix = f"{self.hf_path} is dense" if self.hf_path else "set model.num_moe_experts"
                    raise ValueError(f"model.{name}={getattr(self, name)} needs an MoE model; {fix} or leave it 0")
            return
        if self.num_moe_experts < 1:
            raise ValueError(f"model.num_moe_experts must be >= 1 or None (dense), got {self.num_moe_experts}")
        if not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ValueError(f"model.moe_router_topk must be in [1, model.num_moe_experts="
                             f"{self.num_moe_experts}], got {self.moe_router_topk}")

    def _take_shape_from_hf(self) -> None:
        """Set the shape keys from config.json; one left at its default takes the file's value, one
        set to another value is refused (ValueError naming both)."""
        from ..hf.arch import read_arch

        arch = read_arch(self.hf_path)
        object.__setattr__(self, "_arch", arch)  # read once here; `arch` hands this one down
        for name, value in hf_shape(arch).items():
            mine, default = getattr(self, name), _DEFAULTS[name]
            if mine != default and mine != value:
                raise ValueError(f"model.{name}={mine} conflicts with model.hf_path: {self.hf_path}/config.json "
                                 f"gives {value}; remove model.{name}")
            object.__setattr__(self, name, value)
        if self.init_std != _DEFAULTS["init_std"]:
            raise ValueError(f"model.init_std={self.init_std} has no effect with model.hf_path (the weights come "
                             f"from {self.hf_path}); remove model.init_std")

    @property
    def arch(self):
        """The Hugging Face architecture (hf.arch.HFArch) of model.hf_path, as config.json read when this config
        was made; None for the synthetic GPT."""
        return getattr(self, "_arch", None)

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and output layer: vocab_size, or an HF vocabulary padded (hf.arch.VOCAB_PAD)."""
        return self.arch.padded_vocab_size if self.hf_path else self.vocab_size

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def check_layout(self, *, tp: int, pp: int, vp: int | None, cp: int = 1, ep: int = 1,
                     sequence_parallel: bool = False) -> None:
        """Raise ValueError when this model cannot be split over (tp, pp, vp, cp, ep, sequence_parallel)."""
        from ..hf.arch import check_divisible

        if self.hf_path is not None:  # the widths as config.json names them
            self.arch.check_layout(tp=tp, ep=ep)
        else:
            check_divisible({"model.vocab_size": self.vocab_size,
                             "model.num_attention_heads": self.num_attention_heads,
                             "the MLP width (model.ffn_hidden_size, default 4*hidden)": self.ffn_size}, by=tp, name="tp")
        if self.num_layers % (pp * (vp or 1)):
            raise ValueError(f"model.num_layers={self.num_layers} is not divisible by pp*vp={pp}*{vp or 1}")
        if cp < 1:
            raise ValueError(f"cp must be >= 1, got {cp}")
        if sequence_parallel and tp < 2:
            raise ValueError(f"sequence_parallel needs tp >= 2 (it splits the sequence over the TP "
                             f"group), got tp={tp}")
        if self.num_moe_experts is None:
            if ep != 1:
                raise ValueError(f"ep={ep} (expert parallelism) needs an MoE model; set model.num_moe_experts")
            return
        if self.hf_path is None:  # else config.json's num_experts, checked above
            check_divisible({"model.num_moe_experts": self.num_moe_experts}, by=ep, name="ep")
        if tp > 1 and not sequence_parallel:
            # MoELayer.forward raises in training without it (megatron-core 0.16.1)
            raise ValueError(f"an MoE model with tp={tp} needs sequence_parallel=True")


_DEFAULTS = {f.name: f.default for f in fields(ModelConfig)}


def hf_shape(arch) -> dict:
    """The synthetic-GPT shape keys as an HF architecture sets them."""
    return {"vocab_size": arch.vocab_size, "seq_length": arch.max_position_embeddings,
            "hidden_size": arch.hidden_size, "num_layers": arch.num_layers,
            "num_attention_heads": arch.num_attention_heads, "ffn_hidden_size": arch.ffn_hidden_size,
            "num_moe_experts": arch.num_experts,
            "moe_router_topk": arch.moe_topk if arch.num_experts else _DEFAULTS["moe_router_topk"]}


def _torch_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _moe_kwargs(cfg: ModelConfig, ep: int) -> dict:
    if cfg.num_moe_experts is None:
        return {}
    return dict(
        num_moe_experts=cfg.num_moe_experts, moe_ffn_hidden_size=cfg.ffn_size,
        expert_model_parallel_size=ep,
        moe_router_topk=cfg.moe_router_topk,
        # megatron refuses top-1 without it; an HF family's normalised top-k probabilities are the
        # softmax over the k chosen logits (pre_softmax off), unnormalised ones the softmax over all
        moe_router_pre_softmax=cfg.moe_router_topk == 1 or (cfg.hf_path is not None and not cfg.arch.norm_topk_prob),
        moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_z_loss_coeff=cfg.moe_z_loss_coeff or None,  # megatron: None = off
        moe_router_dtype="fp32",  # routing decisions in fp32 even for a bf16 model
        # alltoall: dropless, takes variable sequence lengths (allgather refuses them), and is the
        # usual choice with ep > 1; one dispatcher for every layout keeps layouts comparable.
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=grouped_gemm(cfg),
        add_bias_linear=False,  # megatron-core 0.16.1 has expert biases only with expert TP = 1
    )


def transformer_config(cfg: ModelConfig, *, tp: int, pp: int, vp: int | None = None, cp: int = 1,
                       ep: int = 1, sequence_parallel: bool = False):
    from megatron.core.transformer import TransformerConfig

    dtype = _torch_dtype(cfg.dtype)
    shape = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                 num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size)
    if cfg.hf_path is not None:
        shape = cfg.arch.transformer_kwargs()  # RMSNorm, SwiGLU, GQA, head_dim, qkv bias, qk-norm
    return TransformerConfig(
        **{**shape, **_moe_kwargs(cfg, ep)}, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp, context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(),
        calculate_per_token_loss=True,  # the loss contract megatron_cispo relies on
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False,
    )


def _check_parallel_state(*, tp: int, pp: int, cp: int, ep: int) -> None:
    from megatron.core import parallel_state as mpu

    have = {"tp": mpu.get_tensor_model_parallel_world_size(), "pp": mpu.get_pipeline_model_parallel_world_size(),
            "cp": mpu.get_context_parallel_world_size(), "ep": mpu.get_expert_model_parallel_world_size()}
    want = {"tp": tp, "pp": pp, "cp": cp, "ep": ep}
    if have != want:
        diff = ", ".join(f"{k}={want[k]} (parallel state: {have[k]})" for k in want if want[k] != have[k])
        raise ValueError(f"build_model got {diff}; pass init_distributed the same layout")


def build_model(cfg: ModelConfig, *, tp: int, pp: int, vp: int | None = None, cp: int = 1, ep: int = 1,
                sequence_parallel: bool = False, seed: int = 0, wrap_ddp: bool = True, load_weights: bool = True,
                distributed_optimizer: bool = False):
    """Return this rank's model chunks ([one per virtual stage]), DDP-wrapped by default.

    load_weights=False leaves megatron's own init in place for a caller that loads a checkpoint
    next: model.hf_path then needs only its config.json (no weights are read).

    Needs megatron's parallel state for the same (tp, pp, cp, ep) (runner.distributed.init_distributed).
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel

    cfg.check_layout(tp=tp, pp=pp, vp=vp, cp=cp, ep=ep, sequence_parallel=sequence_parallel)
    _check_parallel_state(tp=tp, pp=pp, cp=cp, ep=ep)
    tcfg = transformer_config(cfg, tp=tp, pp=pp, vp=vp, cp=cp, ep=ep, sequence_parallel=sequence_parallel)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    layer = layer_spec(cfg)
    # the synthetic GPT: learned positions, untied; an HF family: RoPE, its tying, a padded vocabulary
    arch_kw = cfg.arch.gpt_kwargs() if cfg.hf_path else dict(
        vocab_size=cfg.vocab_size, max_sequence_length=cfg.seq_length, share_embeddings_and_output_weights=False)
    chunks = []
    for v in range(vp or 1):
        vp_stage = v if vp else None
        chunk = GPTModel(
            config=tcfg, transformer_layer_spec=block_spec(layer, tcfg, vp_stage),
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True, vp_stage=vp_stage, **arch_kw,
        ).to(device)
        if load_weights and cfg.hf_path:
            from ..hf.load import load_hf_weights

            load_hf_weights(chunk, cfg.arch)  # each rank reads only its slices
        elif load_weights:
            init_layout_independent(chunk, seed=seed, std=cfg.init_std)
        chunks.append(chunk)
    if not wrap_ddp:
        return chunks
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer,
        # the distributed optimizer's reduce-scatter runs bucket by bucket during the backward (finished in
        # finalize_model_grads, before the step); its param all-gather stays at the step (overlap_param_gather
        # would defer it to the next forward, after the weight push has read the parameters)
        overlap_grad_reduce=distributed_optimizer,
        average_in_collective=False)  # per-token loss: megatron divides by the global token count
    wrapped = [DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=c,
                                       disable_bucketing=(i > 0)) for i, c in enumerate(chunks)]
    # The schedules read these hooks off the config, as Megatron-LM's training loop sets them:
    # finalize_model_grads does the DP all-reduce and the 1/global-token scaling.
    set_megatron_hooks(wrapped)
    return wrapped


def build_optimizer(chunks, *, lr: float, optimizer: str = "adam", weight_decay: float = 0.0,
                    clip_grad: float = 1.0, adam_beta1: float = 0.9, adam_beta2: float = 0.999,
                    bf16: bool = False, distributed: bool = False):
    """megatron's optimizer over `chunks`; distributed=True: its distributed optimizer (fp32 master weights
    and optimizer state sharded over DP x CP; gradients reduce-scattered, parameters all-gathered), which
    needs the chunks built with build_model(distributed_optimizer=True)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ocfg = OptimizerConfig(optimizer=optimizer, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                           adam_beta1=adam_beta1, adam_beta2=adam_beta2, bf16=bf16,
                           use_distributed_optimizer=distributed)
    optimizer = get_megatron_optimizer(ocfg, chunks)
    set_megatron_hooks(chunks, optimizer)
    return optimizer


