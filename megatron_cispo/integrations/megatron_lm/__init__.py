"""megatron_cispo inside Megatron-LM's own RL loop (train_rl.py, megatron/rl/rl_utils.py), core_v0.16.x.

Zero edits:  python -m megatron_cispo.integrations.megatron_lm.run train_rl.py <megatron args> --cispo-anchor rollout
One line in train_rl.py, before pretrain():  from megatron_cispo.integrations.megatron_lm import install; install()
Pieces: calculate_grpo_loss (drop-in), get_logprobs (vocab-parallel), install/uninstall,
extra_args_provider (--cispo-* flags -> LossConfig). Importing this needs no Megatron-LM checkout;
running Megatron-LM's RL loop needs its packages: pip install "megatron_cispo[megatron-lm]".
"""
from .dropin import calculate_grpo_loss
from .patch import API, NEG_LOSS_KEY, MegatronLMDependencyError, MegatronLMVersionError, install, installed, uninstall
from .settings import check_dropin_config, configure, extra_args_provider, loss_config, loss_config_from_args
from .vocab_logprobs import get_logprobs

__all__ = [
    "API", "NEG_LOSS_KEY", "MegatronLMDependencyError", "MegatronLMVersionError", "calculate_grpo_loss", "check_dropin_config", "configure",
    "extra_args_provider", "get_logprobs", "install", "installed", "loss_config", "loss_config_from_args",
    "uninstall",
]
