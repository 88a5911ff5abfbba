"""``kvconvert analyze --allocation``, ZACK's part: the widths ``--schedule auto`` gives each layer, KV
head and side at several budgets, and their text."""

from __future__ import annotations

from typing import Any

from kvconvert.analysis.allocation import planned_at_budgets
from kvconvert.methods.zack.config import ZackConfig


def auto_allocation(source: Any, budgets: list[float], calib: str | None, calib_tokens: int,
                    seed: int) -> dict[str, Any]:  # fmt: skip
    """``zack --schedule auto``'s widths per layer, KV head and side at each budget."""
    from kvconvert.methods.zack.method import ZackMethod

    def make(budget: float) -> ZackMethod:
        return ZackMethod(ZackConfig(kv_budget=budget, schedule="auto", calib=calib, calib_tokens=calib_tokens,
                                     seed=seed))  # fmt: skip

    def record(planned: Any, layout: Any) -> dict[str, Any]:
        plan = planned.widths
        return {"budget": plan.budget, "rank_k": plan.rank_k, "rank_v": plan.rank_v, "probe_kl": plan.probe_kl,
                "head_dim": layout.head_dim}  # fmt: skip

    return planned_at_budgets(source, budgets, make, record)


def allocation_table(result: dict[str, Any]) -> str:
    lines = ["ZACK --schedule auto (widths by measured loss; per layer, K heads | V heads):"]
    for budget, plan in result.items():
        lines.append(f"  budget {budget} (achieved {plan['budget']:.3f}, of {plan['head_dim']} per head):")
        for layer, (k, v) in enumerate(zip(plan["rank_k"], plan["rank_v"], strict=True)):
            lines.append(f"    {layer:>3}  {' '.join(map(str, k))} | {' '.join(map(str, v))}")
    return "\n".join(lines)
