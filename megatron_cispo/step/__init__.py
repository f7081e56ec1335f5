"""The megatron-core plugin: one RL policy step inside megatron's own pipeline schedules.

    rollouts.py     Rollouts (a DP-local batch) and StepConfig (minibatches, epochs, temperature)
    microbatch.py   Microbatch: what the schedule hands to forward_step and the loss function
    packing.py      Rollouts -> Microbatches: packed THD bins or padded rows, CP chunks, weights
    forward.py      make_loss_func / make_forward_step (the loss plugin), the forward-only pass
    head.py         the output head, chosen once per forward: logits, or fused (hidden states ->
                    fused_token_logprobs); shared with the Megatron-LM drop-in
    hooks.py        check_megatron_config / set_megatron_hooks: the per-token loss and loop hooks
    guard.py        the non-finite guard: refuse bad advantages, skip non-finite steps on every rank
    moe.py          MoE aux/z-loss scaling under TP x CP on megatron-core 0.16 (#1652); moe/ metrics
    policy_step.py  policy_step: check_batch, prepare_inputs (pi_old, reference, M2PO), train, metrics
    pipeline.py     broadcasts from the last pipeline stage
    reduce.py       reduce_metrics: exact Metrics reduction over the DP x CP group
Process groups appear here and in the logprob ops only. megatron-core is imported on first call.
"""
from .forward import compute_logprobs, make_forward_step, make_loss_func
from .hooks import check_megatron_config, set_megatron_hooks
from .microbatch import Microbatch
from .moe import moe_aux_loss_compensation
from .policy_step import plan_old_logprobs, policy_step
from .reduce import reduce_metrics
from .rollouts import Rollouts, StepConfig

__all__ = [
    "Microbatch", "Rollouts", "StepConfig", "check_megatron_config", "compute_logprobs", "make_forward_step",
    "make_loss_func", "moe_aux_loss_compensation", "plan_old_logprobs", "policy_step", "reduce_metrics",
    "set_megatron_hooks",
]
