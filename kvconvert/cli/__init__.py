"""``kvconvert`` command line: each command parses its options, then calls the library. One module per
group of commands; importing them registers their commands on ``main``."""

from __future__ import annotations

from kvconvert.cli import analyze, evaluate, imports, jobs, methods, planner  # noqa: F401  (register the commands)
from kvconvert.cli.common import Terminated, main

__all__ = ["Terminated", "main"]
