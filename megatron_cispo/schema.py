"""The generic dict <-> frozen-dataclass loader every config section uses.

    cfg = from_dict(LossConfig, yaml_dict["loss"], path="loss")   # errors name the dotted key path
    data = apply_overrides(tree, ["loss.cispo.anchor=rollout"], schema=ExperimentConfig)

`config_field` attaches a doc string (read by `describe_fields` for docs/configuration.md);
`check_field_types` gives dataclasses built in Python the same strict types as YAML.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import re
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, field
from typing import Any, Literal, Optional, Union

import yaml


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names its dotted path."""


def config_field(default: Any = MISSING, doc: str = "", *, factory: Any = MISSING) -> Any:
    """A dataclass field with a `doc` string in its metadata (read by `describe_fields`)."""
    return field(default=default, default_factory=factory, metadata={"doc": doc})


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
        if not strict and isinstance(value, bool) and ("off", "on")[value] in args:
            value = ("off", "on")[value]  # PyYAML (YAML 1.1) reads a bare off / on as a bool
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


def loader_keys(cls: type) -> dict[str, tuple[Any, Any, str]]:
    """Keys a dataclass accepts in a dict but does not hold: `__loader_keys__ = {key: (type, expand,
    doc)}`. from_dict replaces the dict by `expand(value, rest_of_dict, dotted_path)` before building
    (a null value is just dropped), so the built config, to_dict and the dumped YAML hold only the
    resolved fields. Overrides may set such keys; describe_fields lists them."""
    return getattr(cls, "__loader_keys__", {}) if dataclasses.is_dataclass(cls) else {}


def extra_keys(cls: type) -> Optional[tuple[str, Any]]:
    """`__extra_keys__ = (field, route)`: keys the dataclass does not name for which route(key, data) is
    true go into its dict-like `field` (a plugin's own section, by name); to_dict writes them back at their
    own keys, so a dumped config reloads as it was written."""
    return getattr(cls, "__extra_keys__", None) if dataclasses.is_dataclass(cls) else None


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from a nested dict; errors name the full dotted key path.

    Unknown keys, missing required fields and wrong types raise ConfigError. ValueErrors
    from the dataclass's own validation are re-raised as ConfigError prefixed with `path`.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or '<root>'}: expected a mapping for {cls.__name__}, "
                          f"got {type(data).__name__} {data!r}")
    for key, (_, expand, _) in loader_keys(cls).items():
        if key in data:
            rest = {k: v for k, v in data.items() if k != key}
            data = rest if data[key] is None else expand(data[key], rest, _join(path, key))
    hints = _type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    extra = extra_keys(cls)
    if extra is not None:
        routed = {k: v for k, v in data.items() if k not in known and extra[1](k, data)}
        if routed:
            data = {**{k: v for k, v in data.items() if k not in routed}, extra[0]: {**data.get(extra[0], {}), **routed}}
    unknown = [k for k in data if k not in known]
    if unknown:
        raise ConfigError(f"{_join(path, unknown[0])}: unknown key; known keys: {_known_names(cls)}")
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
        extra = extra_keys(type(obj))
        out = {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
               if extra is None or f.name != extra[0]}
        if extra is not None:
            out.update({k: to_dict(v) for k, v in dict(getattr(obj, extra[0])).items()})
        return out
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
    if _has_comment(text):  # ` #...` starts a YAML comment, which safe_load dropped
        node = yaml.compose(text)  # None: the whole text is a comment, such as the name `#2`
        plain = node is None or isinstance(value, str) and isinstance(node, yaml.ScalarNode) and node.style is None
        if plain:
            return text.strip()  # a plain path or name such as `runs/exp #1`: the whole text, never a prefix of it
        raise ConfigError(f"{path or '<value>'}: {text!r} holds ' #', which YAML reads as the start of a comment, "
                          f"leaving {value!r}; remove the comment, or quote the value to pass it as a string")
    if isinstance(value, str) and _SCI_FLOAT.match(value):
        return float(value)
    return value


def _has_comment(text: str) -> bool:
    """Whether `text` (valid YAML) holds a comment: a '#' outside every token the scanner returned."""
    tokens = [(t.start_mark.index, t.end_mark.index) for t in yaml.scan(text)]
    return any(not any(a <= i < b for a, b in tokens) for i, c in enumerate(text) if c == "#")


def _known_names(cls: type) -> str:
    """The keys a dataclass takes, for an unknown-key message (its extra-keys field is written by name)."""
    extra = extra_keys(cls)
    fields = [f.name for f in dataclasses.fields(cls) if extra is None or f.name != extra[0]]
    return ", ".join([*fields, *loader_keys(cls)])


def _schema_child(schema: Any, key: str, path: str, node: Any = None) -> Any:
    """Type of field `key` inside `schema` (a dataclass, dict type or Any); errors on unknown keys."""
    args = [a for a in typing.get_args(schema) if a is not type(None)]
    if typing.get_origin(schema) in (Union, types.UnionType) and len(args) == 1:
        schema = args[0]
    if dataclasses.is_dataclass(schema):
        hints = typing.get_type_hints(schema)
        if key in loader_keys(schema):
            return loader_keys(schema)[key][0]
        extra = extra_keys(schema)
        if key not in hints and extra is not None and extra[1](key, node if isinstance(node, dict) else {}):
            return dict[str, Any]  # a section by name, as from_dict routes it
        if key not in hints:
            raise ConfigError(f"{path}: unknown key; known keys: {_known_names(schema)}")
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
                tp = _schema_child(tp, part, path, node)
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
    for name, (tp, _, doc) in loader_keys(cls).items():
        yield _join(prefix, name), type_name(tp), None, doc
    extra = extra_keys(cls)
    for f in dataclasses.fields(cls):
        if extra is not None and f.name == extra[0]:
            continue  # the sections are the plugins': documented with them
        key, tp = _join(prefix, f.name), hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from describe_fields(tp, key)
            continue
        default = f.default if f.default_factory is MISSING else f.default_factory()
        yield key, type_name(tp), default, f.metadata.get("doc", "")
