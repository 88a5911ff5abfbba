"""Typed recipes: YAML presets that map onto a method's config dataclass, plus the cache storage
every method shares (``kv_bits``, ``kv_group``, ``kv_residual``, ``kv_sink``, ``kv_rotate``, ``kv_include_local``).

Unknown keys, wrong types and out-of-range values are one-line errors naming the key and the file.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from kvconvert.errors import KVConvertError
from kvconvert.methods import METHODS
from kvconvert.methods.base import Method
from kvconvert.runtime.kvconvert_codec import QuantSpec

# recipe key -> QuantSpec field: the storage options of every conversion command
STORAGE_KEYS = {"kv_bits": "bits", "kv_group": "group", "kv_residual": "residual", "kv_sink": "sink",
                "kv_rotate": "rotate", "kv_include_local": "include_local", "kv_layout": "layout",
                "kv_format": "format", "kv_scale_strategy": "scale_strategy",
                "kv_local_bits": "local_bits", "kv_value_bits": "value_bits"}  # fmt: skip
FLAGS = {"kv_rotate", "kv_include_local"}  # the storage keys that take true/false
WORDS = {"kv_layout", "kv_format", "kv_scale_strategy"}  # the storage keys that take a word


def storage_spec(values: dict[str, Any], source: str, base: QuantSpec | None = None) -> QuantSpec:
    """``QuantSpec`` from recipe-style keys (missing ones from ``base``); bad values are one line."""
    fields = dataclasses.asdict(base or QuantSpec())
    for key, value in values.items():
        if value is None:
            continue
        expected = bool if key in FLAGS else str if key in WORDS else int
        if not _matches(value, expected):
            raise KVConvertError(f"{source}: {key!r} must be {expected.__name__}, got {value!r}")
        fields[STORAGE_KEYS[key]] = value
    if values.get("kv_local_bits") is not None and values.get("kv_include_local") is None:
        fields["include_local"] = True  # a width for the sliding-window layers quantizes them
    if fields["format"] == "fp8":  # the engines' format has one width and no exact tokens: unless said otherwise
        fields["bits"] = 8 if values.get("kv_bits") is None else fields["bits"]
        fields["residual"] = 0 if values.get("kv_residual") is None else fields["residual"]
    try:
        return QuantSpec(**fields)
    except ValueError as exc:
        raise KVConvertError(f"{source}: {exc}") from None


def _matches(value: Any, expected: Any) -> bool:
    """Does a YAML value fit a config field's annotation (float, bool, Literal, X | None…)?"""
    origin = typing.get_origin(expected)
    if origin is typing.Literal:
        return value in typing.get_args(expected)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arm) for arm in typing.get_args(expected))
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _describe(expected: Any) -> str:
    origin = typing.get_origin(expected)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(expected))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arm) for arm in typing.get_args(expected))
    return "null" if expected is type(None) else getattr(expected, "__name__", str(expected))


def parse_recipe(data: Any, source: str = "<recipe>") -> tuple[str, Any, QuantSpec]:
    """(method name, config instance, cache storage) from ``{method: NAME, <option>: value, ...}``."""
    if not isinstance(data, dict) or "method" not in data:
        raise KVConvertError(f"{source}: a recipe is a mapping with a 'method' key")
    storage = storage_spec({k: v for k, v in data.items() if k in STORAGE_KEYS}, source)
    options = {k: v for k, v in data.items() if k != "method" and k not in STORAGE_KEYS}
    method = data["method"]
    if method not in METHODS:
        raise KVConvertError(f"{source}: unknown method {method!r}; known: {', '.join(sorted(METHODS))}")
    config_class = METHODS[method].config
    hints = typing.get_type_hints(config_class)
    fields = {f.name for f in dataclasses.fields(config_class)}
    for key, value in options.items():
        if key not in fields:
            allowed = ", ".join(sorted(fields | set(STORAGE_KEYS)))
            raise KVConvertError(f"{source}: unknown key {key!r} for {method}; allowed: {allowed}")
        if not _matches(value, hints[key]):
            raise KVConvertError(f"{source}: {key!r} must be {_describe(hints[key])}, got {value!r}")
    required = [
        f.name
        for f in dataclasses.fields(config_class)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in options]
    if missing:
        raise KVConvertError(f"{source}: {method} needs {', '.join(repr(m) for m in missing)}")
    try:
        return method, config_class(**options), storage
    except KVConvertError as exc:
        raise KVConvertError(f"{source}: {exc}") from None


MAX_YAML_BYTES = 1 << 20  # recipes and jobs files are a few hundred bytes; refuse anything absurd


class _NoAliasLoader(yaml.SafeLoader):
    """safe_load without anchors and aliases: a few hundred bytes of nested aliases expand into
    gigabytes (the "billion laughs"), and no recipe or jobs file needs them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.YAMLError(f"YAML aliases (*name) are not allowed (line {mark.line + 1})")
        return super().compose_node(parent, index)


def read_yaml(path: Path, what: str) -> Any:
    """A recipe or jobs file's data: UTF-8, at most 1 MiB, no aliases; every failure one line naming it."""
    try:
        if path.is_dir():
            raise KVConvertError(f"{path}: cannot read {what} (it is a directory)")
        if path.stat().st_size > MAX_YAML_BYTES:
            raise KVConvertError(f"{path}: cannot read {what} (larger than {MAX_YAML_BYTES} bytes)")
        return yaml.load(path.read_bytes().decode("utf-8"), Loader=_NoAliasLoader)  # noqa: S506 (safe loader)
    except UnicodeDecodeError as exc:
        raise KVConvertError(f"{path}: cannot read {what} (not UTF-8 text: byte {exc.start})") from None
    except (OSError, yaml.YAMLError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise KVConvertError(f"{path}: cannot read {what} ({reason})") from None


def load_recipe(path: Path) -> tuple[str, Any, QuantSpec]:
    return parse_recipe(read_yaml(path, "recipe"), str(path))


def recipe_text(method: Method[Any]) -> str:
    """The recipe that reproduces ``method``: every option spelled out, defaults included; the storage
    keys only when the cache is quantized (so 16-bit recipes read as they always did)."""
    storage = method.storage  # what was asked for: widths a plan allocates (quant --kv-budget) are its result
    keys: dict[str, int | bool] = {}
    if storage != QuantSpec():
        spec = storage.to_spec()  # the fields that differ from the defaults, as the runtime spec has them
        if not storage.quantized:
            del spec["bits"]  # 16: the method's own (a budget's widths come from its plan)
        keys = {key: spec[field] for key, field in STORAGE_KEYS.items() if field in spec}
    return yaml.safe_dump({"method": method.name, **method.params(), **keys}, sort_keys=False)
