"""Quantized-cache runtime (``kvconvert quant``): stock attention, every layer's K/V in quantized
storage (``kvconvert_storage.QuantizedLayer``: keys per channel, values per token, recent tokens exact).
Copied verbatim into every output directory; imports only torch and transformers.
"""

from __future__ import annotations

from typing import Any

from .kvconvert_common import LayerStateCache
from .kvconvert_storage import QuantizedLayer, QuantSpec, sliding_layer


def make_attention(spec: dict[str, Any], layer_idx: int, rotary: Any) -> None:
    """Attention modules and weights stay stock."""
    return None


def make_cache(spec: dict[str, Any]) -> LayerStateCache:
    quant = QuantSpec.from_spec(spec)
    layers = range(len(spec["attention_modules"]))
    return LayerStateCache([sliding_layer(spec, i) or QuantizedLayer(quant, i) for i in layers])
