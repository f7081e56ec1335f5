"""Policy-loss registry: a dict of name -> PolicyLoss, filled by a decorator and by plugins.

Built-ins register on import; third-party losses come from the entry-point group
"megatron_cispo.policy_losses", loaded lazily once. `required_inputs(cfg)` tells the policy
step which optional tensors (old/rollout/ref logprobs, entropy) a config needs.
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Callable, Literal, Union

from torch import Tensor

from ..config import LossConfig
from .common import LossInputs, Metrics

ENTRY_POINT_GROUP = "megatron_cispo.policy_losses"

Anchor = Literal["old", "rollout"]
LossFn = Callable[[LossConfig, LossInputs], tuple[Tensor, Metrics]]

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
    """fn(cfg, inputs) -> (per-token loss [b, s] fp32, Metrics); anchor names its ratio denominator."""

    name: str
    fn: LossFn
    anchor: Union[Anchor, Callable[[LossConfig], Anchor]]

    def anchor_for(self, cfg: LossConfig) -> Anchor:
        anchor = self.anchor(cfg) if callable(self.anchor) else self.anchor
        if anchor not in ("old", "rollout"):
            raise ValueError(f"policy loss {self.name!r} declared anchor {anchor!r}; expected 'old' or 'rollout'")
        return anchor

    def __call__(self, cfg: LossConfig, inputs: LossInputs) -> tuple[Tensor, Metrics]:
        return self.fn(cfg, inputs)


_REGISTRY: dict[str, PolicyLoss] = {}
_plugins_loaded = False


def register_policy_loss(name: str, *, anchor: Union[Anchor, Callable[[LossConfig], Anchor]]) -> Callable[[LossFn], LossFn]:
    """Decorator: register `fn` under `name`. Registering a name twice raises ValueError."""
    def decorate(fn: LossFn) -> LossFn:
        if name in _REGISTRY:
            raise ValueError(f"policy loss {name!r} is already registered (by {_REGISTRY[name].fn.__module__})")
        _REGISTRY[name] = PolicyLoss(name=name, fn=fn, anchor=anchor)
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


def input_reasons(cfg: LossConfig) -> dict[str, str]:
    """Input name -> why this config needs it (for error messages)."""
    spec = get_policy_loss(cfg.policy_loss)
    anchor = spec.anchor_for(cfg)
    reasons = {f"{anchor}_logprobs": f"{cfg.policy_loss} with anchor={anchor!r}"}
    if cfg.tis.level is not None:
        for name in ("old_logprobs", "rollout_logprobs"):
            reasons.setdefault(name, f"tis.level={cfg.tis.level!r}")
    if cfg.kl.coef > 0:
        reasons["ref_logprobs"] = f"kl.coef={cfg.kl.coef!r}"
    if cfg.entropy_coef != 0:
        reasons["entropy"] = f"entropy_coef={cfg.entropy_coef!r}"
    return reasons


def required_inputs(cfg: LossConfig) -> set[str]:
    """Optional compute_policy_loss arguments this config needs, from the loss's anchor, TIS, KL
    and entropy. "old_logprobs" absent means the old-logprob forward pass can be skipped."""
    return set(input_reasons(cfg))


def missing_input_message(cfg: LossConfig, name: str) -> str:
    return f"{input_reasons(cfg)[name]} needs {name} ({INPUT_DOCS[name]})"


def check_loss_config(cfg: LossConfig) -> None:
    """Checks that need the registry (so they also cover plugin losses): the loss exists, and
    a loss anchored on pi_rollout is not stacked with TIS. Raises ValueError."""
    anchor = get_policy_loss(cfg.policy_loss).anchor_for(cfg)
    if anchor == "rollout" and cfg.tis.level is not None:
        raise ValueError(f"policy_loss={cfg.policy_loss!r} anchors on rollout_logprobs and cannot be combined "
                         f"with tis.level={cfg.tis.level!r}: it would double-count the off-policy correction")
