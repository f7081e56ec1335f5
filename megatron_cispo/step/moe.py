"""MoE: the z-loss (and aux-loss) scaling under TP x CP on megatron-core 0.16 (NVIDIA/Megatron-LM
#1652), and the routers' metrics (RouterStats: moe/aux_loss, moe/z_loss, moe/expert_tokens_*).

    with moe_aux_loss_compensation(model_config, padding_mask=True):   # around the schedule
        run_schedule(...)

With calculate_per_token_loss=True, megatron-core 0.16.1 divides the z-loss coefficient by the
TP x CP size (router.py:486) and scales it by the tokens this rank routed (router.py:497), so its
summed gradient comes out divided by TP x CP. The aux loss is scaled by `local_num_tokens`:
without a padding mask that is this rank's count (moe_utils.py:231), the same bug; with one it is
the whole TP x CP group's valid count (moe_utils.py:223-228 all-reduce the counts in place),
which is already right. policy_step always passes the router a padding mask, so only the z-loss
needs the factor there. Upstream PR #5047 changes the scale; until the installed megatron-core has
it, the coefficients are multiplied while the schedule runs (the router reads them at forward
time), then restored. tests/distributed/test_moe_aux_loss.py pins both against one process.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .reduce import all_reduce_in

# First megatron-core release assumed to carry PR #5047 (merged 2026-05-28, after 0.16.1); not
# verified here (0.16.1 is the newest release for Python 3.11), hence the warning on newer ones.
FIXED_IN = (0, 17)


def _megatron_version() -> tuple[int, int]:
    from megatron.core import package_info

    return int(package_info.MAJOR), int(package_info.MINOR)


def aux_loss_scale(config) -> int:
    """The factor the installed megatron-core leaves out of MoE z-loss gradients (and of aux-loss
    gradients without a padding mask): the TP x CP size on 0.16 (measured on 0.16.1), else 1.
    On newer releases the fix is assumed and a warning asks to confirm it with the test."""
    size = config.tensor_model_parallel_size * config.context_parallel_size
    if getattr(config, "num_moe_experts", None) is None or size == 1:
        return 1
    if _megatron_version() >= FIXED_IN:
        warnings.warn(f"megatron-core {'.'.join(map(str, _megatron_version()))}: MoE z/aux-loss scaling under "
                      "TP x CP is assumed fixed upstream (PR #5047) and not compensated; confirm with "
                      "tests/distributed/test_moe_aux_loss.py", stacklevel=2)
        return 1
    return size


@contextlib.contextmanager
def moe_aux_loss_compensation(config, *, padding_mask: bool) -> Iterator[int]:
    """Scale config.moe_z_loss_coeff, and config.moe_aux_loss_coeff (a float or a per-type list)
    when the router gets no padding mask, by `aux_loss_scale(config)` for the duration of the
    block; yields the factor."""
    factor = aux_loss_scale(config)
    if factor == 1:
        yield 1
        return
    saved = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
    aux = saved[0]
    if not padding_mask:
        config.moe_aux_loss_coeff = [c * factor for c in aux] if isinstance(aux, (list, tuple)) else aux * factor
    config.moe_z_loss_coeff = None if saved[1] is None else saved[1] * factor
    try:
        yield factor
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

        stats = RouterStats.of(chunks)       # None for a dense model
        with stats:                          # around the training schedules
            run_schedule(...)                # forward_step calls stats.start(n_seqs, model) first
        metrics.update(stats.reduce())       # every rank; collectives over TP x CP, PP and DP

    Per microbatch with rows and per layer it records the router's aux loss (the Switch
    load-balancing loss of the microbatch, unscaled by its coefficient, as the router hands it to
    save_to_aux_losses_tracker: this rank's share, summed over TP x CP), its z-loss times the
    valid tokens it averaged over, and the valid tokens routed to each expert. Training forwards
    only (the router computes neither loss in eval or no-grad passes).
    """

    def __init__(self, routers: list, config, device: torch.device):
        self.routers, self.config, self.device = routers, config, device  # routers: this rank's, maybe none
        self.layers = config.num_layers + (config.mtp_num_layers or 0)
        self.rows: list[Tensor] = []  # per live microbatch: [3, L] aux, z * tokens, tokens
        self.seen: dict[int, int] = {}  # id(model chunk) -> live microbatches it has run
        self.counts = torch.zeros(self.layers, config.num_moe_experts, dtype=torch.float64, device=self.device)
        self.live, self.row, self.hooks, self.valid = False, None, [], {}  # valid: layer -> [tokens] bool

    @classmethod
    def of(cls, chunks) -> Optional["RouterStats"]:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.utils import get_model_config

        config = get_model_config(chunks[0])
        if not getattr(config, "num_moe_experts", None):
            return None
        # Decided by the config, the same on every rank: a PP stage of dense layers (moe_layer_freq)
        # has no router but must still join reduce()'s collectives, or the other stages hang there.
        routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        return cls(routers, config, next(chunks[0].parameters()).device)

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
        self._module, self._save = router_module, router_module.save_to_aux_losses_tracker
        router_module.save_to_aux_losses_tracker = self._record
        return self

    def __exit__(self, *exc):
        self._module.save_to_aux_losses_tracker = self._save
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
        from megatron.core import parallel_state as mpu

        m = len(self.rows)
        rows = torch.stack(self.rows) if m else torch.zeros(0, 3, self.layers, dtype=torch.float64,
                                                              device=self.device)
        buf = torch.cat([rows.reshape(-1), self.counts.reshape(-1)])
        for group in (mpu.get_tensor_and_context_parallel_group(), mpu.get_pipeline_model_parallel_group()):
            all_reduce_in(buf, dist.ReduceOp.SUM, group)  # every rank of these holds the same microbatches
        rows, counts = buf[:rows.numel()].view(m, 3, self.layers), buf[rows.numel():].view(self.counts.shape)
        z = torch.where(rows[:, 2] > 0, rows[:, 1] / rows[:, 2].clamp(min=1), 0.0)
        per_layer = torch.cat([rows[:, 0].sum(0), z.sum(0), torch.tensor([m], dtype=torch.float64,
                                                                           device=self.device), counts.reshape(-1)])
        all_reduce_in(per_layer, dist.ReduceOp.SUM, mpu.get_data_parallel_group())
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
