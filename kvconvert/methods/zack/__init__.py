"""ZACK: calibrated per-head rotations and widths. ``config``: its options (light, read by the CLI);
``method``: the conversion (loads torch); ``rotations``, ``search``: the analysis and search only it uses."""

from kvconvert.methods.zack.config import ZackConfig

__all__ = ["ZackConfig"]
