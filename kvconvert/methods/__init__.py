"""Conversion methods: one package each (``methods/<name>/``: ``config`` with its options, ``method`` with its
``Method`` subclass, and the calibration or analysis code only it uses), registered in ``METHODS`` below.

Importing this package loads neither torch nor click: the CLI builds every command (and ``kvconvert --help``)
from the configs, and a method's code loads when it runs."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvconvert.methods.lorc import LorcConfig
from kvconvert.methods.minicache import MiniCacheConfig
from kvconvert.methods.quant import QuantConfig
from kvconvert.methods.razor import RazorConfig
from kvconvert.methods.slim import SlimConfig
from kvconvert.methods.zack import ZackConfig

if TYPE_CHECKING:
    from kvconvert.methods.base import Method
    from kvconvert.runtime.kvconvert_codec import QuantSpec


@dataclass(frozen=True)
class Registered:
    """A method: its config dataclass and where its ``Method`` subclass lives (``module:Class``)."""

    config: type
    path: str

    @property
    def method(self) -> type[Method]:
        module, name = self.path.split(":")
        return getattr(importlib.import_module(module), name)


# Recipes, batch jobs, the CLI's commands and the planner all resolve methods through this table.
METHODS: dict[str, Registered] = {
    "slim": Registered(SlimConfig, "kvconvert.methods.slim.method:SlimMethod"),
    "lorc": Registered(LorcConfig, "kvconvert.methods.lorc.method:LorcMethod"),
    "razor": Registered(RazorConfig, "kvconvert.methods.razor.method:RazorMethod"),
    "zack": Registered(ZackConfig, "kvconvert.methods.zack.method:ZackMethod"),
    "minicache": Registered(MiniCacheConfig, "kvconvert.methods.minicache.method:MiniCacheMethod"),
    "quant": Registered(QuantConfig, "kvconvert.methods.quant.method:QuantMethod"),
}


def capability_matrix() -> str:
    """Markdown: which method converts which attention feature (docs/architectures.md's table is this text, tested)."""
    from kvconvert.arch import FEATURES

    names = list(METHODS)
    unsupported = {name: METHODS[name].method.unsupported for name in names}
    lines = ["| attention feature | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for feature, what in FEATURES.items():
        cells = ["✗" if feature in unsupported[name] else "✓" for name in names]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {name} × {feature}: {unsupported[name][feature]}" for name in names
              for feature in FEATURES if feature in unsupported[name]]  # fmt: skip
    return "\n".join(lines) + "\n"


def build_method(name: str, config: Any, storage: QuantSpec | None = None) -> Method:
    """The method ``name`` with ``config``, storing its cache as ``storage`` (default 16 bits)."""
    method = METHODS[name].method(config)  # type: ignore[call-arg]
    if storage is not None:
        method.storage = storage
    return method


__all__ = [
    "METHODS", "LorcConfig", "MiniCacheConfig", "QuantConfig", "RazorConfig", "Registered", "SlimConfig",
    "ZackConfig", "build_method", "capability_matrix",
]  # fmt: skip
