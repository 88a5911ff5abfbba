"""Slim attention (Graef & Wasielewski 2025): cache K only, V = K·W_KV. ``config``: its options (light, read
by the CLI); ``method``: the conversion (loads torch)."""

from kvconvert.methods.slim.config import SlimConfig

__all__ = ["SlimConfig"]
