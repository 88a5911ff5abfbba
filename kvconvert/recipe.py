"""Typed recipes: YAML presets that map onto a method's config dataclass.

Unknown keys, wrong types and out-of-range values are one-line errors naming the key and the file.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from kvconvert.errors import KVConvertError
from kvconvert.methods.slim import SlimConfig

METHOD_CONFIGS: dict[str, type] = {"slim": SlimConfig}


def parse_recipe(data: Any, source: str = "<recipe>") -> tuple[str, Any]:
    """(method name, config instance) from a mapping ``{method: NAME, <option>: value, ...}``."""
    if not isinstance(data, dict) or "method" not in data:
        raise KVConvertError(f"{source}: a recipe is a mapping with a 'method' key")
    options = {k: v for k, v in data.items() if k != "method"}
    method = data["method"]
    if method not in METHOD_CONFIGS:
        raise KVConvertError(f"{source}: unknown method {method!r}; known: {', '.join(sorted(METHOD_CONFIGS))}")
    config_class = METHOD_CONFIGS[method]
    hints = typing.get_type_hints(config_class)
    fields = {f.name for f in dataclasses.fields(config_class)}
    for key, value in options.items():
        if key not in fields:
            raise KVConvertError(f"{source}: unknown key {key!r} for {method}; allowed: {', '.join(sorted(fields))}")
        expected = hints[key]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) if expected is float else None
        if ok is None:
            ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if not ok:
            raise KVConvertError(
                f"{source}: {key!r} must be {getattr(expected, '__name__', expected)}, got {type(value).__name__}"
            )
    try:
        return method, config_class(**options)
    except KVConvertError as exc:
        raise KVConvertError(f"{source}: {exc}") from None


def load_recipe(path: Path) -> tuple[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise KVConvertError(f"{path}: cannot read recipe ({str(exc).splitlines()[0]})") from None
    return parse_recipe(data, str(path))
