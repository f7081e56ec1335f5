"""megatron_cispo inside Megatron-LM's own RL loop (train_rl.py, megatron/rl/rl_utils.py).

Zero edits:  python -m megatron_cispo.integrations.megatron_lm.run train_rl.py <megatron args> --cispo-anchor rollout
One line in train_rl.py, before it parses its arguments:  from megatron_cispo.integrations.megatron_lm import install; install()
Pieces: calculate_grpo_loss (drop-in), get_logprobs (vocab-parallel), install/uninstall,
extra_args_provider (--cispo-* flags -> LossConfig), RECORDS (the Megatron-LM refs it knows:
core_v0.16.1 to core_v0.19.0 and a pinned main). Importing this needs no Megatron-LM checkout;
running Megatron-LM's RL loop needs its packages: pip install "megatron_cispo[megatron-lm]".
"""
from .api import RECORDS, MegatronLMVersionError, detect, known_refs
from .dropin import calculate_grpo_loss
from .patch import NEG_LOSS_KEY, MegatronLMDependencyError, install, installed, uninstall
from .settings import check_dropin_config, configure, extra_args_provider, loss_config, loss_config_from_args
from .vocab_logprobs import get_logprobs

__all__ = [
    "NEG_LOSS_KEY", "RECORDS", "MegatronLMDependencyError", "MegatronLMVersionError", "calculate_grpo_loss",
    "check_dropin_config", "configure", "detect", "extra_args_provider", "get_logprobs", "install", "installed",
    "known_refs", "loss_config", "loss_config_from_args", "uninstall",
]
