"""Which LossConfig and logprob temperature the Megatron-LM drop-ins use, and the --cispo-* flags.

install(config) or configure(config) fixes them; otherwise they are read once from Megatron's
parsed args (the --cispo-* flags that `extra_args_provider` adds), else LossConfig() defaults.
The --grpo-* and --rl-* flags keep their Megatron-LM meaning; see docs/integration.md.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Optional

from ...config import ConfigError, CorrectionConfig, LossConfig, describe_fields, from_dict
from ...losses import check_loss_config

# flag -> LossConfig key. KL, entropy, TIS and the PPO clip are not here on purpose: Megatron's
# --grpo-kl-beta, --grpo-entropy-term-weight, --rl-importance-sampling-truncation-coef and
# --grpo-clamp-eps-lower/upper already set them, and calculate_grpo_loss receives their values.
FLAGS: dict[str, str] = {
    "--cispo-policy-loss": "policy_loss",
    "--cispo-anchor": "cispo.anchor",
    "--cispo-eps-low": "cispo.eps_low",
    "--cispo-eps-high": "cispo.eps_high",
    "--cispo-token-mask": "cispo.token_mask",
    "--cispo-mask-eps-low": "cispo.mask_eps_low",
    "--cispo-mask-eps-high": "cispo.mask_eps_high",
    "--cispo-ppo-dual-clip": "ppo.dual_clip",
    "--cispo-rollout-is-eps-low": "rollout_is.eps_low",
    "--cispo-rollout-is-eps-high": "rollout_is.eps_high",
    "--cispo-head": "head",
    "--cispo-head-fp32": "head_fp32",
}
TEMPERATURE_FLAG = "--cispo-temperature"

# What configure() fixed, or what was read once from Megatron's parsed args; None = not yet.
_settings: dict[str, Any] = {"config": None, "temperature": None}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the --cispo-* flags to Megatron's parser (pass as pretrain's extra_args_provider).

    Every flag defaults to None, meaning "LossConfig's default", so defaults live in one place.
    Adding them twice is a no-op.
    """
    if "--cispo-anchor" in parser._option_string_actions:
        return parser
    fields = {key: (tp, default, doc) for key, tp, default, doc in describe_fields(LossConfig)}
    group = parser.add_argument_group("megatron_cispo", "CISPO / registry policy loss (megatron_cispo)")
    for flag, key in FLAGS.items():
        tp, default, doc = fields[key]
        help_text = f"{doc} LossConfig.{key}, default {default!r}."
        if tp == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif tp.startswith("'"):  # a Literal: 'old' | 'rollout'
            group.add_argument(flag, choices=[c.strip().strip("'") for c in tp.split("|")], default=None,
                               help=help_text)
        elif tp == "str":
            group.add_argument(flag, type=str, default=None, help=help_text)
        else:
            group.add_argument(flag, type=float, default=None, help=help_text)
    group.add_argument(TEMPERATURE_FLAG, type=float, default=None,
                       help="Temperature of the trainer's logprobs (old, ref and current); default 1.0 "
                            "as in Megatron-LM. Set it to the temperature of the sampler's logprobs.")
    return parser


def loss_config_from_args(args: Any) -> LossConfig:
    """LossConfig from a parsed Megatron args namespace; unset (None or absent) flags keep defaults."""
    data: dict[str, Any] = {}
    given = []
    for flag, key in FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        given.append(f"{flag}={value!r}")
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    try:
        cfg = from_dict(LossConfig, data)
    except ConfigError as e:
        raise ConfigError(f"invalid megatron_cispo flags ({', '.join(given)}): {e}") from e
    check_dropin_config(cfg)
    return cfg


def check_dropin_config(cfg: LossConfig) -> LossConfig:
    """Reject LossConfig settings that calculate_grpo_loss cannot honour, naming the Megatron flag."""
    problems = []
    if cfg.loss_agg != "token_mean":
        problems.append(f"loss_agg={cfg.loss_agg!r}: train_rl.py's loss_func sums per-token losses over "
                        "its own loss mask, which calculate_grpo_loss never sees; use 'token_mean' "
                        "(and --calculate-per-token-loss for the global token mean)")
    if cfg.tis.level is not None:
        problems.append(f"tis.level={cfg.tis.level!r}: use Megatron's --rl-inference-logprobs-is-correction "
                        "and --rl-importance-sampling-truncation-coef (token-level TIS, old anchor)")
    if cfg.kl.coef != 0.0:
        problems.append(f"kl.coef={cfg.kl.coef!r}: use Megatron's --grpo-kl-beta (k3 estimator)")
    on = {k: v for k, v in vars(cfg.correction).items() if v != getattr(CorrectionConfig(), k)}  # opsm_ref: a str
    if on:
        # Megatron-LM packs several sequences per row and hands calculate_grpo_loss no sequence
        # boundaries, and M2PO needs a selection over the whole batch before the step.
        problems.append(f"correction {on}: off-policy corrections need the policy step's sequence "
                        "boundaries and pre-step selection; not available in calculate_grpo_loss")
    if cfg.entropy_coef != 0.0:
        problems.append(f"entropy_coef={cfg.entropy_coef!r}: use Megatron's --grpo-entropy-term-weight")
    if cfg.head == "fused_grad":
        # get_logprobs(model, tokens, position_ids, ...) gets no advantages, old/ref logprobs or loss
        # mask, and train_rl.py forms the loss from its return value, so no gradient exists in the forward.
        problems.append("head='fused_grad' (--cispo-head fused_grad): train_rl.py forms the loss after "
                        "get_logprobs returns, from advantages, old/ref logprobs and a loss mask that "
                        "get_logprobs never receives, so the gradient cannot be computed in the forward; "
                        "use --cispo-head fused (same memory saving, gradient by recompute)")
    if problems:
        raise ConfigError("LossConfig not usable with Megatron-LM's calculate_grpo_loss: " + "; ".join(problems))
    try:
        check_loss_config(cfg)  # the registry's rules: the loss exists and its anchor is valid
    except ValueError as e:
        raise ConfigError(f"LossConfig not usable with Megatron-LM's calculate_grpo_loss: {e}") from None
    return cfg


def configure(config: Optional[LossConfig] = None, *, temperature: Optional[float] = None) -> None:
    """Fix the drop-ins' LossConfig and temperature; None means "read Megatron's args on first use"."""
    if config is not None:
        check_dropin_config(config)
    if temperature is not None and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    _settings.update(config=config, temperature=temperature)


def _megatron_args() -> Any:
    # Never import Megatron here: if megatron.training is not loaded, no Megatron run is going on.
    training = sys.modules.get("megatron.training")
    get_args = getattr(training, "get_args", None)
    if get_args is None:
        return None
    try:
        return get_args()
    except AssertionError:  # Megatron asserts when args are not parsed yet
        return None


def _setting(key: str, read: Callable[[Any], Any], default: Callable[[], Any]) -> Any:
    """The configured value, else `read(args)` once from Megatron's parsed args (cached), else
    `default()` (not cached: Megatron may parse its args later)."""
    if _settings[key] is None:
        args = _megatron_args()
        if args is None:
            return default()
        _settings[key] = read(args)
    return _settings[key]


def _temperature_from_args(args: Any) -> float:
    value = getattr(args, _dest(TEMPERATURE_FLAG), None)
    return 1.0 if value is None else float(value)


def loss_config() -> LossConfig:
    """The LossConfig in force (configured, else from Megatron's --cispo-* flags, else defaults)."""
    return _setting("config", loss_config_from_args, LossConfig)


def logprob_temperature() -> float:
    """The sampler temperature logits are divided by (configured, else --cispo-* flag, else 1)."""
    return _setting("temperature", _temperature_from_args, lambda: 1.0)
