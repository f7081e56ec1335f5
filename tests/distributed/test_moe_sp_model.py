"""MoE with expert parallelism, and sequence parallelism, on real megatron-core (CPU over gloo).

One SGD step of a tiny MoE GPT (4 experts, top-2) and a dense GPT through
get_forward_backward_func; every layout must reproduce the single-process loss, grad norm and
post-step parameters, and the layout-independent init must give the same full state at any ep.
One spawn per parallel layout runs all of that layout's cases; spawn's forkserver has imported
megatron already, so a launch costs no imports.
"""
import pytest
import torch

from megatron_cispo.testing import spawn
from test_foundation import S, V, lm_train_step  # the dense layouts' batch and step

EXPERTS, TOPK = 4, 2
ROUTER_SCALE = 50.0  # router std 0.02 -> 1: top-k decisions far from ties (checked: MIN_ROUTER_GAP)
MIN_ROUTER_GAP = 1e-3  # logit gap between the k-th and (k+1)-th expert; layouts differ by ~1e-6
TOL = 1e-5

# name: (world size, tp, ep, sequence_parallel, moe)
CASES = {
    "moe_ep2": (2, 1, 2, False, True),
    "dense_tp2_sp": (2, 2, 1, True, False),
    "moe_tp2_sp": (2, 2, 1, True, True),
    "moe_tp2_ep2_sp": (4, 2, 2, True, True),  # uneven TP gathers in the alltoall dispatcher
}


def _model_config(moe: bool):
    from megatron_cispo.runner.model import ModelConfig

    return ModelConfig(vocab_size=V, seq_length=S, hidden_size=32, num_layers=2, num_attention_heads=4,
                       num_moe_experts=EXPERTS if moe else None, moe_router_topk=TOPK)


def _watch_router_gaps(chunks, gaps: list):
    """Record, per router call, the smallest logit gap between the k-th and (k+1)-th expert."""
    from megatron.core.transformer.moe.router import TopKRouter

    def hook(router, args):
        x = args[0].detach().float().reshape(-1, router.weight.shape[1])
        top = (x @ router.weight.detach().float().t()).topk(TOPK + 1, dim=-1).values
        gaps.append((top[:, TOPK - 1] - top[:, TOPK]).min().item())

    for c in chunks:
        for m in c.modules():
            if isinstance(m, TopKRouter):
                m.register_forward_pre_hook(hook)


def _one_step(moe: bool, *, tp: int, ep: int, sp: bool) -> dict:
    """Build, scale the routers, run one 1F1B step with a plain cross-entropy loss, SGD-step."""
    from megatron_cispo.runner.model import build_model, build_optimizer
    from megatron_cispo.base.weights import gather_full_state

    chunks = build_model(_model_config(moe), tp=tp, pp=1, ep=ep, sequence_parallel=sp, seed=7)
    with torch.no_grad():
        for c in chunks:
            for name, p in c.named_parameters():
                if name.endswith("router.weight"):
                    p.mul_(ROUTER_SCALE)  # replicated, so every layout scales the same weights
    initial = gather_full_state(chunks)
    gaps: list[float] = []
    _watch_router_gaps(chunks, gaps)
    opt = build_optimizer(chunks, lr=0.5, optimizer="sgd", clip_grad=0.0)
    lm, grad_norm = lm_train_step(chunks, opt)
    return {"lm": lm, "grad_norm": grad_norm,
            "initial": initial, "state": gather_full_state(chunks), "min_gap": min(gaps, default=None)}


def cases_worker(tp, ep, names):
    """Run the named cases, which share this (tp, ep) layout; a process group is set up once per
    process (re-creating one on the same port can race)."""
    from megatron_cispo.runner import distributed

    distributed.init_distributed(tp=tp, ep=ep)
    return {name: _one_step(CASES[name][4], tp=tp, ep=ep, sp=CASES[name][3]) for name in names}


def reference_worker():
    from megatron_cispo.runner import distributed

    distributed.init_distributed()
    return {"moe": _one_step(True, tp=1, ep=1, sp=False), "dense": _one_step(False, tp=1, ep=1, sp=False)}


@pytest.fixture(scope="module")
def reference():
    return spawn(reference_worker, 1)[0]


_RUNS: dict[tuple, list[dict]] = {}


def _results(name: str) -> list[dict]:
    """Per-rank results of case `name`; the first case of a layout runs all of that layout's."""
    layout = CASES[name][:3]
    if layout not in _RUNS:
        names = [n for n, c in CASES.items() if c[:3] == layout]
        _RUNS[layout] = spawn(cases_worker, layout[0], (*layout[1:], names))
    return [r[name] for r in _RUNS[layout]]


@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_single_process(reference, name):
    _, tp, _, _, moe = CASES[name]
    results = _results(name)
    ref = reference["moe" if moe else "dense"]
    if moe:
        assert min(r["min_gap"] for r in results) > MIN_ROUTER_GAP
        assert ref["min_gap"] > MIN_ROUTER_GAP
    # every TP rank reports the full (loss_sum, tokens) of its DP shard
    tot = torch.stack([r["lm"] for r in results]).sum(0)
    assert tot[1] == ref["lm"][1] * tp
    torch.testing.assert_close(tot[0] / tot[1], ref["lm"][0] / ref["lm"][1], rtol=0, atol=TOL)
    for r in results:
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=TOL)
    state = results[0]["state"]
    assert set(state) == set(ref["state"])
    for k, v in ref["state"].items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=TOL, msg=k)
    # the step really moved the weights, experts and router included
    moved = {k: (ref["state"][k] - ref["initial"][k]).abs().max().item() for k in ref["state"]}
    assert max(moved.values()) > 1e-3
    if moe:
        assert min(v for k, v in moved.items() if "router" in k or "experts" in k) > 0


def test_layout_independent_init_is_the_same_at_ep2(reference):
    ref = reference["moe"]["initial"]
    for r in _results("moe_ep2"):
        state = r["initial"]
        # each rank builds 2 of the 4 experts; the gathered state has all 4 under global indices
        experts = {k.split(".local_experts.")[1].split(".")[0] for k in state if ".local_experts." in k}
        assert experts == {"0", "1", "2", "3"}
        assert set(state) == set(ref)
        for k, v in ref.items():
            assert torch.equal(state[k], v), k
