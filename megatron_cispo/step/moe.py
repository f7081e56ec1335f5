"""MoE aux-loss and z-loss scaling under TP x CP on megatron-core 0.16 (NVIDIA/Megatron-LM #1652).

    with moe_aux_loss_compensation(model_config):   # around the forward/backward schedule
        run_schedule(...)

With calculate_per_token_loss=True, megatron-core <= 0.16 attaches each router's aux loss (and
z-loss) times the tokens *this* TP x CP rank routed, so the summed gradient comes out divided by
the TP x CP group size; upstream PR #5047 multiplies the scale by that size. Until the installed
megatron-core has the fix, the coefficients are multiplied by the TP x CP size while the
schedule runs (the router reads them at forward time), then restored.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

# First megatron-core release assumed to carry PR #5047 (merged 2026-05-28, after 0.16.1).
FIXED_IN = (0, 17)


def _megatron_version() -> tuple[int, int]:
    from megatron.core import package_info

    return int(package_info.MAJOR), int(package_info.MINOR)


def aux_loss_scale(config) -> int:
    """The factor the installed megatron-core leaves out of MoE aux/z-loss gradients: the TP x CP
    size on affected versions when the model routes tokens, else 1."""
    if getattr(config, "num_moe_experts", None) is None or _megatron_version() >= FIXED_IN:
        return 1
    return config.tensor_model_parallel_size * config.context_parallel_size


@contextlib.contextmanager
def moe_aux_loss_compensation(config) -> Iterator[int]:
    """Scale config.moe_aux_loss_coeff (a float or a per-type list) and moe_z_loss_coeff by
    `aux_loss_scale(config)` for the duration of the block; yields the factor."""
    factor = aux_loss_scale(config)
    if factor == 1:
        yield 1
        return
    saved = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
    aux = saved[0]
    config.moe_aux_loss_coeff = [c * factor for c in aux] if isinstance(aux, (list, tuple)) else aux * factor
    config.moe_z_loss_coeff = None if saved[1] is None else saved[1] * factor
    try:
        yield factor
    finally:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = saved
