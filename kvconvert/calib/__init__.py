"""Calibration and profiling machinery: hooks in context managers, statistics accumulated online."""
