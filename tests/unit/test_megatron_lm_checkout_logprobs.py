"""The drop-in's get_logprobs against each checkout's own (MEGATRON_LM_DIR: one or several
checkouts joined by os.pathsep, see megatron_lm_checkouts.py), compiled from its source:
- one process: the same logprobs, parameter gradients and PackedSeqParams handed to the model
  (0.16: none when unpacked; 0.17+: one THD sequence per row, with total_tokens up to 0.19 and
  pad_between_seqs=False on main), unpacked and packed;
- context parallelism 2 over gloo: main's get_logprobs runs each rank's share of the tokens and
  all-gathers the logprobs (#5882, its loss_func no longer scales by CP), older refs run every token
  on every rank. Per rank: the tokens the model saw, the logprobs and the gradients equal the
  checkout's, and the logprobs equal CP 1's.
The model is position-wise (no attention), so a CP rank's share of the tokens gives exactly those
positions' logits, and Transformer Engine's THD partition has a CPU stand-in.

    MEGATRON_LM_DIR=/mlm/core_v0.16.1:/mlm/core_v0.19.0:/mlm/main python -m pytest tests/unit -k megatron_lm_checkout
"""
import ast
from pathlib import Path

import pytest
import torch

from megatron_cispo.testing import spawn

from megatron_lm_checkouts import ROOTS, Checkout, cp2_worker, logprobs_pair, needs_checkout

pytestmark = needs_checkout


@pytest.fixture(params=ROOTS or [None], ids=lambda r: Path(r).name if r else "none")
def checkout(request):
    return Checkout(request.param)


def _splits_cp(checkout):
    return checkout.has("megatron/rl/rl_utils.py", "_scatter_for_context_parallel")


def _assert_same(result, where):
    theirs, ours = result["theirs"], result["ours"]
    assert ours["seen"] == theirs["seen"], where
    assert ours["lp"].dtype == theirs["lp"].dtype and ours["lp"].shape == theirs["lp"].shape == (2, 7), where
    torch.testing.assert_close(ours["lp"], theirs["lp"], rtol=1e-6, atol=1e-6, msg=where)
    for mine, want in zip(ours["grads"], theirs["grads"]):
        torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-6, msg=where)
    assert ours["flash_decode"] is theirs["flash_decode"] is True, where  # off for the forward, restored


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_dropin_get_logprobs_matches_the_checkouts_values_grads_and_packed_seq_params(checkout, packed):
    result = logprobs_pair(str(checkout.root), None, packed)
    _assert_same(result, checkout.root.name)
    (params, n_tokens), = result["ours"]["seen"]
    assert n_tokens == 8
    if packed:
        assert params["cu_seqlens_q"] == [0, 4, 8]
    elif "PackedSeqParams(" in ast.unparse(checkout.node("megatron/rl/rl_utils.py", "get_logprobs")):  # 0.17+
        assert params["qkv_format"] == "thd" and params["cu_seqlens_q"] == [0, 8] and params["max_seqlen_q"] == 8
    else:  # 0.16
        assert params is None


@pytest.fixture(scope="module")
def cp2():
    return {root: spawn(cp2_worker, 2, args=(root,), timeout_s=600) for root in ROOTS}


def test_dropin_get_logprobs_at_cp2_matches_the_checkouts_per_rank_and_cp1(checkout, cp2):
    per_rank = cp2[str(checkout.root)]
    share = 4 if _splits_cp(checkout) else 8  # main: each rank runs half the tokens
    for rank, by_packing in enumerate(per_rank):
        for packed, result in by_packing.items():
            where = f"{checkout.root.name} rank {rank} packed={packed}"
            _assert_same(result, where)
            assert [n for _, n in result["ours"]["seen"]] == [share], where
            torch.testing.assert_close(result["ours"]["lp"], result["cp1"], rtol=1e-6, atol=1e-6, msg=where)
