"""Loss configuration (frozen dataclasses) and a generic dict <-> dataclass loader.

`LossConfig` mirrors the `loss:` section of an experiment YAML one-to-one. Build it with
`from_dict(LossConfig, yaml_dict["loss"], path="loss")`; `apply_overrides` applies
`a.b.c=value` command-line overrides first, and `describe_fields` feeds the config docs.
Each section checks only its own fields; rules that need the loss registry (the loss name, a
rollout anchor stacked with TIS) are `losses.check_loss_config`.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any, Literal, Optional, Union

import yaml


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names its dotted path."""


def config_field(default: Any = MISSING, doc: str = "", *, factory: Any = MISSING) -> Any:
    """A dataclass field with a `doc` string in its metadata (read by `describe_fields`)."""
    return field(default=default, default_factory=factory, metadata={"doc": doc})


def _require(ok: bool, owner: object, name: str, requirement: str) -> None:
    if not ok:
        value = getattr(owner, name)
        raise ValueError(f"{type(owner).__name__}.{name} must be {requirement}, got {value!r}")


def check_field_types(obj: object) -> None:
    """Raise ValueError when a field of dataclass `obj` is not of its annotated type.

    The same rules as `from_dict`, minus conversion: a str is not a bool, a bool is not an int,
    a float is not an int, a dict is not a nested section; an int is a float (YAML `lr: 1`).
    Call it first in `__post_init__`, so range checks never compare a wrong type.
    """
    hints = _type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.init:
            try:
                _convert(hints[f.name], getattr(obj, f.name), f"{type(obj).__name__}.{f.name}", strict=True)
            except ConfigError as e:
                raise ValueError(str(e)) from None


def _check_clip(section: object) -> None:
    _require(0.0 <= section.eps_low <= 1.0, section, "eps_low", "in [0, 1]")
    _require(section.eps_high >= 0.0, section, "eps_high", ">= 0")


@dataclass(frozen=True, kw_only=True)
class CispoConfig:
    eps_low: float = config_field(1.0, "Weight floor offset: weight = clamp(r, 1-eps_low, 1+eps_high).")
    eps_high: float = config_field(4.0, "Weight cap offset; 4.0 caps r at 5 (ms-swift --epsilon_high 5.0).")
    anchor: Literal["old", "rollout"] = config_field(
        "old", "Ratio denominator: 'old' = trainer-recomputed pi_old, 'rollout' = sampler logprobs.")
    token_mask: bool = config_field(False, "MiniMax-M1 token mask: zero tokens the PPO clip would drop.")
    mask_eps_low: float = config_field(0.2, "Token mask: drop A<0 tokens with r < 1-mask_eps_low.")
    mask_eps_high: float = config_field(0.28, "Token mask: drop A>0 tokens with r > 1+mask_eps_high.")

    def __post_init__(self) -> None:
        check_field_types(self)  # the Literal fields included
        _check_clip(self)
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
    coef: float = config_field(0.0, "Weight of the KL(pi || pi_ref) penalty added to the per-token loss.")
    estimator: Literal["k1", "k2", "k3"] = config_field("k3", "Per-token KL estimator (Schulman's k1/k2/k3).")

    def __post_init__(self) -> None:
        check_field_types(self)  # the Literal fields included
        _require(math.isfinite(self.coef) and self.coef >= 0.0, self, "coef", "finite and >= 0")


LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    policy_loss: str = config_field("cispo", "Registered loss name: cispo, ppo, rollout_is or a plugin.")
    loss_agg: LossAgg = config_field("token_mean", "How per-token losses become one global scalar.")
    max_len: Optional[int] = config_field(None, "Divisor for seq_mean_token_sum_norm (required there).")
    entropy_coef: float = config_field(0.0, "Entropy bonus: adds -entropy_coef * entropy per token.")
    head: Literal["logits", "fused"] = config_field(
        "logits", "Output head: 'logits' scores the model's logits; 'fused' runs the output layer and the "
        "logprobs chunk by chunk (fused_token_logprobs), so the [tokens, vocab/tp] logits never exist.")
    head_fp32: bool = config_field(
        False, "Fused head only: run its matmul in fp32 from bf16 parameters (ScaleRL's fp32 LM head).")
    cispo: CispoConfig = config_field(factory=CispoConfig, doc="CISPO loss settings.")
    ppo: PPOConfig = config_field(factory=PPOConfig, doc="PPO clipped-surrogate settings.")
    rollout_is: RolloutISConfig = config_field(factory=RolloutISConfig, doc="rollout_is loss settings.")
    tis: TISConfig = config_field(factory=TISConfig, doc="Truncated importance sampling.")
    kl: KLConfig = config_field(factory=KLConfig, doc="KL penalty against the reference policy.")

    def __post_init__(self) -> None:
        check_field_types(self)
        _require(bool(self.policy_loss), self, "policy_loss", "a registered loss name")
        _require(self.max_len is None or self.max_len > 0, self, "max_len", "None or > 0")
        _require(math.isfinite(self.entropy_coef), self, "entropy_coef", "finite")
        _require(not self.head_fp32 or self.head == "fused", self, "head_fp32", "False unless head='fused'")
        if self.loss_agg == "seq_mean_token_sum_norm" and self.max_len is None:
            raise ValueError("LossConfig.max_len must be > 0 when loss_agg='seq_mean_token_sum_norm', got None")


# ---------------------------------------------------------------- generic loader


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def type_name(tp: Any) -> str:
    """Readable type name for errors and docs: float, int | None, 'old' | 'rollout'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join("None" if a is type(None) else type_name(a) for a in args)
    if origin in (tuple, list, dict):
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    return getattr(tp, "__name__", str(tp))


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fail(path: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"{path or '<root>'}: expected {type_name(tp)}, got {type(value).__name__} {value!r}")


def _convert(tp: Any, value: Any, path: str, strict: bool = False) -> Any:
    """`value` as type `tp` (YAML lists -> tuples, dicts -> dataclasses, int -> float), else ConfigError.
    strict: only check (an int still passes as a float), for the fields of a built dataclass."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, path, strict)
            except ConfigError:
                continue
        raise _fail(path, tp, value)
    if origin is Literal:
        # `type(a) is type(value)` keeps True from matching a Literal[1].
        if any(a == value and type(a) is type(value) for a in args):
            return value
        raise _fail(path, tp, value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # built, so its own __post_init__ checked it
            return value
        if strict:
            raise ConfigError(f"{path} must be a {tp.__name__}, got {type(value).__name__}; write "
                              f"{tp.__name__}(...), or build the whole config from a dict with from_dict")
        return from_dict(tp, value, path)
    if origin in (tuple, list):
        if not isinstance(value, origin if strict else (list, tuple)):
            raise _fail(path, tp, value)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise _fail(path, tp, value)
            return tuple(_convert(a, v, _join(path, i), strict) for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_convert(item, v, _join(path, i), strict) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _fail(path, tp, value)
        key_tp, val_tp = args or (Any, Any)
        return {_convert(key_tp, k, path, strict): _convert(val_tp, v, _join(path, k), strict)
                for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return value if strict else float(value)
    if tp in (int, float) and isinstance(value, bool):
        raise _fail(path, tp, value)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _fail(path, tp, value)


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from a nested dict; errors name the full dotted key path.

    Unknown keys, missing required fields and wrong types raise ConfigError. ValueErrors
    from the dataclass's own validation are re-raised as ConfigError prefixed with `path`.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or '<root>'}: expected a mapping for {cls.__name__}, "
                          f"got {type(data).__name__} {data!r}")
    hints = _type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in known]
    if unknown:
        raise ConfigError(f"{_join(path, unknown[0])}: unknown key; known keys: {', '.join(known)}")
    kwargs = {}
    for name, f in known.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], _join(path, name))
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"{_join(path, name)}: required key missing ({type_name(hints[name])})")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from e


def to_dict(obj: Any) -> Any:
    """Dataclass (nested) -> plain dicts, lists and scalars; inverse of from_dict."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# YAML 1.1 reads "1e-3" (no dot) as a string; overrides like lr=1e-3 must stay numbers.
_SCI_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def parse_override_value(text: str, path: str = "") -> Any:
    """`text` parsed as a YAML value (`1e-3` stays a float); ConfigError naming `path` if it is not YAML."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        problem, quoted = getattr(e, "problem", None) or str(e).splitlines()[0], f'"{text}"'
        raise ConfigError(f"{path or '<value>'}: {text!r} is not a valid YAML value ({problem}); "
                          f"to pass it as a string, quote it: {quoted!r}") from None
    if isinstance(value, str) and _SCI_FLOAT.match(value):
        return float(value)
    return value


def _schema_child(schema: Any, key: str, path: str) -> Any:
    """Type of field `key` inside `schema` (a dataclass, dict type or Any); errors on unknown keys."""
    args = [a for a in typing.get_args(schema) if a is not type(None)]
    if typing.get_origin(schema) in (Union, types.UnionType) and len(args) == 1:
        schema = args[0]
    if dataclasses.is_dataclass(schema):
        hints = typing.get_type_hints(schema)
        if key not in hints:
            names = ", ".join(f.name for f in dataclasses.fields(schema))
            raise ConfigError(f"{path}: unknown key; known keys: {names}")
        return hints[key]
    if typing.get_origin(schema) is dict or schema is Any:
        return typing.get_args(schema)[1] if typing.get_args(schema) else Any
    raise ConfigError(f"{path}: cannot set a key inside a value of type {type_name(schema)}")


def apply_overrides(data: Mapping, overrides: list[str], *, schema: Any = None) -> dict:
    """Return a copy of `data` with dotted `a.b.c=value` overrides applied (values parsed as YAML).

    With `schema` (a dataclass type) a path is checked against its fields, so keys the YAML
    left at their defaults can be set; without it every key on the path must exist in `data`.
    """
    out = copy.deepcopy(dict(data))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like a.b.c=value")
        parts, node, tp, path = key.strip().split("."), out, schema, ""
        for i, part in enumerate(parts):
            path = _join(path, part)
            if tp is not None:
                tp = _schema_child(tp, part, path)
            elif not isinstance(node, dict) or part not in node:
                raise ConfigError(f"{path}: unknown key in override {item!r}")
            if i == len(parts) - 1:
                node[part] = parse_override_value(text, path)
            else:
                child = node.get(part)
                if child is None:
                    child = node[part] = {}
                elif not isinstance(child, dict):
                    raise ConfigError(f"{path}: is a {type(child).__name__}, cannot set {key!r} inside it")
                node = child
    return out


def describe_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, str, Any, str]]:
    """Yield (dotted_key, type_str, default, doc) for every leaf field; default is MISSING if required."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, tp = _join(prefix, f.name), hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from describe_fields(tp, key)
            continue
        default = f.default if f.default_factory is MISSING else f.default_factory()
        yield key, type_name(tp), default, f.metadata.get("doc", "")
