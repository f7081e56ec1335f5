"""The non-finite guard of policy_step on tp=2 x dp=2 gloo ranks.

A non-finite advantage on a trained target is refused on every rank before any schedule runs.
A loss or gradient that turns non-finite inside the step on one rank (a poisoned rollout on one
DP rank, a NaN weight on one TP rank) makes every rank skip the optimizer step: parameters and
optimizer state stay bit-identical and step/skipped_nonfinite is 1.
"""
import pytest
import torch

from megatron_cispo.step import Rollouts
from megatron_cispo.testing import spawn

N, S, V = 8, 9, 32
TP = 2


def make_batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, V, (N, S + 1), generator=g)
    pos = torch.arange(S)[None]
    loss_mask = (pos >= 3) & (pos < 3 + torch.randint(2, S - 3, (N, 1), generator=g))
    return tokens, loss_mask, torch.randn(N, generator=g)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()  # NaN == NaN, bit for bit


def _tensors(obj) -> list:
    """Every tensor of a (nested) optimizer state_dict, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def guard_worker():
    import warnings

    from megatron.core import parallel_state as mpu

    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.step import StepConfig, policy_step

    distributed.init_distributed(tp=TP)
    dp_rank, dp, tp_rank = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(), \
        mpu.get_tensor_model_parallel_rank()
    mcfg = ModelConfig(vocab_size=V, seq_length=S, hidden_size=32, num_layers=2, num_attention_heads=4)
    loss_cfg = from_dict(LossConfig, {"cispo": {"anchor": "old"}})
    step_cfg = StepConfig(micro_batch_size=2)
    tokens, loss_mask, adv = make_batch()
    out = {}

    def fresh():
        chunks = build_model(mcfg, tp=TP, pp=1, seed=3)
        return chunks, build_optimizer(chunks, lr=0.01, optimizer="adam", clip_grad=1.0)

    def shard(advantages):
        full = Rollouts(tokens=tokens, loss_mask=loss_mask, advantages=advantages)
        return full.dp_shard(dp_rank=dp_rank, dp=dp)

    def snapshot(chunks, opt):
        return [_bits(p) for p in chunks[0].parameters()] + [_bits(t) for t in _tensors(opt.state_dict())]

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    # 1. A NaN advantage on a trained row of DP rank 1 (global rows 4..7): refused everywhere, no forward.
    chunks, opt = fresh()
    before, calls = snapshot(chunks, opt), []
    bad_adv = adv.clone()
    bad_adv[N // dp + 1] = float("nan")  # DP rank 1's local row 1
    try:
        policy_step(chunks, opt, shard(bad_adv), loss_cfg, step_cfg, calls=calls)
        out["nan_advantage"] = None
    except ValueError as e:
        out["nan_advantage"] = str(e)
    out["nan_advantage_forwards"] = len(calls)
    out["nan_advantage_unchanged"] = same(snapshot(chunks, opt), before)

    # 2. A NaN advantage on an untrained target of [n, s] advantages is not an input error.
    per_token = adv[:, None].expand(N, S).clone()
    per_token[~loss_mask] = float("nan")
    out["untrained_nan"] = policy_step(chunks, opt, shard(per_token), loss_cfg, step_cfg)

    # 3. + 4.: one clean step (so Adam has state), then a step that turns non-finite on one rank.
    for case in ("poisoned_rollout", "nan_weight"):
        chunks, opt = fresh()
        policy_step(chunks, opt, shard(adv), loss_cfg, step_cfg)
        step_adv = adv.clone()
        if case == "poisoned_rollout":  # finite, so validation passes, but -A * logprob overflows fp32
            step_adv[N // dp] = 3e38
        elif tp_rank == 1 and dp_rank == 0:  # one element of one TP shard, on one rank of the four
            with torch.no_grad():
                chunks[0].module.decoder.layers[0].mlp.linear_fc1.weight[0, 0] = float("nan")
        before = snapshot(chunks, opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = policy_step(chunks, opt, shard(step_adv), loss_cfg, step_cfg)
        grads_zero = all(float(b.grad_data.abs().sum()) == 0 for b in chunks[0].buffers)
        out[case] = {"metrics": metrics, "unchanged": same(snapshot(chunks, opt), before), "grads_zero": grads_zero,
                     "warnings": [str(w.message) for w in caught if "skipped optimizer step" in str(w.message)]}
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(guard_worker, 2 * TP)


def test_nan_advantage_is_refused_on_every_rank_before_the_schedule(results):
    for rank, res in enumerate(results):
        msg = res["nan_advantage"]
        assert msg is not None, f"rank {rank} trained on a NaN advantage"
        assert msg.startswith("rollouts.advantages[row 1] = nan on rank 2 "), msg  # dp rank 1 = global ranks 2, 3
        assert "finite wherever loss_mask trains a target" in msg
        assert res["nan_advantage_forwards"] == 0 and res["nan_advantage_unchanged"], rank


def test_nan_advantage_on_an_untrained_target_trains_normally(results):
    for res in results:
        m = res["untrained_nan"]
        assert m["step/skipped_nonfinite"] == 0.0 and m["step/optimizer_steps"] == 1.0
        assert torch.isfinite(torch.tensor(m["policy/loss"])) and torch.isfinite(torch.tensor(m["step/grad_norm"]))


@pytest.mark.parametrize("case,first", [("poisoned_rollout", "loss"), ("nan_weight", "logits")])
def test_nonfinite_inside_the_step_is_skipped_on_every_rank(results, case, first):
    for rank, res in enumerate(results):
        r = res[case]
        m = r["metrics"]
        assert m["step/skipped_nonfinite"] == 1.0 and m["step/skipped_steps"] == 1.0, (rank, m)
        assert m["step/optimizer_steps"] == 0.0 and m[f"step/nonfinite_{first}"] == 1.0, rank
        assert r["unchanged"], f"rank {rank}: parameters or optimizer state changed"
        assert r["grads_zero"], f"rank {rank}: non-finite gradients left in the buffers"
        # rank 0 names the first non-finite quantity, once; no other rank warns
        assert len(r["warnings"]) == (1 if rank == 0 else 0), (rank, r["warnings"])
        if rank == 0:
            assert r["warnings"][0].startswith(
                f"policy_step skipped optimizer step 1 of 1 on every rank: non-finite {first} ("), r["warnings"]
    assert results[0]["poisoned_rollout"]["metrics"]["step/nonfinite_logits"] == 0.0
    # pi_old is this forward's detached logprobs, so the NaN ones are dropped as non-finite
    # pi_old and the loss stays finite: only the output and gradient checks see this one.
    assert results[0]["nan_weight"]["metrics"]["step/nonfinite_grad"] == 1.0


def test_rollouts_name_the_first_trained_nonfinite_advantage():
    tokens = torch.zeros(3, 5, dtype=torch.int64)
    mask = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([[0.0, 0, 1, 1], [float("nan")] * 4, [0, 1, float("-inf"), float("nan")]])
    b = Rollouts(tokens=tokens, loss_mask=mask, advantages=adv)
    bad = b.nonfinite_advantages()
    assert bad.tolist() == [[False] * 4, [False] * 4, [False, False, True, False]]  # row 1 is not trained
    assert b.describe_nonfinite(bad) == "advantages[row 2, target 2] = -inf"
    rows = Rollouts(tokens=tokens, loss_mask=mask, advantages=torch.tensor([1.0, float("nan"), float("inf")]))
    assert rows.describe_nonfinite(rows.nonfinite_advantages()) == "advantages[row 2] = inf"
