"""The generic loader of the run configuration: YAML and dotted overrides to a frozen dataclass tree.

`build` makes any frozen dataclass from plain data, driven by its type hints: unknown keys (with a
"did you mean"), wrong types, non-finite numbers and values a section's `__post_init__` rejects are
`ConfigError`s naming the dotted key. `read_yaml` is a safe load that also refuses duplicate keys
and alias bombs; `apply_overrides` sets `a.b.c=value` strings; `to_dict` / `to_yaml` write a tree
back. A field whose name cannot be a YAML key as it is (a Python keyword) names its key in its
metadata: `from_: int = dataclasses.field(default=0, metadata={"config_key": "from"})`.

Example:
    >>> @dataclasses.dataclass(frozen=True)
    ... class Section:
    ...     steps: int = 1
    >>> build(Section, apply_overrides({}, ["steps=3"]))
    Section(steps=3)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import yaml

from nvfp4_train.errors import ConfigError


def config_key(field: dataclasses.Field) -> str:
    """The YAML key of a dataclass field: its `metadata["config_key"]`, else its name."""
    return field.metadata.get("config_key", field.name)


def _describe(tp: Any) -> str:
    """A readable name for a type hint: `int`, `tuple[int, ...]`, `one of 'a', 'b'`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    args = typing.get_args(tp)
    if origin in (tuple, list) and args and dataclasses.is_dataclass(args[0]):
        return "a list of mappings"
    return getattr(tp, "__name__", None) if origin is None else str(tp).replace("typing.", "")


MAX_SHOWN = 200
"""Longest repr of a user's value shown in an error message (a value can be huge: YAML aliases)."""


def shown(value: Any) -> str:
    """`repr(value)`, cut to `MAX_SHOWN` characters."""
    cut = reprlib.Repr()
    cut.maxstring = cut.maxother = MAX_SHOWN
    text = cut.repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def _wrong_type(key: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(
        f"{key}: expected {_describe(tp)}, got {shown(value)} ({type(value).__name__})"
    )


def _finite(key: str, value: float) -> float:
    if not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    return value


def _convert_scalar(tp: type, value: Any, key: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return _finite(key, float(value))
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` as a string
            try:
                number = float(value)
            except ValueError:
                number = None
            if number is not None:
                return _finite(key, number)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any or isinstance(value, tp):
        return value
    raise _wrong_type(key, tp, value)


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Checks `value` (from YAML) against the type hint `tp` and converts it (lists to tuples)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise _wrong_type(key, tp, value)
        return build(tp, value, prefix=key)
    if origin is Literal:
        if value not in args or isinstance(value, bool) != any(isinstance(a, bool) for a in args):
            raise _wrong_type(key, tp, value)
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, key)
            except ConfigError:
                continue
        raise _wrong_type(key, tp, value)
    if origin in (tuple, list, Sequence):
        if not isinstance(value, list | tuple):
            raise _wrong_type(key, tp, value)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise _wrong_type(key, tp, value)
            items = [
                _convert(a, v, f"{key}[{i}]")
                for i, (a, v) in enumerate(zip(args, value, strict=True))
            ]
        else:
            item_tp = args[0] if args else Any
            items = [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return list(items) if origin is list else tuple(items)
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _wrong_type(key, tp, value)
        key_tp, val_tp = args if args else (Any, Any)
        return {
            _convert(key_tp, k, f"{key}.{k}"): _convert(val_tp, v, f"{key}.{k}")
            for k, v in value.items()
        }
    return _convert_scalar(tp, value, key)


def _unknown_key(cls: type, key: str, dotted: str) -> ConfigError:
    allowed = [config_key(f) for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(
        f"unknown config key {shown(dotted)}{hint}; allowed keys: {', '.join(allowed)}"
    )


def build(cls: type, mapping: Mapping[str, Any], prefix: str = "") -> Any:
    """Builds the frozen dataclass `cls` from a plain mapping, checking keys and types.

    Args:
        cls: a dataclass type whose fields have type hints (resolvable by `typing.get_type_hints`).
        mapping: values from YAML; missing keys take the field defaults.
        prefix: the dotted path of `cls` inside the whole config, for error messages.

    Returns:
        An instance of `cls`.

    Raises:
        ConfigError: an unknown key, a value of the wrong type, or a value the section rejects.
    """
    hints = typing.get_type_hints(cls)
    fields = {config_key(f): f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            raise _unknown_key(cls, str(key), dotted)
        kwargs[fields[key]] = _convert(hints[fields[key]], value, dotted)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        text = str(e) if prefix in str(e) else f"{prefix or 'config'}: {e}"
        if len(text) > 4 * MAX_SHOWN:  # a section's message quoting a huge value
            text = text[: 4 * MAX_SHOWN] + "... (message cut)"
        raise ConfigError(text) from None


MAX_NODES = 100_000
"""Values a config may hold once its YAML aliases are expanded: plenty for any config, few enough
to refuse an alias bomb (a few hundred bytes of nested aliases standing for billions of values)."""


class _Loader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool | None):
                line = key_node.start_mark.line + 1
                raise ConfigError(
                    f"a key of the YAML is a {type(key).__name__}, not a name (line {line}); "
                    "keys are plain names such as 'model' or 'd_model'"
                )
            if key in seen:
                line = key_node.start_mark.line + 1
                raise ConfigError(f"duplicate key {shown(key)} at line {line} of the YAML")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values `node` stands for once aliases are expanded (each node counted once)."""
    if id(node) not in sizes:
        sizes[id(node)] = 1  # a cycle counts once (recursive YAML)
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        sizes[id(node)] = 1 + sum(_expanded_size(c, sizes) for c in children)
    return sizes[id(node)]


def read_yaml(text: str) -> Any:
    """YAML data as `yaml.safe_load` reads it, refusing duplicate keys and alias bombs.

    Raises:
        ConfigError: duplicate keys, more than `MAX_NODES` values, nesting too deep for Python.
        yaml.YAMLError: not YAML.
    """
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {})
        if size > MAX_NODES:
            raise ConfigError(
                f"the YAML stands for {size:,} values once its aliases (*name) are expanded, "
                f"more than {MAX_NODES:,}; refusing it (an alias bomb?)"
            )
        return loader.construct_document(node)
    except RecursionError:
        raise ConfigError("the YAML is nested too deeply to read") from None
    finally:
        loader.dispose()


def parse_override(text: str) -> tuple[list[str], Any]:
    """Splits `a.b.c=value` into (['a', 'b', 'c'], value); the value is parsed as YAML.

    Raises:
        ConfigError: no `=`, an empty key or key part, or a value that is not valid YAML.
    """
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise ConfigError(f"override must look like section.key=value, got {shown(text)}")
    try:
        value = read_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {shown(text)}: the value is not valid YAML ({e})") from None
    return [p.strip() for p in parts], value


def apply_overrides(mapping: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Returns a deep copy of `mapping` with each `dotted.key=value` override set in it; a
    mapping value given for a section updates that section's keys (`optimizer={learning_rate:
    0.01}` is `optimizer.learning_rate=0.01`), it does not replace the section."""
    result = _deep_copy(mapping)
    for text in overrides:
        parts, value = parse_override(text)
        node = result
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {shown(text)}: {where!r} is a value, not a section")
            node = child
        old = node.get(parts[-1])
        node[parts[-1]] = _merged(old, value) if isinstance(old, dict) else value
    return result


def _merged(section: dict[str, Any], value: Any) -> Any:
    """A mapping override of a section updates its keys (nested sections likewise) instead of
    replacing it: `optimizer={learning_rate: 0.01}` keeps the section's other keys."""
    if not isinstance(value, Mapping):
        return value
    merged = dict(section)
    for key, item in value.items():
        old = merged.get(key)
        merged[key] = _merged(old, item) if isinstance(old, dict) else item
    return merged


def _deep_copy(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in mapping.items()}


def to_dict(cfg: Any) -> Any:
    """The config tree as plain YAML/JSON-ready data (tuples become lists)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {config_key(f): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple | list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def to_yaml(cfg: Any) -> str:
    """The config tree as a YAML document, in field order; `load_config` reads it back."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
