"""MiniCache: cross-layer merging of the KV cache. ``config``: its options (light, read by the CLI);
``method``: the conversion (loads torch); ``layer_similarity``, ``subspace``: the calibration only it uses."""

from kvconvert.methods.minicache.config import MiniCacheConfig

__all__ = ["MiniCacheConfig"]
