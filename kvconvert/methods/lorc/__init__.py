"""LoRC: low-rank K/V weights with a progressive rank schedule. ``config``: its options (light, read by the
CLI); ``method``: the conversion (loads torch); ``refine``: the layer-wise refinement only it uses."""

from kvconvert.methods.lorc.config import LorcConfig

__all__ = ["LorcConfig"]
