"""Loss configuration: frozen dataclasses, one per section of an experiment YAML's `loss:`.

`LossConfig` mirrors the `loss:` section one-to-one. Build it with
`from_dict(LossConfig, yaml_dict["loss"], path="loss")` (the loader lives in schema.py and is
re-exported here). Each section checks only its own fields; rules that need the loss registry
(the loss name, a rollout anchor stacked with TIS) are `losses.check_loss_config`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Optional

from .presets import expand_preset
from .schema import (ConfigError, apply_overrides, check_field_types, config_field, describe_fields, from_dict,
                     parse_override_value, to_dict, type_name)

__all__ = ["ConfigError", "apply_overrides", "check_field_types", "config_field", "describe_fields", "from_dict",
           "parse_override_value", "to_dict", "type_name", "CispoConfig", "PPOConfig", "RolloutISConfig",
           "TISConfig", "KLConfig", "CorrectionConfig", "LossConfig", "LossAgg"]


def _require(ok: bool, owner: object, name: str, requirement: str) -> None:
    if not ok:
        value = getattr(owner, name)
        raise ValueError(f"{type(owner).__name__}.{name} must be {requirement}, got {value!r}")


def _check_clip(section: object) -> None:
    """Offsets of PPO and rollout_is, whose lower bound 1 - eps_low must stay a ratio in [0, 1]."""
    _require(0.0 <= section.eps_low <= 1.0, section, "eps_low", "in [0, 1]")
    _require(section.eps_high >= 0.0, section, "eps_high", ">= 0")


def _check_cispo_clip(c: CispoConfig) -> None:
    # eps_low > 1 is verl's "no floor" (clip_ratio_low=10): the ratio is > 0, so a floor <= 0 never binds.
    _require(math.isfinite(c.eps_low) and c.eps_low >= 0.0, c, "eps_low", "finite and >= 0 (above 1: no floor)")
    _require(c.eps_high >= 0.0, c, "eps_high", ">= 0")
    _require(c.clip_min is None or (math.isfinite(c.clip_min) and c.clip_min >= 0.0), c, "clip_min",
             "null or finite and >= 0")
    _require(c.clip_max is None or c.clip_max > 0.0, c, "clip_max", "null or > 0")
    low, high = c.bounds()
    if low > high:
        raise ValueError(f"CispoConfig: the weight range [{low}, {high}] is empty; the floor (clip_min, else "
                         f"max(0, 1-eps_low)) must be <= the cap (clip_max, else 1+eps_high)")


@dataclass(frozen=True, kw_only=True)
class CispoConfig:
    """The weight clamp is [low, high] = bounds(): clip_min if set, else max(0, 1 - eps_low); clip_max if
    set, else 1 + eps_high. An absolute bound replaces its offset; the offset is then ignored.
    Other frameworks' flags map onto these keys through presets.py (docs/mapping.md)."""

    eps_low: float = config_field(
        1.0, "Weight floor offset: floor = max(0, 1-eps_low); any value >= 1 means no floor (verl writes 10).")
    eps_high: float = config_field(4.0, "Weight cap offset; 4.0 caps r at 5 (ms-swift --epsilon_high 5.0).")
    anchor: Literal["old", "rollout"] = config_field(
        "old", "Ratio denominator: 'old' = trainer-recomputed pi_old, 'rollout' = sampler logprobs.")
    clip_min: Optional[float] = config_field(
        None, "Absolute weight floor; replaces 1-eps_low when set (null = use eps_low).")
    clip_max: Optional[float] = config_field(
        None, "Absolute weight cap; replaces 1+eps_high when set (null = use eps_high). May be < 1: "
        "ms-swift/TRL's default cap 0.2 scales every on-policy token by 0.2.")
    token_mask: bool = config_field(False, "MiniMax-M1 token mask: zero tokens the PPO clip would drop.")
    mask_eps_low: float = config_field(0.2, "Token mask: drop A<0 tokens with r < 1-mask_eps_low.")
    mask_eps_high: float = config_field(0.28, "Token mask: drop A>0 tokens with r > 1+mask_eps_high.")

    def bounds(self) -> tuple[float, float]:
        """(low, high) of the weight clamp, as the class docstring says."""
        low = self.clip_min if self.clip_min is not None else max(0.0, 1.0 - self.eps_low)
        return low, self.clip_max if self.clip_max is not None else 1.0 + self.eps_high

    def __post_init__(self) -> None:
        check_field_types(self)  # the Literal fields included
        _check_cispo_clip(self)
        _require(0.0 <= self.mask_eps_low <= 1.0, self, "mask_eps_low", "in [0, 1]")
        _require(self.mask_eps_high >= 0.0, self, "mask_eps_high", ">= 0")


@dataclass(frozen=True, kw_only=True)
class PPOConfig:
    eps_low: float = config_field(0.2, "Clip range is [1-eps_low, 1+eps_high] on r = pi/pi_old.")
    eps_high: float = config_field(0.2, "Upper clip offset (0.28 is DAPO's clip-higher).")
    dual_clip: Optional[float] = config_field(None, "Dual-clip c > 1: for A<0 the loss is at most -c*A.")

    def __post_init__(self) -> None:
        check_field_types(self)
        _check_clip(self)
        _require(self.dual_clip is None or self.dual_clip > 1.0, self, "dual_clip", "None or > 1")


@dataclass(frozen=True, kw_only=True)
class RolloutISConfig:
    eps_low: float = config_field(0.2, "Tokens with r = pi/pi_rollout < 1-eps_low get zero weight.")
    eps_high: float = config_field(0.28, "Tokens with r > 1+eps_high get zero weight.")

    def __post_init__(self) -> None:
        check_field_types(self)
        _check_clip(self)


@dataclass(frozen=True, kw_only=True)
class TISConfig:
    level: Optional[Literal["token", "sequence"]] = config_field(
        None, "Truncated IS weight min(pi_old/pi_rollout, cap) per token or per sequence; None = off.")
    cap: float = config_field(2.0, "Truncation cap of the TIS weight.")

    def __post_init__(self) -> None:
        check_field_types(self)
        _require(self.cap > 0.0, self, "cap", "> 0")


@dataclass(frozen=True, kw_only=True)
class KLConfig:
    """Per-token KL penalty. Tokens come from pi_rollout, not pi: which KL each setting's gradient
    follows, on- and off-policy, is in docs/algorithm.md ("KL estimators")."""

    coef: float = config_field(0.0, "Weight of the KL(pi || pi_ref) penalty added to the per-token loss.")
    estimator: Literal["k1", "k2", "k3"] = config_field("k3", "Per-token KL estimator (Schulman's k1/k2/k3).")
    is_weight: bool = config_field(
        False, "Multiply the estimate by pi/pi_rollout, gradient included (needs rollout_logprobs): with k3 "
        "(or k1) the value and gradient are then unbiased for KL(pi || pi_ref) from pi_rollout's samples.")

    def __post_init__(self) -> None:
        check_field_types(self)  # the Literal fields included
        _require(math.isfinite(self.coef) and self.coef >= 0.0, self, "coef", "finite and >= 0")
        if self.is_weight and self.estimator == "k2":
            raise ValueError("KLConfig.is_weight=True needs estimator 'k3' or 'k1' (their expectation under pi is "
                             "KL(pi || pi_ref); k2's is not a KL), got estimator='k2'")


def _check_band(section: object, name: str) -> None:
    band = getattr(section, name)
    _require(band is None or (len(band) == 2 and 0.0 <= band[0] <= band[1] and math.isfinite(band[0])),
             section, name, "null or [lo, hi] with 0 <= lo <= hi (hi may be .inf)")


@dataclass(frozen=True, kw_only=True)
class CorrectionConfig:
    """Off-policy corrections, each off (null) by default and composable with any loss. Under the
    old anchor they act on rho = pi_old / pi_rollout (and need pi_old, as TIS does); under the
    rollout anchor on r = pi_theta / pi_rollout, detached; OPSM on its opsm_ref under either anchor.
    Dropped tokens and sequences stay in the denominator. Formulas and sources: docs/algorithm.md.
    A plugin correction's own settings (correction.<its name>) go into `sections`; the correction
    registry (losses/corrections.py) builds them and refuses a name no correction registered."""

    __extra_keys__ = ("sections", lambda key, data: True)

    mis: Optional[tuple[float, float]] = config_field(
        None, "Token masked IS (IcePop): keep a token only if lo <= ratio <= hi.")
    geo_rs: Optional[tuple[float, float]] = config_field(
        None, "Geometric-mean sequence rejection: drop a sequence if exp(mean_t log ratio_t) is outside [lo, hi].")
    opsm: Optional[float] = config_field(
        None, "Off-policy sequence masking (DeepSeek-V3.2), delta: drop a sequence whose advantage is < 0 and "
        "whose mean_t log(pi_ref / pi_theta) is > delta, pi_ref as opsm_ref says.")
    opsm_ref: Literal["rollout", "old"] = config_field(
        "rollout", "OPSM's reference: 'rollout' = the sampler's logprobs (DeepSeek-V3.2, TRL, ms-swift); 'old' = "
        "pi_old, as slime without --use-rollout-logprobs (needs old_logprobs; with one optimizer step pi_old is "
        "the training forward, so the mean is 0 and OPSM drops nothing).")
    m2po: Optional[float] = config_field(
        None, "M2PO second-moment trust region, tau: before the step, mask the tokens with the largest "
        "(log rho)^2 until the mean of (log rho)^2 over the kept tokens of the global batch is <= tau "
        "(old anchor only; costs the pi_old pass).")
    sections: dict[str, Any] = config_field(
        factory=dict, doc="A plugin correction's settings, written correction.<its name> (losses.corrections).")

    def __post_init__(self) -> None:
        object.__setattr__(self, "sections", _frozen(dict(self.sections)))  # hashable, as every field
        check_field_types(self)  # the Literal field included
        _check_band(self, "mis")
        _check_band(self, "geo_rs")
        _require(self.opsm is None or (math.isfinite(self.opsm) and self.opsm >= 0.0), self, "opsm",
                 "null or finite and >= 0")
        _require(self.m2po is None or (math.isfinite(self.m2po) and self.m2po > 0.0), self, "m2po",
                 "null or finite and > 0")


def _expand_preset(spec: Any, rest: dict, path: str) -> dict:
    return expand_preset(spec, rest, path, schema=LossConfig)  # presets sit below config: pass the class


LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


class FrozenDict(dict):
    """A read-only, hashable dict: a plugin's section in the frozen, hashed LossConfig or CorrectionConfig."""

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.items())))

    def _refuse(self, *args, **kwargs):
        raise TypeError("a config section is read-only; build a new config")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return FrozenDict({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def _own_section(key: str, data: Any) -> bool:
    """loss.<name> where <name> is the configured policy_loss: that loss's own section."""
    return key == data.get("policy_loss", "cispo")


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    # A plugin loss's own settings: loss.<its name> (the configured policy_loss) goes into `sections`, which
    # the registry builds into the dataclass the loss registered (losses.loss_settings) and checks
    # (check_loss_config); to_dict writes it back at loss.<its name>.
    __extra_keys__ = ("sections", _own_section)
    # Loader-only key (schema.loader_keys): the preset's keys replace it before validation, so the
    # built config, the dumped config.yaml and the config hash hold the resolved values.
    __loader_keys__ = {"preset": (
        Optional[dict[str, Any]], _expand_preset,
        "Another framework's flags, by their names and defaults: {framework: skyrl | ms_swift | trl | verl | "
        "nemo_rl | slime, <flag>: value, ...}; becomes policy_loss, cispo.* and tis.* (slime's also "
        "correction.opsm and opsm_ref; docs/mapping.md). "
        "A key also written explicitly must equal the preset's value.")}

    policy_loss: str = config_field("cispo", "Registered loss name: cispo, ppo, rollout_is or a plugin.")
    loss_agg: LossAgg = config_field("token_mean", "How per-token losses become one global scalar.")
    max_len: Optional[int] = config_field(None, "Divisor for seq_mean_token_sum_norm (required there).")
    entropy_coef: float = config_field(0.0, "Entropy bonus: adds -entropy_coef * entropy per token.")
    head: Literal["logits", "fused", "fused_grad"] = config_field(
        "logits", "Output head: 'logits' scores the model's logits; 'fused' runs the output layer and the "
        "logprobs chunk by chunk (fused_token_logprobs), so the [tokens, vocab/tp] logits never exist; "
        "'fused_grad' is 'fused' that also computes the loss's gradient in the forward (three GEMMs, no "
        "recompute; losses whose gradient needs a whole sequence first fall back to 'fused', counted in "
        "head/fused_grad_fallback; refused with fp16, whose loss scale arrives only in backward; "
        "docs/algorithm.md).")
    head_fp32: bool = config_field(
        False, "Fused heads only: run its matmul in fp32 from bf16 parameters (ScaleRL's fp32 LM head).")
    routing_replay: Literal["off", "rollout"] = config_field(
        "off", "MoE routing replay (R3): 'rollout' routes every token of every pass that scores the rollouts "
        "(training forwards, their recompute, pi_old and reference passes) through the experts the sampler "
        "chose (rollouts.routed_experts; a token without a route keeps the router's own), with the router "
        "weights taken from the dense scores so they still train; 'off' routes as the router does and, "
        "when the rollouts carry routes, only measures moe/route_mismatch. 'rollout' needs an MoE model "
        "and routes from the sampler, and is refused where the router cannot take them (moe_router_fusion, "
        "sinkhorn, CUDA graphs), where 'off' ignores the routes (docs/algorithm.md).")
    cispo: CispoConfig = config_field(factory=CispoConfig, doc="CISPO loss settings.")
    ppo: PPOConfig = config_field(factory=PPOConfig, doc="PPO clipped-surrogate settings.")
    rollout_is: RolloutISConfig = config_field(factory=RolloutISConfig, doc="rollout_is loss settings.")
    tis: TISConfig = config_field(factory=TISConfig, doc="Truncated importance sampling.")
    kl: KLConfig = config_field(factory=KLConfig, doc="KL penalty against the reference policy.")
    correction: CorrectionConfig = config_field(
        factory=CorrectionConfig, doc="Off-policy corrections: token MIS, Geo-RS, OPSM, M2PO.")
    sections: dict[str, Any] = config_field(
        factory=dict, doc="A plugin loss's own settings, written loss.<its name> (register_policy_loss(config=)).")

    def __post_init__(self) -> None:
        object.__setattr__(self, "sections", _frozen(dict(self.sections)))  # hashable, as every field
        check_field_types(self)
        _require(bool(self.policy_loss), self, "policy_loss", "a registered loss name")
        _require(self.max_len is None or self.max_len > 0, self, "max_len", "None or > 0")
        _require(math.isfinite(self.entropy_coef), self, "entropy_coef", "finite")
        _require(not self.head_fp32 or self.head != "logits", self, "head_fp32",
                 "False unless head='fused' or 'fused_grad'")
        if self.loss_agg == "seq_mean_token_sum_norm" and self.max_len is None:
            raise ValueError("LossConfig.max_len must be > 0 when loss_agg='seq_mean_token_sum_norm', got None")
