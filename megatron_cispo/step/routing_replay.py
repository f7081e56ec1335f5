"""R3, MoE routing replay (arXiv 2510.11370): the trainer's routers take the sampler's routes.

    with RoutingReplay.of(chunks, batch, mode) as replay:  # policy_step, around every schedule
        run_schedule(...)   # forward_step_for: `with replay_routes(model, mb)` around the model
    metrics.update(replay.reduce())

Seam: megatron-core's TopKRouter hands its top-k to `router.router_replay.get_replay_topk(scores,
topk, num_groups, group_topk, default_compute_topk)` when `router_replay` is set (0.16.1 and
0.19.2, moe_utils.topk_routing_with_score_function). We set it to a LayerReplay per router
instead of turning on moe_enable_routing_replay: megatron's RouterReplay keeps every instance in
one global list (one per model ever built) and has no per-token fallback (-1 would index out of
range). The probabilities are gathered from the dense scores at the replayed experts, so the
router weight keeps its gradient (replaying post-top-k probabilities would cut it).
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..schema import ConfigError
from .groups import default_groups, rank, size
from .reduce import all_reduce_in

_ATTR = "_cispo_layer_replays"  # cache of a model chunk's LayerReplays


def moe_layer_numbers(config) -> list[int]:
    """Global 1-based numbers of the MoE layers, in model order (megatron's moe_layer_freq: an int
    k makes every k-th layer from the first MoE, a list is the 0/1 pattern)."""
    freq = getattr(config, "moe_layer_freq", 1)
    pattern = [int(i % freq == 0) for i in range(config.num_layers)] if isinstance(freq, int) else list(freq)
    return [i + 1 for i, moe in enumerate(pattern) if moe]


class BadRoutes(ValueError):
    """Rollouts.routed_experts that disagree with the model. policy_step raises it on every rank
    with the same message; a launcher prints it once (train.py does, from rank 0)."""


def check_routes(routes: Tensor, config, row_ids: Optional[Tensor] = None) -> Optional[str]:
    """The first problem of routes [n, s, L, k] against the model (None: fine): L MoE layers and
    top_k, expert ids in [0, num_experts) or -1, no expert twice within one routed token. Host sync.
    row_ids [n]: each row's global sample index, named in the message (default: the row)."""
    layers, k, experts = len(moe_layer_numbers(config)), config.moe_router_topk, config.num_moe_experts
    if tuple(routes.shape[2:]) != (layers, k):
        return (f"rollouts.routed_experts has shape {tuple(routes.shape)}; the model has {layers} MoE layers "
                f"and top_k={k}: expected [n, s, {layers}, {k}]")
    routed = (routes >= 0).all(-1, keepdim=True).expand_as(routes)
    bad = (routes >= experts) | (routes < -1)
    what = f"is outside [0, {experts}) (-1: no route)"
    if not bool(bad.any()):  # a duplicate: sorted neighbours equal within a routed token
        srt = routes.sort(-1).values
        bad = torch.cat([srt[..., 1:] == srt[..., :-1], torch.zeros_like(srt[..., :1], dtype=torch.bool)], -1)
        bad &= routed
        what = "appears twice in one token's top_k"
    if not bool(bad.any()):
        return None
    row, pos, layer, slot = (int(i) for i in bad.nonzero()[0])
    expert = int(routes.sort(-1).values[row, pos, layer, slot]) if "twice" in what else int(routes[row, pos, layer, slot])
    sample = row if row_ids is None else int(row_ids[row])
    return (f"rollouts.routed_experts: sample {sample} (global index), MoE layer {layer} (model layer "
            f"{moe_layer_numbers(config)[layer]}), position {pos}: expert {expert} {what}; the routes must "
            f"come from this model's sampler")


class LayerReplay:
    """One router's replay: megatron's `router_replay` seam. The given routes [tokens, k] replace
    the router's top-k where a token has one (no -1); other tokens keep the router's own. With
    replace=False it only measures. Training forwards count, per token that is valid (not
    padding): the routed tokens whose own top-k set differs from the given one, the routed
    tokens, and the fallbacks (tokens with a -1)."""

    def __init__(self, moe_index: int, device, block_index: Optional[int] = None):
        self.moe_index, self.block_index, self.replace = moe_index, block_index, True  # block_index: in its chunk
        self.routes: Optional[Tensor] = None
        self.valid: Optional[Tensor] = None
        self.counting = False
        self.fifo: list[tuple[Tensor, Tensor]] = []  # a training forward's routes, for its backward recompute
        self.counts = torch.zeros(3, dtype=torch.float64, device=device)

    def set(self, routes: Tensor, valid: Tensor, *, training: bool, recompute: bool = False) -> None:
        """recompute: whether megatron reruns this router in the backward (then the routes wait for it)."""
        self.routes, self.valid, self.counting = routes, valid, training
        if recompute and training and torch.is_grad_enabled():
            self.fifo.append((routes, valid))

    def clear(self) -> None:
        self.routes = self.valid = None
        self.counting = False

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[Tensor, Tensor]:
        own, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        routes, valid, count = self.routes, self.valid, self.counting
        if routes is None and self.fifo and torch.is_grad_enabled():
            (routes, valid), count = self.fifo.pop(0), False  # activation recompute in the backward
        if routes is None:
            return own, idx
        if routes.shape[0] != idx.shape[0]:
            raise RuntimeError(f"routing replay: the router saw {idx.shape[0]} tokens, the microbatch has "
                               f"{routes.shape[0]} routes for it")
        routed = (routes >= 0).all(-1)
        if count:
            differs = (idx.sort(-1).values != routes.sort(-1).values).any(-1) & routed & valid
            self.counts += torch.stack([differs.sum(), (routed & valid).sum(), (~routed & valid).sum()]).double()
        if not self.replace:
            return own, idx
        idx = torch.where(routed[:, None], routes, idx)
        return scores.gather(1, idx), idx  # dense scores: the router weight keeps its gradient


def _seam_missing() -> Optional[str]:
    """Why the installed megatron-core has no router_replay seam (None: it has)."""
    from megatron.core.transformer.moe import moe_utils

    if "router_replay" not in inspect.signature(moe_utils.topk_routing_with_score_function).parameters:
        return "this megatron-core has no router_replay seam in topk_routing_with_score_function (0.16+ has)"
    return None


def cuda_graphs(config) -> Optional[str]:
    """The CUDA-graph setting that is on (None: off). A captured router replays its kernels and
    never calls the Python seam, so routes would be ignored without a word. enable_cuda_graph and
    external_cuda_graph are 0.16-0.19's deprecated spellings of cuda_graph_impl (probed: either may go)."""
    for name in ("enable_cuda_graph", "external_cuda_graph"):
        if getattr(config, name, False):
            return f"{name}=True"
    impl = getattr(config, "cuda_graph_impl", None)
    return None if impl in (None, "none") else f"cuda_graph_impl={impl!r}"


def unusable(config) -> Optional[str]:
    """Why this model's routers cannot take or measure replayed routes (None: they can)."""
    if config.moe_router_fusion or getattr(config, "moe_router_load_balancing_type", None) == "sinkhorn":
        return "routing replay needs the unfused top-k router (moe_router_fusion off, no sinkhorn)"
    graphs = cuda_graphs(config)
    if graphs:
        return (f"CUDA graphs are on ({graphs}): a captured router never calls the replay seam; set "
                "cuda_graph_impl='none' (and enable_cuda_graph/external_cuda_graph off)")
    return _seam_missing()


def install(chunk, config) -> list[LayerReplay]:
    """The LayerReplays on `chunk`'s routers (made on first use, kept on the chunk)."""
    if hasattr(chunk, _ATTR):
        return getattr(chunk, _ATTR)
    from megatron.core.transformer.moe.router import TopKRouter

    problem = unusable(config)
    if problem:
        raise ValueError(f"loss.routing_replay: {problem}")
    index = {n: j for j, n in enumerate(moe_layer_numbers(config))}
    device = next(chunk.parameters()).device
    # each router's layer's index in its block (the chunk's decoder.layers): what 'block' recompute counts
    position = {id(r): i for m in chunk.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)
                for i, layer in enumerate(m.layers) for r in layer.modules() if isinstance(r, TopKRouter)}
    out = []
    for router in (m for m in chunk.modules() if isinstance(m, TopKRouter)):
        if router.layer_number not in index:  # an MTP layer's router: not in the sampler's routes
            continue
        if getattr(router, "router_replay", None) is not None and not isinstance(router.router_replay, LayerReplay):
            raise ValueError("loss.routing_replay: the model was built with moe_enable_routing_replay; "
                             "turn it off (step.routing_replay sets the routers' replay itself)")
        router.router_replay = LayerReplay(index[router.layer_number], device, position.get(id(router)))
        out.append(router.router_replay)
    setattr(chunk, _ATTR, out)
    return out


def recomputes_router(config, block_index: Optional[int] = None) -> bool:
    """Whether megatron reruns the MoE router of the layer at block_index (in its chunk's block;
    None: unknown, taken as rerun) in the backward: full-layer recompute ('uniform': every layer;
    'block': the block's first recompute_num_layers, transformer_block.py / recompute.py), or
    selective with 'moe' (moe_layer.py; 'moe_act' reruns the expert activation only). Not
    followed: fp8/fp4 'block' recompute shifting past layers whose input needs no gradient; a
    route queued for a layer that does not rerun only waits until the step ends (a memory cost)."""
    granularity = getattr(config, "recompute_granularity", None)
    if granularity == "full":
        return (getattr(config, "recompute_method", None) != "block" or block_index is None
                or block_index < (config.recompute_num_layers or 0))
    return granularity == "selective" and "moe" in (config.recompute_modules or ())


def local_routes(routes: Tensor, padding_mask: Optional[Tensor], config, tp_group) -> tuple[Tensor, Tensor]:
    """A microbatch's routes [b, s, L, k] and padding [b, s] (True = pad) as the router sees its
    tokens: [s_local * b, L, k] and valid [s_local * b], s-major, this TP rank's sequence slice
    under sequence parallelism (the MoE layer routes its [s/tp, b, h] shard). tp_group: the model's."""
    routes = routes.transpose(0, 1)
    valid = (torch.ones(routes.shape[:2], dtype=torch.bool, device=routes.device) if padding_mask is None
             else ~padding_mask.transpose(0, 1).bool())
    tp = size(tp_group)
    if config.sequence_parallel and tp > 1:
        part, tp_rank = routes.shape[0] // tp, rank(tp_group)
        routes, valid = routes[tp_rank * part:(tp_rank + 1) * part], valid[tp_rank * part:(tp_rank + 1) * part]
    return routes.reshape(-1, *routes.shape[2:]).long(), valid.reshape(-1)  # gather takes int64


@contextlib.contextmanager
def replay_routes(model, mb, pg) -> Iterator[None]:
    """Around one microbatch's model forward: hand its routes (mb.routed_experts) to this chunk's
    routers and take them back after. Nothing for a microbatch without routes. pg: step/groups.py."""
    if mb.routed_experts is None:
        yield
        return
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    layers = install(model, config)
    routes, valid = local_routes(mb.routed_experts, mb.padding_mask, config, pg.tp)
    for layer in layers:
        layer.set(routes[:, layer.moe_index], valid, training=model.training,
                  recompute=recomputes_router(config, layer.block_index))
    try:
        yield
    finally:
        for layer in layers:
            layer.clear()


class RoutingReplay:
    """A policy step's replay: mode 'rollout' replaces, 'off' only measures the mismatch (when the
    rollouts carry routes). Its metrics (reduce): moe/route_mismatch (routed valid tokens whose
    trainer top-k set differs from the sampler's: the router's own top-k given the replayed upstream
    layers, over all MoE layers),
    moe/route_mismatch_l{j} per MoE layer j, moe/replay_fallback_frac (valid tokens with -1, over
    all valid tokens) and moe/replay_fallbacks; training forwards only, each epoch counts again."""

    def __init__(self, layers: list[LayerReplay], config, replace: bool, device, pg):
        self.layers, self.config, self.replace, self.device, self.pg = layers, config, replace, device, pg

    @classmethod
    def of(cls, chunks, batch, mode: str, pg_collection=None, row_ids: Optional[Tensor] = None) -> Optional["RoutingReplay"]:
        """None when the batch has no routes (mode 'rollout' then refused), the model is dense, or
        mode is 'off' and the routers cannot be measured (unusable: fused or sinkhorn router, CUDA
        graphs, no seam; said once, and the routes are ignored; 'rollout' is refused then).
        chunks: every model whose passes score the rollouts (policy and reference). Routes that
        disagree with the model raise BadRoutes on every rank with the same message, naming the
        sample by row_ids (global indices; one MAX over DP, and on failure one all_gather_object).
        pg_collection: the model's process groups (step/groups.py; default megatron's)."""
        from megatron.core.utils import get_model_config

        config = get_model_config(chunks[0])
        dense = not getattr(config, "num_moe_experts", None)
        if mode == "rollout" and (dense or batch.routed_experts is None):  # ConfigError: one line, exit 2
            raise ConfigError("loss.routing_replay='rollout' replays the sampler's MoE routes: "
                             + ("the model is dense (no model.num_moe_experts); set it to 'off'" if dense else
                                "the rollouts carry no routed_experts; have the sampler return them or set 'off'"))
        if dense or batch.routed_experts is None:
            return None
        problem = unusable(config)
        if problem and mode == "rollout":
            raise ConfigError(f"loss.routing_replay='rollout': {problem}")
        if problem:
            if not dist.is_initialized() or dist.get_rank() == 0:  # warnings shows it once per process
                warnings.warn(f"loss.routing_replay='off': the rollouts' routed_experts are ignored and "
                              f"moe/route_mismatch is not measured: {problem}", RuntimeWarning, stacklevel=2)
            return None
        pg = default_groups(pg_collection)
        _refuse_bad_routes(check_routes(batch.routed_experts, config, row_ids), batch.tokens.device, pg.dp)
        layers = [layer for c in chunks for layer in install(c, get_model_config(c))]
        return cls(layers, config, mode == "rollout", batch.tokens.device, pg)

    def __enter__(self):
        for layer in self.layers:
            layer.replace, layer.fifo = self.replace, []
            layer.counts.zero_()
        return self

    def __exit__(self, *exc):
        for layer in self.layers:
            layer.replace, layer.fifo = True, []
            layer.clear()

    def reduce(self) -> dict[str, float]:
        """Exact global fractions: SUM over TP x CP (this rank's tokens; without sequence parallel
        the TP ranks route the same tokens and only TP rank 0 counts), PP, then DP. One host sync."""
        count = torch.zeros(len(moe_layer_numbers(self.config)), 3, dtype=torch.float64, device=self.device)
        if self.config.sequence_parallel or rank(self.pg.tp) == 0:
            for layer in self.layers:
                count[layer.moe_index] += layer.counts
        for group in (self.pg.tp_cp, self.pg.pp, self.pg.dp):
            all_reduce_in(count, dist.ReduceOp.SUM, group)
        differs, routed, fallback = count.unbind(1)
        frac = lambda a, b: a / b.clamp(min=1)  # noqa: E731  (0 where nothing was routed)
        out = {"moe/route_mismatch": frac(differs.sum(), routed.sum()),
               "moe/replay_fallback_frac": frac(fallback.sum(), (routed + fallback).sum()),
               "moe/replay_fallbacks": fallback.sum(),
               **{f"moe/route_mismatch_l{j}": frac(differs[j], routed[j]) for j in range(count.shape[0])}}
        return dict(zip(out, torch.stack(list(out.values())).tolist()))


def _refuse_bad_routes(problem: Optional[str], device, dp_group) -> None:
    """BadRoutes on every rank, with the first DP rank's problem, when any DP rank has one (the
    model-parallel ranks of one DP rank hold the same rows, so they agree)."""
    flag = all_reduce_in(torch.tensor([problem is not None], device=device), dist.ReduceOp.MAX, dp_group)
    if not bool(flag):
        return
    found = [problem]
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        found = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(found, problem, group=dp_group)
    raise BadRoutes(next(p for p in found if p is not None))
