"""Conversion methods: one file, one typed config and one ``Method`` subclass each."""

from kvconvert.methods.base import LayerOutput, Method
from kvconvert.methods.slim import SlimConfig, SlimMethod

__all__ = ["LayerOutput", "Method", "SlimConfig", "SlimMethod"]
