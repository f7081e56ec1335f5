"""The loss plugin for megatron-core's schedules: loss_func, forward_step, and a forward-only pass.

    forward_step = make_forward_step(loss_cfg, temperature=1.0)          # whole plugin
    get_forward_backward_func()(forward_step_func=forward_step, ...)     # megatron's schedule
    loss_func = make_loss_func(loss_cfg)   # or only the loss, in your own forward_step:
    return output_tensor, partial(loss_func, microbatch)                 # microbatch: a dict

On the last stage loss_func computes vocab-parallel token logprobs, calls compute_policy_loss
and returns (loss_sum, denominator as int, Metrics): with calculate_per_token_loss=True megatron
sums the denominators over microbatches and DP and divides the gradient once.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
from torch import Tensor

from ..config import LossConfig
from ..logprobs import token_logprobs
from ..losses import compute_policy_loss
from .pipeline import broadcast_tensor_from_last_stage, is_last_stage
from .rollouts import Rollouts


def check_megatron_config(chunks) -> None:
    """Fail when the model/DDP config breaks the per-token loss contract this plugin relies on."""
    from megatron.core.utils import get_model_config

    cfg = get_model_config(chunks[0])
    if not getattr(cfg, "calculate_per_token_loss", False):
        raise ValueError("megatron_cispo needs TransformerConfig.calculate_per_token_loss=True (got False): "
                         "without it megatron divides each microbatch loss by its own token count and by "
                         "num_microbatches, which is not the global token mean")
    for chunk in chunks:
        ddp = getattr(chunk, "ddp_config", None)
        if ddp is not None and getattr(ddp, "average_in_collective", False):
            raise ValueError("megatron_cispo needs DistributedDataParallelConfig.average_in_collective=False "
                             "(got True): with per-token loss, megatron scales gradients by 1/global tokens "
                             "itself, and averaging in the collective would divide by DP size again")


def forward_step_for(loss_func, calls: Optional[list] = None):
    """forward_step(data_iterator, model) that runs the model on a microbatch dict and hands
    `loss_func(mb, output)` to the schedule; `calls` gets one entry per model forward."""
    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        if calls is not None:
            calls.append(1)
        tokens = mb["tokens"][:, :-1]
        pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return model(tokens, pos, None), partial(loss_func, mb)
    return forward_step


def make_loss_func(loss_cfg: LossConfig, *, temperature: float = 1.0, vocab_size: Optional[int] = None,
                   old_from_current: bool = False, entropy: bool = True):
    """loss_func(microbatch, logits) -> (loss_sum, num_tokens int, Metrics), megatron's 3-tuple.

    microbatch: a dict as `Rollouts.select` makes it ("tokens" [b, s+1], "loss_mask",
    "advantages", optional "old/rollout/ref_logprobs" [b, s]). logits: [b, s, v/tp] as GPTModel
    returns them (batch first). old_from_current: pi_old = this forward's detached logprobs
    (one optimizer step per batch). Needs calculate_per_token_loss=True.
    """
    want_entropy = entropy or loss_cfg.entropy_coef != 0

    def loss_func(mb: dict[str, Tensor], logits: Tensor):
        out = token_logprobs(logits, mb["tokens"][:, 1:], temperature=temperature, vocab_size=vocab_size,
                             return_entropy=want_entropy)
        lp, ent = out if want_entropy else (out, None)
        old = lp.detach() if old_from_current else mb.get("old_logprobs")
        res = compute_policy_loss(
            loss_cfg, lp, advantages=mb["advantages"], loss_mask=mb["loss_mask"], old_logprobs=old,
            rollout_logprobs=mb.get("rollout_logprobs"), ref_logprobs=mb.get("ref_logprobs"), entropy=ent)
        return res.loss_sum, res.denominator.round().to(torch.int), res.metrics

    return loss_func


def make_forward_step(loss_cfg: LossConfig, *, temperature: float = 1.0, vocab_size: Optional[int] = None,
                      old_from_current: bool = False, entropy: bool = True, calls: Optional[list] = None):
    """forward_step(data_iterator, model) for megatron-core's schedules: the whole loss plugin.

    The iterator yields microbatch dicts (`Rollouts.select`); loss_func is `make_loss_func`'s.
    `calls`, if given, gets one entry per model forward (for tests and benchmarks).
    """
    loss_func = make_loss_func(loss_cfg, temperature=temperature, vocab_size=vocab_size,
                               old_from_current=old_from_current, entropy=entropy)
    return forward_step_for(loss_func, calls)


def run_schedule(chunks, forward_step, microbatches: list, *, forward_only: bool):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq = microbatches[0]["tokens"].shape[1] - 1
    its = [iter(microbatches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=its if len(chunks) > 1 else its[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(microbatches),
        seq_length=seq, micro_batch_size=microbatches[0]["tokens"].shape[0], forward_only=forward_only)


def split_microbatches(n: int, size: int, batch: Rollouts) -> list[dict[str, Tensor]]:
    return [batch.select(slice(i, i + size)) for i in range(0, n, size)]


@torch.no_grad()
def compute_logprobs(chunks, batch: Rollouts, *, micro_batch_size: int, temperature: float = 1.0,
                     vocab_size: Optional[int] = None, calls: Optional[list] = None) -> Tensor:
    """Forward-only pass through the schedule; [n, s] fp32 logprobs on every PP stage."""
    def loss_func(mb, logits):
        lp = token_logprobs(logits, mb["tokens"][:, 1:], temperature=temperature, vocab_size=vocab_size)
        return lp.sum(), torch.zeros((), dtype=torch.int, device=lp.device), {"logprobs": lp.detach()}

    forward_step = forward_step_for(loss_func, calls)
    n, s = batch.tokens.shape[0], batch.tokens.shape[1] - 1
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        reports = run_schedule(chunks, forward_step, split_microbatches(n, micro_batch_size, batch),
                               forward_only=True)
    finally:
        for c, mode in zip(chunks, modes):
            c.train(mode)
    local = torch.cat([r["logprobs"] for r in reports]) if is_last_stage() else None
    return broadcast_tensor_from_last_stage(local, (n, s), device=batch.tokens.device)


