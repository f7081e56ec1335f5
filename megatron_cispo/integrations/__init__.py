"""Integrations with training loops that megatron_cispo does not own.

    megatron_lm  Megatron-LM's own RL loop (train_rl.py): drop-in calculate_grpo_loss, a
                 vocab-parallel get_logprobs, install(), --cispo-* flags and a zero-edit launcher
    plugins      MEGATRON_CISPO_PLUGINS=pkg.mod,... imports plugin modules (custom losses)
Importing this package needs no Megatron-LM checkout.
"""
