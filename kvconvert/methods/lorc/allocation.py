"""``kvconvert analyze --allocation``, LoRC's part: the ranks ``--schedule auto`` gives each layer and side
(or ``--latent joint``'s one latent) at several budgets, and their text."""

from __future__ import annotations

from typing import Any

from kvconvert.analysis.allocation import planned_at_budgets
from kvconvert.methods.lorc.config import LorcConfig


def auto_allocation(source: Any, budgets: list[float], calib: str | None, calib_tokens: int, seed: int,
                    latent: str = "separate") -> dict[str, Any]:  # fmt: skip
    """``lorc --schedule auto [--latent joint]``'s ranks per layer and side at each budget (joint: the one
    latent's rank twice, and the weights of K's and V's errors in it)."""
    from kvconvert.methods.lorc.method import LorcMethod

    def make(budget: float) -> LorcMethod:
        return LorcMethod(LorcConfig(kv_budget=budget, schedule="auto", calib=calib, calib_tokens=calib_tokens,
                                     seed=seed, latent=latent))  # type: ignore[arg-type]  # fmt: skip

    def record(planned: Any, layout: Any) -> dict[str, Any]:
        plan = planned.ranks
        return {"budget": plan.budget, "rank_k": plan.rank_k, "rank_v": plan.rank_v, "probe_rank": plan.probe_rank,
                "probe_kl_k": plan.probe_kl_k, "probe_kl_v": plan.probe_kl_v,
                **({"joint_scales": plan.joint_scales} if plan.joint_scales is not None else {})}  # fmt: skip

    return planned_at_budgets(source, budgets, make, record)


def allocation_table(result: dict[str, Any]) -> str:
    lines = ["LoRC --schedule auto (ranks by measured loss; K/V per layer):"]
    for budget, plan in result.items():
        ranks = " ".join(f"{k}/{v}" for k, v in zip(plan["rank_k"], plan["rank_v"], strict=True))
        lines.append(f"  budget {budget} (achieved {plan['budget']:.3f}, probed at rank {plan['probe_rank']}): {ranks}")
    return "\n".join(lines)


def joint_allocation_table(result: dict[str, Any]) -> str:
    lines = ["LoRC --latent joint (one latent per layer for K and V, its rank by measured loss):"]
    for budget, plan in result.items():
        ranks = " ".join("-" if r is None else str(r) for r in plan["rank_k"])
        lines.append(f"  budget {budget} (achieved {plan['budget']:.3f}): {ranks}")
    return "\n".join(lines)
