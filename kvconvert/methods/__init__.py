"""Conversion methods: one file, one typed config and one ``Method`` subclass each."""

from __future__ import annotations

from typing import Any

from kvconvert.methods.base import LayerOutput, Method
from kvconvert.methods.lorc import LorcConfig, LorcMethod
from kvconvert.methods.minicache import MiniCacheConfig, MiniCacheMethod
from kvconvert.methods.razor import RazorConfig, RazorMethod
from kvconvert.methods.slim import SlimConfig, SlimMethod
from kvconvert.methods.zack import ZackConfig, ZackMethod

# method name -> (config dataclass, method class); recipes and batch jobs are resolved through it
METHODS: dict[str, tuple[type, type[Method]]] = {
    "slim": (SlimConfig, SlimMethod),
    "lorc": (LorcConfig, LorcMethod),
    "razor": (RazorConfig, RazorMethod),
    "zack": (ZackConfig, ZackMethod),
    "minicache": (MiniCacheConfig, MiniCacheMethod),
}


def build_method(name: str, config: Any) -> Method:
    return METHODS[name][1](config)  # type: ignore[call-arg]


__all__ = [
    "METHODS", "LayerOutput", "LorcConfig", "LorcMethod", "Method", "MiniCacheConfig", "MiniCacheMethod",
    "RazorConfig", "RazorMethod", "SlimConfig",
    "SlimMethod", "ZackConfig", "ZackMethod", "build_method",
]  # fmt: skip
