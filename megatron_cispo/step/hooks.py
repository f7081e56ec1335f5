"""The megatron-core contract the step relies on: per-token loss, and the training-loop hooks.

    set_megatron_hooks(chunks, optimizer)   # once, after building the model and the optimizer
    check_megatron_config(chunks)           # policy_step and make_forward_step call it for you

Megatron-LM sets `finalize_model_grads_func`, `grad_scale_func` and `no_sync_func` on the model
config only inside its train(). megatron's schedules read them off the config, and without
finalize_model_grads the DP all-reduce, the 1/num_tokens scaling of the per-token loss, the
sequence-parallel norm all-reduce and the pipeline embedding all-reduce are silently skipped.
"""
from __future__ import annotations

_HOW = ("call megatron_cispo.step.set_megatron_hooks(chunks, optimizer) once after building the "
        "model and optimizer, as Megatron-LM's train() does")


def set_megatron_hooks(chunks, optimizer=None) -> None:
    """Set the hooks megatron's schedules read, as Megatron-LM's train() does: finalize_model_grads,
    the optimizer's loss scaling (when an optimizer is given) and the DDP no_sync context(s).
    grad_sync_func / param_sync_func (train() sets them only under align_grad_reduce /
    align_param_gather with overlapped communication) are left out: they change overlap, not
    the gradients."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    config.finalize_model_grads_func = finalize_model_grads
    if optimizer is not None:
        config.grad_scale_func = optimizer.scale_loss
    no_sync = [c.no_sync for c in chunks if hasattr(c, "no_sync")]
    if no_sync:
        config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]


def check_megatron_config(chunks, *, head="logits") -> None:
    """Fail when the model/DDP config breaks the per-token loss contract this plugin relies on,
    or when a training-loop hook that megatron's schedules need is missing (ValueError), or when
    the installed megatron-core lacks a name the library uses (one ImportError line). head: the
    step's step.head.Head, or its kind. fused_grad with fp16 is refused here, the one place: it
    forms the gradients in forward, before the loss scale, so small ones would underflow."""
    from megatron.core.utils import get_model_config

    from ..mcore import require_names

    require_names("library")

    cfg = get_model_config(chunks[0])
    if not getattr(cfg, "calculate_per_token_loss", False):
        raise ValueError("megatron_cispo needs TransformerConfig.calculate_per_token_loss=True (got False): "
                         "without it megatron divides each microbatch loss by its own token count and by "
                         "num_microbatches, which is not the global token mean")
    ddps = [c.ddp_config for c in chunks if getattr(c, "ddp_config", None) is not None]
    if any(getattr(d, "average_in_collective", False) for d in ddps):
        raise ValueError("megatron_cispo needs DistributedDataParallelConfig.average_in_collective=False "
                         "(got True): with per-token loss, megatron scales gradients by 1/global tokens "
                         "itself, and averaging in the collective would divide by DP size again")
    if getattr(cfg, "finalize_model_grads_func", None) is None:
        raise ValueError("the model config has no finalize_model_grads_func: megatron's schedules would skip "
                         "the data-parallel gradient all-reduce and the 1/num_tokens scaling of the per-token "
                         f"loss (Megatron-LM sets it only inside train()); {_HOW}")
    if getattr(cfg, "fp16", False) and getattr(head, "kind", head) == "fused_grad":
        raise ValueError("loss.head=fused_grad does not support fp16 (got TransformerConfig.fp16=True): it forms the "
                         "gradients in forward, before the loss scale, so small ones would underflow in fp16; "
                         "use bf16, or loss.head='fused'")
    if getattr(cfg, "fp16", False) and getattr(cfg, "grad_scale_func", None) is None:
        raise ValueError(f"fp16 training needs the model config's grad_scale_func (the loss scaler); {_HOW}")
    if any(getattr(d, "overlap_grad_reduce", False) for d in ddps) and getattr(cfg, "no_sync_func", None) is None:
        raise ValueError("DistributedDataParallelConfig.overlap_grad_reduce=True needs the model config's "
                         f"no_sync_func, or gradients are reduced after every microbatch; {_HOW}")
