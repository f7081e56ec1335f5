"""MoE z-loss (and aux-loss) scaling under TP x CP on megatron-core 0.16 (NVIDIA/Megatron-LM #1652).

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
from typing import Iterator

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
