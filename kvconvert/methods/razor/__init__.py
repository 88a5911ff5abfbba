"""RazorAttention: a full cache for retrieval heads only. ``config``: its options (light, read by the CLI);
``method``: the conversion (loads torch); ``heads``: the head profiling only it uses."""

from kvconvert.methods.razor.config import RazorConfig

__all__ = ["RazorConfig"]
