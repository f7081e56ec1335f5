"""Turn a per-token loss into (loss_sum, denominator) that sum exactly across microbatches and DP.

Summing loss_sum and denominator over every microbatch and data-parallel rank, then dividing
once, gives the global loss of the chosen `loss_agg` mode; nothing here is averaged locally.
"""
from __future__ import annotations

import torch
from torch import Tensor


def aggregate(per_token: Tensor, mask: Tensor, mode: str, max_len: int | None = None) -> tuple[Tensor, Tensor]:
    """per_token: [b, s] fp32 (0 where mask is False); mask: [b, s] bool.

    Returns loss_sum (0-dim, keeps grad) and denominator (0-dim fp32, detached):
      token_mean               sum of token losses            / valid tokens
      seq_mean_token_mean      sum over seqs of (mean token)  / seqs with >= 1 valid token
      seq_mean_token_sum       sum over seqs of (token sum)   / seqs with >= 1 valid token
      seq_mean_token_sum_norm  sum over seqs of (token sum) / max_len, same denominator
    """
    weight, _, denominator = token_weights(mask, mode, max_len)
    return (torch.where(mask, per_token, 0.0) * weight).sum(), denominator


def finalize(loss_sum: Tensor, denominator: Tensor) -> Tensor:
    """loss_sum / max(denominator, 1): zero valid tokens give loss 0 and zero grad, never NaN."""
    return loss_sum / denominator.clamp(min=1.0)


def token_weights(mask: Tensor, mode: str, max_len: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token aggregation weights of a whole batch, for splitting it across microbatches and ranks.

    mask: [n, s] bool, valid tokens, one sequence per row. Returns (weight, share, denominator):
    weight [n, s] fp32 multiplies each token's loss, share [n, s] fp32 is its part of the
    denominator (sum over a sequence: its count in `aggregate`), denominator 0-dim fp32 exact.
    For any split, sum(weight * loss) / denominator over the pieces equals `aggregate`'s loss:
      token_mean 1 | seq_mean_token_mean 1/len | seq_mean_token_sum 1 | seq_mean_token_sum_norm 1/max_len
    """
    ones = mask.float()
    if mode == "token_mean":
        return ones, ones, ones.sum()
    per_seq = ones / ones.sum(-1, keepdim=True).clamp(min=1.0)  # 1/len on valid tokens
    seqs = (ones.sum(-1) > 0).sum().float()
    if mode == "seq_mean_token_mean":
        return per_seq, per_seq, seqs
    if mode == "seq_mean_token_sum":
        return ones, per_seq, seqs
    if mode == "seq_mean_token_sum_norm":
        if not max_len or max_len <= 0:
            raise ValueError(f"max_len must be > 0 for loss_agg='seq_mean_token_sum_norm', got {max_len!r}")
        return ones / max_len, per_seq, seqs
    raise ValueError(f"loss_agg must be one of token_mean, seq_mean_token_mean, seq_mean_token_sum, "
                     f"seq_mean_token_sum_norm, got {mode!r}")
