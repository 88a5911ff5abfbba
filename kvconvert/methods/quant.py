"""``kvconvert quant``: quantized KV-cache storage alone (KIVI's layout), every weight unchanged.

The baseline every other method is compared with at equal bytes: keys per channel over blocks of
tokens, values per token, the newest tokens unquantized (``kvconvert/runtime/kvconvert_storage.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvconvert.arch import AttentionLayout, AttentionWeights
from kvconvert.errors import KVConvertError
from kvconvert.methods.base import LayerOutput, Method


@dataclass(frozen=True)
class QuantConfig:
    """``kvconvert quant`` has no options of its own: ``--kv-bits/--kv-group/--kv-residual`` are the
    storage options every conversion command takes."""


class QuantMethod(Method):
    name = "quant"

    def __init__(self, config: QuantConfig | None = None):
        self.config = config or QuantConfig()

    @classmethod
    def describe(cls, report: dict[str, Any]) -> str:
        return "Weights and attention are unchanged; only the cache's storage is quantized (below)."

    def params(self) -> dict[str, Any]:
        return asdict(self.config)

    def check(self, layout: AttentionLayout) -> None:
        if not self.storage.quantized:
            raise KVConvertError("quant needs --kv-bits 8, 4 or 2 (16 would copy the model unchanged)")

    def convert_layer(self, layer: int, weights: AttentionWeights, dtype: torch.dtype) -> LayerOutput:
        return LayerOutput(tensors={}, report={"layer": layer}, passthrough=True)

    def expected_kv_budget(self, layout: AttentionLayout) -> float:
        return 1.0  # every token and channel kept; the storage factor comes on top
