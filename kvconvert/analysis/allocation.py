"""What a method's ``--schedule auto`` would decide at several budgets, planned without converting
(``kvconvert analyze --allocation``); each method formats its own (``methods/<name>/allocation.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def planned_at_budgets(
    source: Any,
    budgets: list[float],
    make: Callable[[float], Any],
    record: Callable[[Any, Any], dict[str, Any]],
    progress: bool = True,
) -> dict[str, Any]:
    """``record(plan, layout)`` of ``make(b)``'s plan (not converted) at each budget b: what that
    conversion would write to ``kvconvert.json``, keyed by the budget as written."""
    from kvconvert.pipeline import plan_conversion

    result = {}
    for budget in budgets:
        checkpoint, plan = plan_conversion(source, make(budget), progress=progress)
        result[f"{budget:g}"] = record(plan, checkpoint.layout)
    return result
