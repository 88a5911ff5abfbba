"""Spectra and condition numbers of every layer's W_K and W_V (LoRC §3.2, appendices C and D)."""

from __future__ import annotations

from typing import Any

import torch

from kvconvert import linalg
from kvconvert.arch import adapter_for
from kvconvert.errors import KVConvertError
from kvconvert.io.source import SourceCheckpoint
from kvconvert.methods.lorc.method import LorcConfig, plan_ranks

RANK_FRACTIONS = (0.25, 0.5, 0.75)
PLAN_BUDGETS = (0.9, 0.75, 0.6, 0.5)


def analyze_spectra(source: SourceCheckpoint) -> dict[str, Any]:
    """Per layer: singular values of the full ``[n_kv·d, D]`` W_K and W_V, κ of both, the cumulative
    log10 κ̃ of eq. 12, and the relative Frobenius error of rank-truncation at a few fractions of the
    width; plus LoRC's rank plans (progressive and uniform) at a few budgets."""
    adapter = adapter_for(source.config)
    layout = adapter.layout()
    by_layer = adapter.attention_names_by_layer(source.tensor_names())
    width = layout.kv_width
    layers = []
    for layer in range(layout.num_layers):
        weights = adapter.read_attention({k: source.get(v) for k, v in by_layer[layer].items()})
        row: dict[str, Any] = {"layer": layer}
        for side, weight in (("k", weights.k_weight), ("v", weights.v_weight)):
            svals = torch.linalg.svdvals(weight.to(linalg.F64))
            row[f"kappa_{side}"] = float(svals[0] / svals[-1]) if svals[-1] > 0 else float("inf")
            row[f"singular_values_{side}"] = [float(s) for s in svals]
            row[f"rel_error_{side}"] = {
                str(f): linalg.relative_frobenius_error(svals, max(1, round(f * width))) for f in RANK_FRACTIONS
            }
        layers.append(row)
    kappa_k, kappa_v = [r["kappa_k"] for r in layers], [r["kappa_v"] for r in layers]
    log10_cum = [v / 2.302585092994046 for v in linalg.log_cumulative_condition(kappa_k, kappa_v)]
    for row, value in zip(layers, log10_cum, strict=True):
        row["log10_kappa_cum"] = value
    plans: dict[str, list[int]] = {}
    for budget in PLAN_BUDGETS:
        for schedule in ("progressive", "uniform"):
            try:
                plan = plan_ranks(LorcConfig(kv_budget=budget, schedule=schedule), kappa_k, kappa_v, width)
            except KVConvertError:
                continue  # e.g. progressive below its reachable floor
            plans[f"{schedule}@{budget}"] = [r or width for r in plan.rank_k]
    return {
        "model": source.model_id,
        "revision": source.revision,
        "num_layers": layout.num_layers,
        "num_heads": layout.num_heads,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "kv_width": width,
        "layers": layers,
        "lorc_rank_plans": plans,
    }


def analyze_heads(source: SourceCheckpoint, profile_tokens: int | None = None) -> dict[str, Any]:
    """Echo and induction scores ``[L][H]`` (RazorAttention §3.3) and the heads razor would keep."""
    from kvconvert.methods.base import PlanContext
    from kvconvert.methods.razor.method import RazorConfig, RazorMethod

    method = RazorMethod(RazorConfig(profile_tokens=profile_tokens))
    layout = adapter_for(source.config).layout()
    plan = method.plan(PlanContext(layout, source=source, progress=False))
    assert plan.echo is not None and plan.induction is not None  # the default config profiles by induction
    return {
        "echo": plan.echo.tolist(),
        "induction": plan.induction.tolist(),
        "retrieval_kv_heads": plan.retrieval_kv_heads,
        "profile_tokens": plan.profile_tokens,
    }
