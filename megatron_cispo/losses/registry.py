"""Policy-loss registry: a dict of name -> PolicyLoss, filled by a decorator and by plugins.

Built-ins register on import; third-party losses come from the entry-point group
"megatron_cispo.policy_losses", loaded lazily once. `check_loss_config(cfg)` holds every rule
that needs the registry (checked once per config, then cached); `required_inputs(cfg)` tells
the policy step which optional tensors (old/rollout/ref logprobs, entropy) a config needs.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

from torch import Tensor

from ..config import LossConfig
from .common import LossInputs
from .corrections import active, correction_inputs
from .metrics import Metrics

ENTRY_POINT_GROUP = "megatron_cispo.policy_losses"

Anchor = Literal["old", "rollout"]
LossFn = Callable[[LossConfig, LossInputs], tuple[Tensor, Metrics]]
Bounds = Callable[[LossConfig], tuple[float, float]]

INPUT_DOCS = {
    "old_logprobs": "pi_old, recomputed by the trainer before the update",
    "rollout_logprobs": "the sampler's per-token logprobs",
    "ref_logprobs": "the reference policy's per-token logprobs",
    "entropy": "the current policy's per-token entropy",
}


class PolicyLossPluginError(RuntimeError):
    """An entry point in the megatron_cispo.policy_losses group failed to load or register."""


@dataclass(frozen=True, kw_only=True)
class PolicyLoss:
    """fn(cfg, inputs) -> (per-token loss [b, s] fp32, Metrics); anchor names its ratio denominator.

    anchor_key: the config key that chooses a configurable anchor ("cispo.anchor"), for messages.
    per_token: each token's loss reads only that token's logprob and given inputs (no sequence
    quantity of the current policy), so loss.head=fused_grad may form its gradient chunk by chunk.
    bounds: cfg -> (low, high), the ratio bounds the loss applies (a clamp, a clip, a trust band),
    which the Megatron-LM drop-in's truncated-fraction metrics report; None: the loss has none.
    config: a frozen dataclass of the loss's own settings, written loss.<name> in the YAML and read
    with loss_settings(cfg); None: the loss takes none.
    """

    name: str
    fn: LossFn
    anchor: Union[Anchor, Callable[[LossConfig], Anchor]]
    anchor_key: Optional[str] = None
    per_token: bool = False
    bounds: Optional[Bounds] = None
    config: Optional[type] = None

    def bounds_for(self, cfg: LossConfig) -> Optional[tuple[float, float]]:
        return None if self.bounds is None else self.bounds(cfg)

    def anchor_for(self, cfg: LossConfig) -> Anchor:
        anchor = self.anchor(cfg) if callable(self.anchor) else self.anchor
        if anchor not in ("old", "rollout"):
            raise ValueError(f"policy loss {self.name!r} declared anchor {anchor!r}; expected 'old' or 'rollout'")
        return anchor

    def __call__(self, cfg: LossConfig, inputs: LossInputs) -> tuple[Tensor, Metrics]:
        return self.fn(cfg, inputs)


_REGISTRY: dict[str, PolicyLoss] = {}
_plugins_loaded = False


def register_policy_loss(name: str, *, anchor: Union[Anchor, Callable[[LossConfig], Anchor]],
                         anchor_key: Optional[str] = None, per_token: bool = False,
                         bounds: Optional[Bounds] = None, config: Optional[type] = None) -> Callable[[LossFn], LossFn]:
    """Decorator: register `fn` under `name`. Registering a name twice raises ValueError.

    anchor: "old", "rollout", or a function of the config; anchor_key names the config key
    such a function reads (e.g. "cispo.anchor"), so error messages can point at it. per_token and
    bounds: what the loss declares about itself (PolicyLoss); a loss that declares nothing is
    served by the plain fused head under loss.head=fused_grad and reports no truncated fraction.
    """
    if config is not None and not (dataclasses.is_dataclass(config) and config.__dataclass_params__.frozen):
        raise ValueError(f"policy loss {name!r}: config= must be a frozen dataclass (@dataclass(frozen=True)), "
                         f"got {config!r}")

    def decorate(fn: LossFn) -> LossFn:
        if name in _REGISTRY:
            raise ValueError(f"policy loss {name!r} is already registered (by {_REGISTRY[name].fn.__module__})")
        _REGISTRY[name] = PolicyLoss(name=name, fn=fn, anchor=anchor, anchor_key=anchor_key, per_token=per_token,
                                     bounds=bounds, config=config)
        return fn
    return decorate


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        try:
            ep.load()  # importing the module runs its @register_policy_loss
        except Exception as e:
            raise PolicyLossPluginError(
                f"policy loss plugin {ep.name!r} = {ep.value!r} (entry point group {ENTRY_POINT_GROUP!r}) "
                f"failed to load: {type(e).__name__}: {e}") from e
        if ep.name not in _REGISTRY:
            raise PolicyLossPluginError(
                f"policy loss plugin {ep.name!r} = {ep.value!r} loaded but did not register a loss named "
                f"{ep.name!r}; decorate it with @register_policy_loss({ep.name!r}, anchor=...)")
    # Set only after success, so a broken plugin keeps raising instead of vanishing silently.
    _plugins_loaded = True


def available_policy_losses() -> list[str]:
    """Sorted names of built-in and plugin losses (loads plugins on first call)."""
    _load_plugins()
    return sorted(_REGISTRY)


def get_policy_loss(name: str) -> PolicyLoss:
    if name not in _REGISTRY:
        _load_plugins()
    if name not in _REGISTRY:
        raise ValueError(f"LossConfig.policy_loss={name!r} is not a registered policy loss; "
                         f"known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


@functools.lru_cache(maxsize=64)
def loss_settings(cfg: LossConfig) -> Any:
    """The configured loss's own settings (its register_policy_loss(config=) dataclass, built from
    loss.<its name>, defaults where unset); None for a loss that registered none. ValueError, one line
    naming the key, for a section the loss does not take or a wrong value."""
    spec = get_policy_loss(cfg.policy_loss)
    stray = sorted(set(cfg.sections) - {cfg.policy_loss})
    if stray:
        raise ValueError(f"loss.{stray[0]}: a section for a loss other than policy_loss={cfg.policy_loss!r}")
    given = dict(cfg.sections.get(cfg.policy_loss, {}))
    if spec.config is None:
        if given:
            raise ValueError(f"loss.{cfg.policy_loss}: the {cfg.policy_loss!r} loss takes no settings of its own "
                             "(it registered no config=)")
        return None
    from ..schema import from_dict

    return from_dict(spec.config, given, f"loss.{cfg.policy_loss}")


def check_loss_config(cfg: LossConfig) -> PolicyLoss:
    """Every rule that needs the registry, so it also covers plugin losses: the loss exists, its
    anchor is valid, and a loss anchored on pi_rollout is not stacked with a rho-correction (TIS,
    correction.m2po): the anchor already divides by pi_rollout and they would divide by it again.
    (MIS and Geo-RS act on r = pi_theta / pi_rollout there; OPSM tests mean log(pi_ref / pi_theta)
    with pi_ref = correction.opsm_ref under either anchor.) Raises ValueError; returns the loss.

    Cheap to call per microbatch: after the registry lookup, the rules run once per (config,
    loss) pair and are cached (both are frozen and hashable). A failed check is not cached.
    """
    spec = get_policy_loss(cfg.policy_loss)
    _checked_anchor(cfg, spec)
    loss_settings(cfg)  # the loss's own section: taken, and its values right
    return spec


@functools.lru_cache(maxsize=64)
def _checked_anchor(cfg: LossConfig, spec: PolicyLoss) -> Anchor:
    anchor = spec.anchor_for(cfg)
    rho_corrections = [("tis.level", cfg.tis.level, "TIS")] + [
        (f"correction.{corr.name}", setting, corr.name.upper())
        for corr, setting in active(cfg.correction) if corr.divides_by_rollout]
    for key, value, what in rho_corrections:
        if anchor == "rollout" and value is not None:
            where = f"{spec.anchor_key}='rollout'" if spec.anchor_key else f"policy_loss={cfg.policy_loss!r}"
            fix = f" or {spec.anchor_key} to 'old'" if spec.anchor_key else ""
            raise ValueError(f"{where} cannot be combined with {key}={value!r}: the loss anchors on "
                             f"rollout_logprobs, so {what} would double-count the off-policy correction; "
                             f"set {key} to None{fix}")
    return anchor


def input_reasons(cfg: LossConfig) -> dict[str, str]:
    """Input name -> why this config needs it (for error messages); runs check_loss_config."""
    return dict(_input_reasons(cfg, check_loss_config(cfg)))


@functools.lru_cache(maxsize=64)
def _input_reasons(cfg: LossConfig, spec: PolicyLoss) -> dict[str, str]:
    anchor = _checked_anchor(cfg, spec)
    reasons = {f"{anchor}_logprobs": f"{cfg.policy_loss} with anchor={anchor!r}"}
    if cfg.tis.level is not None:
        for name in ("old_logprobs", "rollout_logprobs"):
            reasons.setdefault(name, f"tis.level={cfg.tis.level!r}")
    for name, why in correction_inputs(cfg.correction, anchor).items():  # each correction's own needs
        reasons.setdefault(name, why)
    if cfg.kl.coef > 0:
        reasons["ref_logprobs"] = f"kl.coef={cfg.kl.coef!r}"
        if cfg.kl.is_weight:  # the weight pi / pi_rollout
            reasons.setdefault("rollout_logprobs", "kl.is_weight=True")
    if cfg.entropy_coef != 0:
        reasons["entropy"] = f"entropy_coef={cfg.entropy_coef!r}"
    return reasons


def required_inputs(cfg: LossConfig) -> set[str]:
    """Optional compute_policy_loss arguments this config needs, from the loss's anchor, TIS, the
    corrections, KL and entropy. "old_logprobs" absent means the old-logprob pass can be skipped."""
    return set(input_reasons(cfg))


def missing_input_message(cfg: LossConfig, name: str) -> str:
    return f"{input_reasons(cfg)[name]} needs {name} ({INPUT_DOCS[name]})"
