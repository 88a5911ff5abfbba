"""ZACK's calibrated rotations seen from outside: head spectra, the spread of leading singular
values across heads (ZACK tables 6–7), budget plans, and how much two calibration texts agree
on the rotations (ZACK §4.3 tables 4–5, §6.6 fig. 18)."""

from __future__ import annotations

from typing import Any

import torch

from kvconvert import linalg
from kvconvert.arch import adapter_for
from kvconvert.io.source import SourceCheckpoint
from kvconvert.methods.zack.method import HeadBases, ZackWidths, calibrate_bases, plan_for_budget

PLAN_BUDGETS = (0.9, 0.75, 0.6, 0.5)
AGREEMENT_BUDGET = 0.75  # widths at which captured energy is compared


def _layer_weights(source: SourceCheckpoint) -> Any:
    adapter = adapter_for(source.config)
    by_layer = adapter.attention_names_by_layer(source.tensor_names())
    for layer in sorted(by_layer):
        yield adapter.read_attention({k: source.get(v) for k, v in by_layer[layer].items()})


def fit(source: SourceCheckpoint, calib: str | None, tokens: int, seed: int, progress: bool) -> tuple[HeadBases, Any]:
    layout = adapter_for(source.config).layout()
    return calibrate_bases(source, layout, _layer_weights(source), calib, tokens, 512, seed, progress)


def _coefficient_of_variation(values: list[float]) -> float:
    t = torch.tensor(values, dtype=torch.float64)
    return float(t.std(unbiased=False) / t.mean())


def rotation_agreement(reference: HeadBases, other: HeadBases, plan: ZackWidths) -> dict[str, Any]:
    """ε̄ = mean |R̄| and δ̄ = mean |R̄ − R| over all heads, for R_QK and R_VW, and their ratio (the
    paper's element-wise check); and the energy of the other text that the reference bases keep at
    ``plan``'s widths, relative to the other text's own bases (``linalg.captured_energy``)."""
    result: dict[str, Any] = {}
    for side, ranks in (("qk", plan.rank_k), ("vw", plan.rank_v)):
        energy = [
            linalg.captured_energy(r, k, o, s)
            for ref_layer, other_layer, spectra, layer_ranks in zip(
                getattr(reference, side), getattr(other, side), getattr(other, f"{side}_spectrum"), ranks, strict=True
            )
            for r, o, s, k in zip(ref_layer, other_layer, spectra, layer_ranks, strict=True)
        ]
        per_head = [
            [linalg.rotation_difference(r, o) for r, o in zip(ref_layer, other_layer, strict=True)]
            for ref_layer, other_layer in zip(getattr(reference, side), getattr(other, side), strict=True)
        ]
        flat = [pair for layer in per_head for pair in layer]
        epsilon = sum(e for e, _ in flat) / len(flat)
        delta = sum(d for _, d in flat) / len(flat)
        result[side] = {
            "epsilon": epsilon,
            "delta": delta,
            "ratio": delta / epsilon,
            "ratio_per_head": [[round(d / e, 5) for e, d in layer] for layer in per_head],
            "captured_energy_mean": sum(energy) / len(energy),
            "captured_energy_min": min(energy),
        }
    return result


def analyze_rotations(
    source: SourceCheckpoint,
    calib: str | None,
    compare: str | None,
    tokens: int,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Everything ``kvconvert analyze --calib`` reports about ZACK's rotations."""
    layout = adapter_for(source.config).layout()
    head_dim, whole = layout.head_dim, frozenset(layout.local_layers)  # sliding-window layers: as a conversion
    bases, calib_set = fit(source, calib, tokens, seed, progress)
    result: dict[str, Any] = {"calib": calib_set.source, "tokens": calib_set.tokens}
    for side in ("qk", "vw"):
        spectra = getattr(bases, f"{side}_spectrum")
        leading = [float(s[0]) for layer in spectra for s in layer]
        result[f"{side}_max_sv_cv"] = _coefficient_of_variation(leading)
        normalized = torch.stack([s / s[0] for layer in spectra for s in layer])
        result[f"{side}_mean_normalized_spectrum"] = [round(float(v), 5) for v in normalized.mean(0)]
    result["plans"] = {}
    for budget in PLAN_BUDGETS:
        plan = plan_for_budget(bases, budget, head_dim, whole=whole)
        result["plans"][str(budget)] = {"removal_rate": plan.removal_rate, "kv_budget": plan.budget,
                                        "rank_k": plan.rank_k, "rank_v": plan.rank_v}  # fmt: skip
    if compare is not None:
        other, other_set = fit(source, compare, tokens, seed, progress)
        plan = plan_for_budget(bases, AGREEMENT_BUDGET, head_dim, whole=whole)
        result["compare"] = {"calib": other_set.source, "tokens": other_set.tokens, "at_budget": AGREEMENT_BUDGET,
                             **rotation_agreement(bases, other, plan)}  # fmt: skip
    return result


def rotations_table(result: dict[str, Any]) -> str:
    """``analyze --rotations``' text: the spread of leading singular values, the plans, the agreement."""
    lines = [f"ZACK rotations on {result['calib']} ({result['tokens']} tokens): CV of leading singular values "
             f"across heads: QK {result['qk_max_sv_cv']:.1%}, VW {result['vw_max_sv_cv']:.1%}"]  # fmt: skip
    for budget, plan in result["plans"].items():
        lines.append(f"  budget {budget}: r = {plan['removal_rate']:.4f} (achieved {plan['kv_budget']:.3f})")
    if "compare" in result:
        cmp = result["compare"]
        for side, title in (("qk", "R_QK"), ("vw", "R_VW")):
            row = cmp[side]
            lines.append(f"  vs {cmp['calib']}: {title} ε̄ = {row['epsilon']:.3e}, δ̄ = {row['delta']:.3e}, "
                         f"δ̄/ε̄ = {row['ratio']:.2%}; energy kept at budget {cmp['at_budget']}: "
                         f"{row['captured_energy_mean']:.2%} (min {row['captured_energy_min']:.2%})")  # fmt: skip
    return "\n".join(lines)
