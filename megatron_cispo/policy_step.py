"""One RL policy update through megatron-core's own pipeline schedules.

    metrics = policy_step(chunks, optimizer, rollouts, loss_cfg, StepConfig(micro_batch_size=2))

`make_forward_step` is the loss plugin for `get_forward_backward_func`: on the last stage it
computes vocab-parallel token logprobs, calls `compute_policy_loss`, and returns the 3-tuple
(loss_sum, denominator, report). With `calculate_per_token_loss=True` megatron sums the
denominators over microbatches and DP and divides the gradient once: the exact global mean.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Literal, Optional

import torch
from torch import Tensor

from .config import LossConfig
from .logprobs import token_logprobs
from .losses import check_loss_config, compute_policy_loss, required_inputs
from .losses.registry import missing_input_message
from .pipeline import broadcast_object_from_last_stage, broadcast_tensor_from_last_stage, is_last_stage
from .reduce import make_report, reduce_reports


@dataclass(frozen=True, kw_only=True)
class Rollouts:
    """A DP-local batch of n sequences of s+1 tokens (prompt + response, right-padded).

    tokens: [n, s+1] int64. The model reads tokens[:, :-1] and is scored on tokens[:, 1:].
    loss_mask: [n, s] bool, True on trained (response) targets. advantages: [n] or [n, s].
    rollout_logprobs / old_logprobs / ref_logprobs: [n, s] fp32, per target token.
    """

    tokens: Tensor
    loss_mask: Tensor
    advantages: Tensor
    rollout_logprobs: Optional[Tensor] = None
    old_logprobs: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None

    def __post_init__(self):
        if self.tokens.dim() != 2 or self.tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"rollouts.tokens must be an int [n, s+1] tensor, got {self.tokens.dtype} "
                             f"{tuple(self.tokens.shape)}")
        n, s = self.tokens.shape[0], self.tokens.shape[1] - 1
        for name in ("loss_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (n, s):
                raise ValueError(f"rollouts.{name} has shape {tuple(t.shape)}; expected [n, s] = {(n, s)} "
                                 f"for tokens of shape {tuple(self.tokens.shape)}")
        if tuple(self.advantages.shape) not in ((n,), (n, s)):
            raise ValueError(f"rollouts.advantages has shape {tuple(self.advantages.shape)}; expected "
                             f"[n] = {(n,)} or [n, s] = {(n, s)}")

    def dp_shard(self, *, dp_rank: int, dp: int, minibatches: int = 1) -> Rollouts:
        """This DP rank's share of a global batch, so that each minibatch (optimizer step)
        holds the same global sequences in every layout: minibatch j is split over DP ranks."""
        n = self.tokens.shape[0]
        if n % (dp * minibatches):
            raise ValueError(f"global batch of {n} sequences does not split into {minibatches} "
                             f"minibatches over dp={dp}")

        def take(t: Tensor) -> Tensor:
            t = t.reshape(minibatches, dp, n // (dp * minibatches), *t.shape[1:])[:, dp_rank]
            return t.reshape(-1, *t.shape[2:])
        return Rollouts(**{k: take(v) for k, v in self.select(slice(None)).items()})

    def select(self, idx: slice) -> dict[str, Tensor]:
        return {k: getattr(self, k)[idx] for k in ("tokens", "loss_mask", "advantages", "rollout_logprobs",
                                                   "old_logprobs", "ref_logprobs") if getattr(self, k) is not None}


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    """How one batch of rollouts becomes optimizer steps."""

    micro_batch_size: int = field(default=1, metadata={"doc": "sequences per microbatch per DP rank"})
    minibatch_size: Optional[int] = field(
        default=None, metadata={"doc": "global sequences per optimizer step; None = the whole batch (one step)"})
    epochs: int = field(default=1, metadata={"doc": "passes over the batch"})
    temperature: float = field(default=1.0, metadata={"doc": "the sampler's temperature; logits are divided by it"})
    old_logprob_pass: Literal["auto", "always"] = field(
        default="auto", metadata={"doc": "auto skips the pi_old pass when it cannot matter"})

    def __post_init__(self):
        for name in ("micro_batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.minibatch_size is not None and self.minibatch_size < 1:
            raise ValueError(f"minibatch_size must be >= 1 or None, got {self.minibatch_size}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.old_logprob_pass not in ("auto", "always"):
            raise ValueError(f"old_logprob_pass must be 'auto' or 'always', got {self.old_logprob_pass!r}")


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


OldPlan = Literal["given", "pass", "from_training_forward", "unused"]


def plan_old_logprobs(loss_cfg: LossConfig, step_cfg: StepConfig, *, optimizer_steps: int,
                      have_old: bool) -> OldPlan:
    """Decide how pi_old is obtained. `required_inputs` already consults the anchor, TIS and KL."""
    if "old_logprobs" not in required_inputs(loss_cfg):
        return "unused"  # e.g. cispo with anchor='rollout' and no TIS
    if have_old:
        return "given"
    if step_cfg.old_logprob_pass == "auto" and optimizer_steps == 1:
        return "from_training_forward"  # one step per batch: pi_old == pi_theta, detached
    return "pass"


def _forward_step_for(loss_func, calls: Optional[list]):
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


def make_forward_step(loss_cfg: LossConfig, *, temperature: float = 1.0, vocab_size: Optional[int] = None,
                      old_from_current: bool = False, entropy: bool = True, calls: Optional[list] = None):
    """forward_step(data_iterator, model) for megatron-core's schedules (the loss plugin).

    Microbatches are dicts from `Rollouts.select`. On the last stage the loss function returns
    (loss_sum, denominator as int, report), relying on calculate_per_token_loss=True.
    `calls`, if given, gets one entry per model forward (for tests and benchmarks).
    """
    want_entropy = entropy or loss_cfg.entropy_coef != 0

    def loss_func(mb: dict[str, Tensor], logits: Tensor):
        # logits: [b, s, v/tp] (GPTModel already moved batch first); one place converts shapes.
        out = token_logprobs(logits, mb["tokens"][:, 1:], temperature=temperature, vocab_size=vocab_size,
                             return_entropy=want_entropy)
        lp, ent = out if want_entropy else (out, None)
        old = lp.detach() if old_from_current else mb.get("old_logprobs")
        res = compute_policy_loss(
            loss_cfg, logprobs=lp, advantages=mb["advantages"], loss_mask=mb["loss_mask"], old_logprobs=old,
            rollout_logprobs=mb.get("rollout_logprobs"), ref_logprobs=mb.get("ref_logprobs"), entropy=ent)
        return res.loss_sum, res.denominator.round().to(torch.int), make_report(res)

    return _forward_step_for(loss_func, calls)


def _run_schedule(chunks, forward_step, microbatches: list, *, forward_only: bool):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq = microbatches[0]["tokens"].shape[1] - 1
    its = [iter(microbatches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=its if len(chunks) > 1 else its[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(microbatches),
        seq_length=seq, micro_batch_size=microbatches[0]["tokens"].shape[0], forward_only=forward_only)


def _split(n: int, size: int, batch: Rollouts) -> list[dict[str, Tensor]]:
    return [batch.select(slice(i, i + size)) for i in range(0, n, size)]


@torch.no_grad()
def compute_logprobs(chunks, batch: Rollouts, *, micro_batch_size: int, temperature: float = 1.0,
                     vocab_size: Optional[int] = None, calls: Optional[list] = None) -> Tensor:
    """Forward-only pass through the schedule; [n, s] fp32 logprobs on every PP stage."""
    def loss_func(mb, logits):
        lp = token_logprobs(logits, mb["tokens"][:, 1:], temperature=temperature, vocab_size=vocab_size)
        return lp.sum(), torch.tensor(0, dtype=torch.int), {"logprobs": lp.detach()}

    forward_step = _forward_step_for(loss_func, calls)
    n, s = batch.tokens.shape[0], batch.tokens.shape[1] - 1
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        reports = _run_schedule(chunks, forward_step, _split(n, micro_batch_size, batch), forward_only=True)
    finally:
        for c, mode in zip(chunks, modes):
            c.train(mode)
    local = torch.cat([r["logprobs"] for r in reports]) if is_last_stage() else None
    return broadcast_tensor_from_last_stage(local, (n, s), device=batch.tokens.device)


def policy_step(chunks, optimizer, batch: Rollouts, loss_cfg: LossConfig, step_cfg: StepConfig, *,
                vocab_size: Optional[int] = None, ref_chunks=None, calls: Optional[list] = None) -> dict[str, float]:
    """Run one full RL update (minibatches x epochs, each an optimizer step) on DP-local `batch`.

    pi_old comes from `batch.old_logprobs`, the training forward, or a forward-only pass, as
    `plan_old_logprobs` decides. With KL on and no `batch.ref_logprobs`, the reference model's
    `ref_chunks` (same layout) are scored in a forward-only pass through the same schedule.

    Returns global metrics (identical on every rank): the loss metrics reduced exactly over
    microbatches and DP ("policy/loss", "<loss>/ratio_mean", ...), "step/grad_norm" (mean
    over optimizer steps that computed one), "step/optimizer_steps" (taken), "step/skipped_steps"
    (overflow), "step/old_logprob_pass" (1.0 if an extra forward pass computed pi_old) and
    "step/forward_calls" (model forwards on this rank).
    """
    from megatron.core import parallel_state as mpu

    check_megatron_config(chunks)
    check_loss_config(loss_cfg)
    if mpu.get_context_parallel_world_size() > 1:
        raise ValueError("policy_step does not split sequences over context parallelism yet; "
                         f"got cp={mpu.get_context_parallel_world_size()}, use cp=1")
    dp = mpu.get_data_parallel_world_size()
    n = batch.tokens.shape[0]
    mini_local = n if step_cfg.minibatch_size is None else step_cfg.minibatch_size // dp
    if step_cfg.minibatch_size is not None and (step_cfg.minibatch_size % dp or (n * dp) % step_cfg.minibatch_size):
        raise ValueError(f"minibatch_size={step_cfg.minibatch_size} must divide the global batch "
                         f"({n} per rank x dp={dp}) and be a multiple of dp")
    if mini_local % step_cfg.micro_batch_size:
        raise ValueError(f"micro_batch_size={step_cfg.micro_batch_size} must divide the per-rank "
                         f"minibatch of {mini_local} sequences")
    steps = step_cfg.epochs * (n // mini_local)
    calls = [] if calls is None else calls
    plan = plan_old_logprobs(loss_cfg, step_cfg, optimizer_steps=steps, have_old=batch.old_logprobs is not None)
    # Checked on every rank before the schedule starts: raised inside the last stage's loss,
    # a missing input would leave the other stages waiting in p2p until the timeout.
    for name in sorted(required_inputs(loss_cfg) - {"entropy"}):
        produced = (name == "old_logprobs" and plan in ("pass", "from_training_forward")
                    or name == "ref_logprobs" and ref_chunks is not None)
        if getattr(batch, name) is None and not produced:
            raise ValueError(f"rollouts.{name} is missing: {missing_input_message(loss_cfg, name)}")
    score = partial(compute_logprobs, batch=batch, micro_batch_size=step_cfg.micro_batch_size,
                    temperature=step_cfg.temperature, vocab_size=vocab_size, calls=calls)
    if plan == "pass":
        batch = replace(batch, old_logprobs=score(chunks))
    if "ref_logprobs" in required_inputs(loss_cfg) and batch.ref_logprobs is None:
        batch = replace(batch, ref_logprobs=score(ref_chunks))
    forward_step = make_forward_step(loss_cfg, temperature=step_cfg.temperature, vocab_size=vocab_size,
                                     old_from_current=plan == "from_training_forward", calls=calls)
    reports, grad_norms, skipped = [], [], 0
    for _ in range(step_cfg.epochs):
        for start in range(0, n, mini_local):
            mini = Rollouts(**batch.select(slice(start, start + mini_local)))
            for c in chunks:
                c.zero_grad_buffer()
            optimizer.zero_grad()
            reports += _run_schedule(chunks, forward_step, _split(mini_local, step_cfg.micro_batch_size, mini),
                                     forward_only=False)
            ok, grad_norm, _ = optimizer.step()
            skipped += not ok  # a mixed-precision optimizer skips a step on overflow
            if grad_norm is not None:  # None when clip_grad=0 on the fp32 optimizer
                grad_norms.append(float(grad_norm))
    metrics = None
    if is_last_stage():
        metrics = reduce_reports(reports, group=mpu.get_data_parallel_group(with_context_parallel=True))
    metrics = broadcast_object_from_last_stage(metrics)
    metrics.update({"step/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
                    "step/optimizer_steps": float(steps - skipped), "step/skipped_steps": float(skipped),
                    "step/old_logprob_pass": float(plan == "pass"), "step/forward_calls": float(len(calls))})
    return metrics
