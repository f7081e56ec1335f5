"""M2PO's global token selection on one process: hand-made values, a brute-force search, the
(global sequence, position) tie-break, the pi_old plan, the microbatch field, and AReaL's rule."""
import math
import random

import pytest
import torch

from megatron_cispo.config import LossConfig, from_dict
from megatron_cispo.step import Rollouts, StepConfig, plan_old_logprobs
from megatron_cispo.step.m2po import dp_shard_row_ids, m2po_keep, mask_count
from megatron_cispo.step.packing import Layout, packed_microbatches, padded_microbatches, plan_bins


def select(log_rho, tau, valid=None, row_ids=None):
    """m2po_keep on rollout = 0 and old = log_rho, so (log rho)^2 = log_rho^2 exactly."""
    log_rho = torch.as_tensor(log_rho, dtype=torch.float32)
    valid = torch.ones_like(log_rho, dtype=torch.bool) if valid is None else valid
    rows = torch.arange(log_rho.shape[0]) if row_ids is None else torch.as_tensor(row_ids)
    keep, m = m2po_keep(log_rho, torch.zeros_like(log_rho), valid, tau, row_ids=rows)
    return keep, {k: float(v) for k, v in m.values().items()}


def brute_force(m2: list[float], keys: list[int], tau: float) -> set[int]:
    """Keys of the masked tokens: sort by (value desc, key asc), try k = 0, 1, ... until the mean
    of the rest (math.fsum) is <= tau; no token left counts as within the budget."""
    order = sorted(range(len(m2)), key=lambda i: (-m2[i], keys[i]))
    for k in range(len(m2) + 1):
        rest = [m2[i] for i in order[k:]]
        if not rest or math.fsum(rest) / len(rest) <= tau:
            return {keys[i] for i in order[:k]}
    raise AssertionError("unreachable")


def test_masks_the_largest_until_the_kept_mean_is_within_tau():
    # (log rho)^2 = 4, 1, .25, .25, 0: mean 1.1 > .5; without the 4: 1.5 / 4 = .375 <= .5
    keep, m = select([[2.0, -1.0, 0.5], [-0.5, 0.0, 0.0]], 0.5, valid=torch.tensor([[1, 1, 1], [1, 1, 0]]).bool())
    assert keep.tolist() == [[False, True, True], [True, True, True]]
    assert m["correction/m2po_masked_frac"] == pytest.approx(1 / 5)
    assert m["correction/m2po_m2_before"] == pytest.approx(5.5 / 5)
    assert m["correction/m2po_m2_after"] == pytest.approx(1.5 / 4)
    assert m["correction/m2po_kept_m2_max"] == 1.0


def test_exactly_tau_is_within_the_budget():
    # 4, 1, 1, 0, 0, 0: masking the 4 leaves 2 / 5 = .4; at tau = .4 one token goes, just below it two
    assert (~select([[2.0, 1.0, 1.0, 0.0, 0.0, 0.0]], 0.4)[0]).sum() == 1
    assert (~select([[2.0, 1.0, 1.0, 0.0, 0.0, 0.0]], 0.4 - 1e-9)[0]).sum() == 2


def test_ties_are_broken_by_global_sequence_then_position():
    # four tied 1s, two 0s: mean 4/6 > .5, 3/5 > .5, 2/4 = .5 -> two of the tied tokens go
    log_rho = [[1.0, -1.0, 0.0], [-1.0, 1.0, 0.0]]
    keep, _ = select(log_rho, 0.5, row_ids=[0, 1])
    assert keep.tolist() == [[False, False, True], [True, True, True]]
    keep, _ = select(log_rho, 0.5, row_ids=[1, 0])  # the second local row is global sequence 0
    assert keep.tolist() == [[True, True, True], [False, False, True]]
    # four 1s, two 0s at tau = .6: 3 / 5 -> one goes, the first of global sequence 2 (local row 1)
    keep, _ = select([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]], 0.6, row_ids=[5, 2])
    assert keep.tolist() == [[True, True, True], [False, True, True]]


@pytest.mark.parametrize("seed", range(20))
def test_selection_equals_a_brute_force_search_for_the_smallest_k(seed):
    rng = random.Random(seed)
    n, s = rng.randint(1, 6), rng.randint(1, 9)
    # a grid of multiples of 1/8: many ties, and every sum exact in fp64, so both searches see the same means
    log_rho = torch.tensor([[rng.choice([-1, 1]) * rng.randint(0, 12) / 8 for _ in range(s)] for _ in range(n)])
    valid = torch.rand(n, s, generator=torch.Generator().manual_seed(seed)) < 0.8
    rows = torch.tensor(rng.sample(range(100), n))
    tau = rng.choice([0.01, 0.1, 0.3, 0.5, 1.0, 3.0])
    keep, m = select(log_rho, tau, valid=valid, row_ids=rows)
    keys = (rows[:, None] * s + torch.arange(s))[valid].tolist()
    m2 = (log_rho.double() ** 2)[valid].tolist()
    masked = set((rows[:, None] * s + torch.arange(s))[~keep].tolist())
    assert masked == brute_force(m2, keys, tau)
    assert keep[~valid].all()  # tokens outside the loss are never touched
    kept = [v for v, k in zip(m2, keys) if k not in masked]
    assert not kept or math.fsum(kept) / len(kept) <= tau
    assert m["correction/m2po_m2_after"] <= tau
    assert m["correction/m2po_masked_frac"] == pytest.approx(len(masked) / max(len(m2), 1))


def test_tau_below_every_value_masks_every_token():
    keep, m = select([[1.0, -2.0], [0.5, 1.5]], 0.1)
    assert not keep.any()
    assert m["correction/m2po_masked_frac"] == 1.0 and m["correction/m2po_m2_after"] == 0.0


def test_nonfinite_logprobs_and_untrained_tokens_are_left_out():
    old = torch.tensor([[3.0, 0.0, float("-inf"), 0.1]])
    rollout = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    valid = torch.tensor([[False, True, True, True]])
    keep, m = m2po_keep(old, rollout, valid, 1e-3, row_ids=torch.tensor([0]))
    assert keep.tolist() == [[True, True, True, False]]  # the 9 is untrained, the -inf dropped by the loss
    assert float(m.values()["correction/m2po_masked_frac"]) == pytest.approx(1 / 2)


def test_row_ids_must_be_unique_and_shaped():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unique global sequence index per row"):
        m2po_keep(z, z, torch.ones(2, 3, dtype=torch.bool), 0.1, row_ids=torch.tensor([4, 4]))
    with pytest.raises(ValueError, match=r"row_ids must be an int \[n\] = \(2,\)"):
        m2po_keep(z, z, torch.ones(2, 3, dtype=torch.bool), 0.1, row_ids=torch.tensor([0.0, 1.0]))


def test_mask_count_on_sorted_values():
    v = torch.tensor([4.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    assert [int(mask_count(v, t)) for t in (1.5, 1.0, 2 / 3, 0.5, 0.0)] == [0, 1, 1, 2, 3]
    assert int(mask_count(torch.tensor([2.0], dtype=torch.float64), 1.0)) == 1  # everything goes
    assert int(mask_count(torch.zeros(0, dtype=torch.float64), 1.0)) == 0


def test_dp_shard_row_ids_name_the_global_rows_dp_shard_took():
    g = torch.arange(24)
    full = Rollouts(tokens=torch.zeros(24, 3, dtype=torch.int64), loss_mask=torch.ones(24, 2, dtype=torch.bool),
                    advantages=g.float())
    for dp, minibatches in ((1, 1), (2, 1), (2, 3), (4, 2), (3, 4)):
        for r in range(dp):
            shard = full.dp_shard(dp_rank=r, dp=dp, minibatches=minibatches)
            n = shard.tokens.shape[0]
            ids = dp_shard_row_ids(n, n // minibatches, r, dp, "cpu")
            assert ids.tolist() == shard.advantages.long().tolist()


@pytest.mark.parametrize("loss", [{"cispo": {"anchor": "old"}}, {"policy_loss": "ppo"}])
def test_m2po_forces_the_old_logprob_pass_even_at_one_optimizer_step(loss):
    plain = plan_old_logprobs(from_dict(LossConfig, loss), StepConfig(), optimizer_steps=1, have_old=False)
    m2po = from_dict(LossConfig, {**loss, "correction": {"m2po": 0.04}})
    assert plain == "from_training_forward"
    assert plan_old_logprobs(m2po, StepConfig(), optimizer_steps=1, have_old=False) == "pass"
    assert plan_old_logprobs(m2po, StepConfig(), optimizer_steps=1, have_old=True) == "given"


@pytest.mark.parametrize("packed,cp", [(False, 1), (True, 1), (True, 2)], ids=["padded", "packed", "packed_cp2"])
def test_the_keep_mask_reaches_every_microbatch_at_its_tokens(packed, cp):
    g = torch.Generator().manual_seed(0)
    n, s = 4, 9
    lengths = torch.tensor([10, 4, 7, 9])
    batch = Rollouts(tokens=torch.randint(0, 5, (n, s + 1), generator=g), lengths=lengths,
                     loss_mask=torch.arange(s)[None] < lengths[:, None] - 1, advantages=torch.ones(n))
    keep = torch.rand(n, s, generator=g) < 0.5
    w, fields = (torch.zeros(n, s), torch.zeros(n, s)), {"token_keep": keep}
    seen = []
    for rank in range(cp):
        layout = Layout(cp=cp, cp_rank=rank, pad_multiple=2 * cp if cp > 1 else 1)
        mbs = packed_microbatches(batch, w, plan_bins(batch, 12, 2), layout=layout, token_fields=fields) if packed \
            else padded_microbatches(batch, w, micro_batch_size=2, layout=layout, token_fields=fields)
        for mb in mbs:
            idx, got = mb.gather_index.reshape(-1), mb.token_keep.reshape(-1)
            assert mb.token_keep.dtype == torch.bool and mb.token_keep.shape == mb.loss_mask.shape
            assert torch.equal(got[idx >= 0], keep.reshape(-1)[idx[idx >= 0]])
            seen += idx[idx >= 0].tolist()
    real = (torch.arange(s)[None] < lengths[:, None] - 1).reshape(-1).nonzero()[:, 0].tolist()
    assert sorted(seen) == real  # every real token once, over the CP ranks


def areal_m2po_mask(old_logp, prox_logp, loss_mask, m2_threshold):
    """Transcription of AReaL inclusionAI/AReaL @ 00ed92443a5a3c1711d0a704a75a04bdd945fb6d,
    areal/trainer/ppo/actor.py::_apply_m2po_masking + _get_m2po_loss_mask (PR #480); applied per
    micro-batch inside grpo_loss_fn. Returns the new loss mask (True = trained)."""
    delta = old_logp - prox_logp
    m2 = delta * delta
    mask_flat = loss_mask.view(-1)
    m2_selected = m2.view(-1)[mask_flat]
    if m2_selected.numel() == 0:
        return loss_mask
    sorted_m2, indices = torch.sort(m2_selected, descending=True)
    restored_indices = torch.argsort(indices)
    n = sorted_m2.numel()
    suffix_sums = sorted_m2.flip(0).cumsum(0).flip(0)
    counts = torch.arange(n, 0, -1, device=sorted_m2.device, dtype=sorted_m2.dtype)
    below = torch.where(suffix_sums / counts < m2_threshold)[0]  # strict <
    num_to_mask = below[0].item() if len(below) > 0 else n - 1  # "mask all but one"
    sorted_mask = torch.ones_like(sorted_m2, dtype=torch.bool)
    if num_to_mask > 0:
        sorted_mask[:num_to_mask] = False
    if sorted_mask.sum() == 0:
        raise RuntimeError("All tokens are masked out when getting the m2po loss mask.")
    full = torch.zeros_like(mask_flat, dtype=torch.bool)
    full[mask_flat] = sorted_mask[restored_indices]
    return full.view_as(loss_mask)


def _ours(old, rollout, valid, tau):
    return m2po_keep(old, rollout, valid, tau, row_ids=torch.arange(old.shape[0]))[0] & valid


def test_agrees_with_areal_on_the_whole_batch_without_ties_or_an_exact_tau():
    g = torch.Generator().manual_seed(3)
    for tau in (0.005, 0.02, 0.05, 0.1, 0.5):  # E[(log rho)^2] is about 1/6 here
        old, rollout = -torch.rand(6, 10, generator=g), -torch.rand(6, 10, generator=g)
        valid = torch.rand(6, 10, generator=g) < 0.7
        ours = _ours(old, rollout, valid, tau)
        assert torch.equal(ours, areal_m2po_mask(old, rollout, valid, tau))
        masked = int((valid & ~ours).sum())
        assert (0 < masked < int(valid.sum())) if tau < 0.5 else masked == 0


def test_differs_from_areal_where_tau_is_hit_exactly_nothing_fits_or_microbatches_split():
    old, rollout = torch.tensor([[2.0, 1.0, 1.0, 0.0, 0.0, 0.0]]), torch.zeros(1, 6)
    valid = torch.ones(1, 6, dtype=torch.bool)
    # mean after masking the 4 is exactly .4: ours stops (<=), AReaL's strict < masks one more
    assert (~_ours(old, rollout, valid, 0.4)).sum() == 1
    assert (~areal_m2po_mask(old, rollout, valid, 0.4)).sum() == 2
    # tau below every value: ours masks everything (the bound holds), AReaL keeps the smallest one
    old2, ones = torch.tensor([[1.0, 2.0, 1.5]]), torch.ones(1, 3, dtype=torch.bool)
    assert not _ours(old2, torch.zeros(1, 3), ones, 0.5).any()
    assert areal_m2po_mask(old2, torch.zeros(1, 3), ones, 0.5).tolist() == [[True, False, False]]
    # AReaL selects per micro-batch: row 0 alone has mean .25 > .2, so its 1 goes; over the whole
    # batch the mean is 1.25 / 8 <= .2 and nothing is masked
    old3, zeros, valid3 = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.25] * 4]), torch.zeros(1, 4), torch.ones(2, 4).bool()
    per_mb = torch.cat([areal_m2po_mask(old3[i:i + 1], zeros, valid3[i:i + 1], 0.2) for i in range(2)])
    assert per_mb.tolist() == [[False, True, True, True], [True, True, True, True]]
    assert _ours(old3, torch.zeros(2, 4), valid3, 0.2).all()
