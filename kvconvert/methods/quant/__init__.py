"""Quantized KV-cache storage alone (KIVI's layout). ``config``: its options (light, read by the CLI);
``method``: the conversion (loads torch)."""

from kvconvert.methods.quant.config import QuantConfig

__all__ = ["QuantConfig"]
