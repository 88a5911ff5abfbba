"""Conversion methods: one package each (``methods/<name>/``: its typed config, its ``Method`` subclass and
the calibration or analysis code only it uses), registered in ``METHODS`` below."""

from __future__ import annotations

from typing import Any

from kvconvert.methods.base import LayerOutput, Method
from kvconvert.methods.lorc import LorcConfig, LorcMethod
from kvconvert.methods.minicache import MiniCacheConfig, MiniCacheMethod
from kvconvert.methods.quant import QuantConfig, QuantMethod
from kvconvert.methods.razor import RazorConfig, RazorMethod
from kvconvert.methods.slim import SlimConfig, SlimMethod
from kvconvert.methods.zack import ZackConfig, ZackMethod
from kvconvert.runtime.kvconvert_codec import QuantSpec

# method name -> (config dataclass, method class); recipes and batch jobs are resolved through it
METHODS: dict[str, tuple[type, type[Method]]] = {
    "slim": (SlimConfig, SlimMethod),
    "lorc": (LorcConfig, LorcMethod),
    "razor": (RazorConfig, RazorMethod),
    "zack": (ZackConfig, ZackMethod),
    "minicache": (MiniCacheConfig, MiniCacheMethod),
    "quant": (QuantConfig, QuantMethod),
}


def capability_matrix() -> str:
    """Markdown: which method converts which attention feature (docs/architectures.md's table is this text, tested)."""
    from kvconvert.arch import FEATURES

    names = list(METHODS)
    lines = ["| attention feature | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for feature, what in FEATURES.items():
        cells = ["✗" if feature in METHODS[name][1].unsupported else "✓" for name in names]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {name} × {feature}: {METHODS[name][1].unsupported[feature]}" for name in names
              for feature in FEATURES if feature in METHODS[name][1].unsupported]  # fmt: skip
    return "\n".join(lines) + "\n"


def build_method(name: str, config: Any, storage: QuantSpec | None = None, progress: bool = True) -> Method:
    """The method ``name`` with ``config``, storing its cache as ``storage`` (default 16 bits)."""
    method = METHODS[name][1](config)  # type: ignore[call-arg]
    if storage is not None:
        method.storage = storage
    method.progress = progress
    return method


__all__ = [
    "METHODS", "LayerOutput", "LorcConfig", "LorcMethod", "Method", "MiniCacheConfig", "MiniCacheMethod",
    "QuantConfig", "QuantMethod",
    "RazorConfig", "RazorMethod", "SlimConfig",
    "SlimMethod", "ZackConfig", "ZackMethod", "build_method", "capability_matrix",
]  # fmt: skip
