"""MoE: the router's z-loss and aux-loss gradient scale under TP x CP, per megatron-core release
(NVIDIA/Megatron-LM #1652, PR #5047), and the routers' metrics (RouterStats: moe/aux_loss,
moe/z_loss, moe/expert_tokens_*).

    with moe_aux_loss_compensation(model_config, padding_mask=True):   # around the schedule
        run_schedule(...)

With calculate_per_token_loss=True every gradient is divided by the step's tokens, so TopKRouter
multiplies the losses it attaches by a token count; under TP x CP (n ranks, a router copy each)
that count must be the group's valid tokens for the summed router gradient to equal one process's.
The factor each coefficient needs, read from router.py and moe_utils.py of each release:

    megatron-core                 z-loss   aux, padding mask   aux, no padding mask
    0.16.1, 0.17.1, 0.18.2        x n      x 1                 x n
    0.19.0 to main d98e8a64dd     x 1      x 1/n               x 1

Before PR #5047 the router divides the z-loss coefficient by n and multiplies by this rank's
tokens, and multiplies the aux loss by its `local_num_tokens`: this rank's count without a
padding mask, the group's with one (get_tokens_per_expert_and_token_count all-reduces the
per-expert counts in place, so its "local" sum is the group's). PR #5047 (core_v0.19.0 only)
multiplies both by n: right for the z-loss and an unmasked aux loss, n times too much for a
masked one. policy_step always passes a padding mask. "aux" is 'aux_loss' (pinned by
tests/distributed/test_moe_aux_loss.py: the router update equals one process's at tp2-sp, cp2
and ep2 on 0.16.1 and 0.19.2, and was run once on 0.17.1 and 0.18.2) and 'seq_aux_loss' (the
same count and scaling, read only); 'global_aux_loss' counts over DP too and is left alone.
The coefficients are scaled while the schedule runs (the router reads them at forward time).
"""
from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap
import warnings
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .groups import default_groups
from .reduce import all_reduce_in

# The newest release read: main d98e8a64dd (0.20.0 in development) reads as 0.19.0 too, but a
# release after 0.19 may change what the probe below cannot see (e.g. the in-place count).
NEWEST_READ = (0, 19)
GROUP_COUNTED = ("aux_loss", "seq_aux_loss")  # aux-loss kinds whose token count spans TP x CP only


def _megatron_version() -> tuple[int, int]:
    from ..mcore import installed_version

    return installed_version()[:2]


@functools.cache
def router_scales_by_group_size() -> bool:
    """Whether the installed TopKRouter carries PR #5047 (core_v0.19.0): it multiplies the losses
    it attaches by its tp_cp_group size, where 0.16-0.18 name no group size in that method. The
    same PR changed the z-loss's scale (apply_z_loss; read in 0.19.0 and main), so one probe serves.
    Read off the installed source (the release number only where no source is shipped), so a
    newer release gets the newest behaviour read; it also warns once (rank 0), as the table
    may no longer hold there."""
    from megatron.core.transformer.moe.router import TopKRouter

    version = _megatron_version()
    if version > NEWEST_READ and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(f"megatron-core {version[0]}.{version[1]}: the MoE aux/z-loss scaling under TP x CP was "
                      "read for 0.16-0.19 and main d98e8a64dd only (step/moe.py); check it with "
                      "tests/distributed/test_moe_aux_loss.py", stacklevel=2)
    try:  # the code only: 0.19's comments name tp_cp_group.size() too
        source = ast.unparse(ast.parse(textwrap.dedent(inspect.getsource(TopKRouter.attach_and_log_load_balancing_loss))))
    except (OSError, TypeError):
        return version >= (0, 19)
    return "self.tp_cp_group.size()" in source


def loss_factors(config, *, padding_mask: bool) -> tuple[float, float]:
    """(z-loss factor, aux-loss factor) that the installed megatron-core needs on the coefficients
    for TP x CP router gradients to equal one process's (the table above); (1, 1) for a dense
    model or TP x CP = 1."""
    n = config.tensor_model_parallel_size * config.context_parallel_size
    if getattr(config, "num_moe_experts", None) is None or n == 1:
        return 1.0, 1.0
    if router_scales_by_group_size():
        return 1.0, 1.0 / n if padding_mask else 1.0
    return float(n), 1.0 if padding_mask else float(n)


def _scaled_aux_coeff(config, factor: float):
    """moe_aux_loss_coeff (a float, or one per moe_router_load_balancing_type) with the
    GROUP_COUNTED kinds' coefficients times `factor`."""
    kind, coeff = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    if isinstance(coeff, (list, tuple)):
        kinds = list(kind) if isinstance(kind, (list, tuple)) else [kind] * len(coeff)
        return type(coeff)(c * factor if k in GROUP_COUNTED else c for k, c in zip(kinds, coeff))
    return coeff * factor if kind in GROUP_COUNTED else coeff


@contextlib.contextmanager
def moe_aux_loss_compensation(config, *, padding_mask: bool) -> Iterator[tuple[float, float]]:
    """Scale config.moe_z_loss_coeff and config.moe_aux_loss_coeff by `loss_factors(config,
    padding_mask=...)` for the duration of the block (padding_mask: whether the schedule hands
    the router a padding mask); yields the two factors."""
    z_factor, aux_factor = loss_factors(config, padding_mask=padding_mask)
    saved = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
    if aux_factor != 1.0:
        config.moe_aux_loss_coeff = _scaled_aux_coeff(config, aux_factor)
    if z_factor != 1.0 and saved[1] is not None:
        config.moe_z_loss_coeff = saved[1] * z_factor
    try:
        yield z_factor, aux_factor
    finally:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = saved


@contextlib.contextmanager
def no_aux_loss_without_tokens(config, n_seqs: Optional[int]) -> Iterator[None]:
    """Around one microbatch's forward: an MoE model's all-padding bin (n_seqs = 0: the filler that
    evens packed bin counts over DP, so that the EP all-to-alls stay in step) runs with the
    aux-loss coefficient at 0. megatron-core's Switch loss over no token is 0/0, and its NaN
    gradient would skip the optimizer step on every rank; having no token, the bin adds nothing
    to the loss either way. Nothing changes for a dense model, a bin with rows, or n_seqs None
    (not given: a hand-built microbatch keeps its aux loss)."""
    if n_seqs != 0 or getattr(config, "num_moe_experts", None) is None:
        yield
        return
    saved = config.moe_aux_loss_coeff
    config.moe_aux_loss_coeff = [0.0] * len(saved) if isinstance(saved, (list, tuple)) else 0.0
    try:
        yield
    finally:
        config.moe_aux_loss_coeff = saved


AUX, Z = "load_balancing_loss", "z_loss"  # megatron-core's tracker names (router.py)


def _aux_loss_coeff(config) -> float:
    """TopKRouter.get_aux_loss_coeff("aux_loss") read off the config, so that a rank without a
    router decides as the others do."""
    kind, coeff = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    if isinstance(kind, (list, tuple)):
        return coeff[list(kind).index("aux_loss")] if "aux_loss" in kind else 0.0
    return coeff if kind == "aux_loss" else 0.0


class RouterStats:
    """The moe/ metrics of one policy step, from what megatron-core's routers computed.

        stats = RouterStats.of(chunks, pg)   # None for a dense model; pg: step/groups.py
        with stats:                          # around the training schedules
            run_schedule(...)                # forward_step calls stats.start(n_seqs, model) first
        metrics.update(stats.reduce())       # every rank; collectives over TP x CP, PP and DP

    Per microbatch with rows and per layer it records the router's aux loss (the Switch
    load-balancing loss of the microbatch, unscaled by its coefficient, as the router hands it to
    its logging tracker: this rank's share, summed over TP x CP), its z-loss times the
    valid tokens it averaged over, and the valid tokens routed to each expert. Training forwards
    only (the router computes neither loss in eval or no-grad passes).
    """

    def __init__(self, routers: list, config, device: torch.device, pg):
        self.routers, self.config, self.device, self.pg = routers, config, device, pg  # routers: this rank's, maybe none
        self.layers = config.num_layers + (config.mtp_num_layers or 0)
        self.rows: list[Tensor] = []  # per live microbatch: [3, L] aux, z * tokens, tokens
        self.seen: dict[int, int] = {}  # id(model chunk) -> live microbatches it has run
        self.counts = torch.zeros(self.layers, config.num_moe_experts, dtype=torch.float64, device=self.device)
        self.live, self.row, self.hooks, self.valid = False, None, [], {}  # valid: layer -> [tokens] bool

    @classmethod
    def of(cls, chunks, pg_collection=None) -> Optional["RouterStats"]:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.utils import get_model_config

        config = get_model_config(chunks[0])
        if not getattr(config, "num_moe_experts", None):
            return None
        # Decided by the config, the same on every rank: a PP stage of dense layers (moe_layer_freq)
        # has no router but must still join reduce()'s collectives, or the other stages hang there.
        routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        return cls(routers, config, next(chunks[0].parameters()).device, default_groups(pg_collection))

    def start(self, n_seqs: Optional[int], chunk=None) -> None:
        """A microbatch of n_seqs sequences begins on model chunk `chunk` (an all-padding bin, n_seqs
        = 0, is not counted; None, not given, is). The interleaved schedule runs every microbatch
        once per chunk, in the same order on each, so the k-th microbatch a chunk sees writes row
        k: one row per microbatch, whatever vp is."""
        self.live = n_seqs != 0
        if self.live:
            k = self.seen.get(id(chunk), 0)
            self.seen[id(chunk)] = k + 1
            if k == len(self.rows):
                self.rows.append(torch.zeros(3, self.layers, dtype=torch.float64, device=self.device))
            self.row = self.rows[k]

    def _record(self, name: str, loss: Tensor, layer_number, *args, **kwargs):
        if self.live and layer_number is not None and name in (AUX, Z):
            row, value = self.row, loss.detach().double()
            if name == AUX:
                row[0, layer_number - 1] += value
            else:  # the router's mean over its valid tokens, back to a sum
                tokens = self.valid[layer_number].sum().double()
                row[1, layer_number - 1] += value * tokens
                row[2, layer_number - 1] += tokens
        return self._save(name, loss, layer_number, *args, **kwargs)

    def __enter__(self):
        from megatron.core.transformer.moe import router as router_module

        def before(router, args):  # MoELayer.route calls router(hidden_states, padding_mask), [s, b]
            pad = args[1] if len(args) > 1 else None
            valid = torch.ones(args[0].shape[:2], dtype=torch.bool, device=args[0].device) if pad is None else ~pad
            self.valid[router.layer_number] = valid.reshape(-1)

        def after(router, args, output):  # output: (probs, routing_map [tokens, experts] bool)
            if self.live and router.training and torch.is_grad_enabled():
                routed = output[1] & self.valid[router.layer_number][:, None]
                self.counts[router.layer_number - 1] += routed.sum(0).double()

        for r in self.routers:
            self.hooks += [r.register_forward_pre_hook(before), r.register_forward_hook(after)]
        # Where the router hands its losses for logging: megatron-core 0.18+ calls
        # get_moe_metrics_tracker().record(name, value, layer_number, ...), a method of the tracker
        # object; 0.16-0.17 the module function save_to_aux_losses_tracker (same leading arguments).
        if hasattr(router_module, "get_moe_metrics_tracker"):
            owner, attr = router_module.get_moe_metrics_tracker(), "record"  # mcore-optional: 0.18+
        else:
            owner, attr = router_module, "save_to_aux_losses_tracker"
        self._site, self._save = (owner, attr, vars(owner).get(attr)), getattr(owner, attr)
        setattr(owner, attr, self._record)
        return self

    def __exit__(self, *exc):
        owner, attr, own = self._site  # own: None where the attribute is the tracker class's method
        if own is None:
            delattr(owner, attr)
        else:
            setattr(owner, attr, own)
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def reduce(self) -> dict[str, float]:
        """moe/aux_loss and moe/z_loss (with the router's coefficient > 0 / set): per MoE layer the
        mean over the step's microbatches (with rows) of the microbatch's value, then the mean over
        MoE layers, as megatron's track_moe_metrics averages the aux loss (sum over TP x CP, mean
        over microbatches and DP, sum over layers / MoE layers). The z-loss of a microbatch is the
        router's mean of logsumexp^2 over its valid tokens on all TP x CP ranks (megatron logs one
        rank's mean unreduced, which depends on the layout). moe/expert_tokens_max / _min: valid
        tokens routed to the busiest / idlest expert, summed over every training forward of the step
        (each epoch counts the batch again), per layer, then max / min over MoE layers.
        Collectives: SUM over TP x CP, PP, then DP (one fp64 buffer each); one host sync."""
        m = len(self.rows)
        rows = torch.stack(self.rows) if m else torch.zeros(0, 3, self.layers, dtype=torch.float64,
                                                              device=self.device)
        buf = torch.cat([rows.reshape(-1), self.counts.reshape(-1)])
        for group in (self.pg.tp_cp, self.pg.pp):
            all_reduce_in(buf, dist.ReduceOp.SUM, group)  # every rank of these holds the same microbatches
        rows, counts = buf[:rows.numel()].view(m, 3, self.layers), buf[rows.numel():].view(self.counts.shape)
        z = torch.where(rows[:, 2] > 0, rows[:, 1] / rows[:, 2].clamp(min=1), 0.0)
        per_layer = torch.cat([rows[:, 0].sum(0), z.sum(0), torch.tensor([m], dtype=torch.float64,
                                                                           device=self.device), counts.reshape(-1)])
        all_reduce_in(per_layer, dist.ReduceOp.SUM, self.pg.dp)
        aux, z, total, counts = per_layer[:self.layers], per_layer[self.layers:2 * self.layers], \
            per_layer[2 * self.layers], per_layer[2 * self.layers + 1:].view(self.counts.shape)
        moe = counts.sum(1) > 0  # the MoE layers (a dense layer routes nothing)
        out = {"moe/expert_tokens_max": counts[moe].max(1).values.max(),
               "moe/expert_tokens_min": counts[moe].min(1).values.min()}
        if _aux_loss_coeff(self.config) > 0:
            out["moe/aux_loss"] = aux[moe].mean() / total
        if self.config.moe_z_loss_coeff is not None:
            out["moe/z_loss"] = z[moe].mean() / total
        return {k: float(v) for k, v in zip(out, torch.stack(list(out.values())).tolist())}
