"""``kvconvert analyze``: spectra, condition numbers, head scores, rotations, layer similarity, allocations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from kvconvert.cli.common import main, user_errors
from kvconvert.cli.options import calibration_options, source_options
from kvconvert.errors import KVConvertError
from kvconvert.io.outdir import refuse_existing


@main.command()
@source_options
@click.option("--out", "out", type=click.Path(path_type=Path), default=None, help="Directory (default NAME-analysis).")
@click.option("--force", is_flag=True, help="Replace an existing --out.")
@click.option("--heads", is_flag=True, help="Also profile echo/induction scores per head (runs the model).")
@click.option("--profile-tokens", type=int, default=None, help="With --heads: K random tokens (repeated 4×).")
@click.option("--rotations", is_flag=True, help="Also fit ZACK's per-head rotations on --calib (runs the model).")
@click.option("--compare-calib", default=None, help="With --rotations: refit on this text, report δ/ε (ZACK §4.3).")
@click.option(
    "--layer-similarity", is_flag=True, help="Also measure adjacent layers' K/V similarity on --calib (MiniCache)."
)
@click.option(
    "--allocation", default=None,
    help="Comma-separated KV budgets: also run `lorc --schedule auto`'s probes on --calib and draw its ranks per layer "
         "and side at each (runs the model).",
)  # fmt: skip
@click.option(
    "--allocation-method", "allocation_methods", type=click.Choice(["lorc", "lorc-joint", "zack"]), multiple=True,
    default=("lorc",), show_default=True,
    help="Whose --schedule auto --allocation draws (repeatable): LoRC's ranks, LoRC --latent joint's one latent "
         "per layer, ZACK's widths per KV head.",
)  # fmt: skip
@calibration_options
@user_errors
def analyze(
    model: str,
    revision: str | None,
    allow_pickle: bool,
    device: str,
    out: Path | None,
    force: bool,
    heads: bool,
    profile_tokens: int | None,
    rotations: bool,
    compare_calib: str | None,
    layer_similarity: bool,
    allocation: str | None,
    allocation_methods: tuple[str, ...],
    calib: str | None,
    calib_tokens: int,
    seed: int,
) -> None:
    """Spectra and condition numbers of W_K/W_V per layer, LoRC rank plans, (--heads) echo and
    induction scores of every head, (--rotations) ZACK head spectra, plans and calibration
    agreement, (--layer-similarity) adjacent-layer K/V similarity, (--allocation) LoRC's ranks or
    ZACK's widths by measured loss: analysis.json + PNG plots."""
    import json

    from kvconvert.analysis.plots import (
        plot_condition,
        plot_head_scores,
        plot_layer_similarity,
        plot_ranks,
        plot_spectra,
        plot_zack_allocation,
    )
    from kvconvert.devices import computing_on, resolve_device
    from kvconvert.io.outdir import atomic_output_dir
    from kvconvert.io.source import open_source

    budgets = _budget_list(allocation)
    compute = computing_on(resolve_device(device))
    source = open_source(model, revision=revision, allow_pickle=allow_pickle)
    out = out or Path(f"{Path(source.model_id).name}-analysis")
    refuse_existing(out, force)  # before the analysis, which takes minutes (checked again when writing)
    source.check()
    with compute:
        analysis = _analysis(source, heads, profile_tokens, rotations, compare_calib, layer_similarity, calib,
                             calib_tokens, seed)  # fmt: skip
        if budgets and "lorc" in allocation_methods:
            analysis["lorc_auto"] = _auto_allocation(source, budgets, calib, calib_tokens, seed)
        if budgets and "lorc-joint" in allocation_methods:
            analysis["lorc_joint"] = _auto_allocation(source, budgets, calib, calib_tokens, seed, latent="joint")
        if budgets and "zack" in allocation_methods:
            analysis["zack_auto"] = _zack_allocation(source, budgets, calib, calib_tokens, seed)
    with atomic_output_dir(out, replace=force, sources=[source.path], command="analyze") as tmp:
        (tmp / "analysis.json").write_text(json.dumps(analysis, indent=2) + "\n")
        plot_spectra(analysis, tmp / "spectra.png")
        plot_condition(analysis, tmp / "condition.png")
        plot_ranks(analysis, tmp / "ranks.png")
        if heads:
            plot_head_scores(analysis["heads"]["echo"], analysis["heads"]["induction"], tmp / "heads.png")
        if layer_similarity:
            plot_layer_similarity(analysis["layer_similarity"], tmp / "layer_similarity.png")
        if "zack_auto" in analysis:
            plot_zack_allocation(analysis["zack_auto"], tmp / "zack_allocation.png")
    click.echo(f"{'layer':>5}  {'κ(W_K)':>9}  {'κ(W_V)':>9}  {'log10 κ̃':>8}  {'K err@50%':>9}  {'V err@50%':>9}")
    for row in analysis["layers"]:
        click.echo(
            f"{row['layer']:>5}  {row['kappa_k']:>9.3g}  {row['kappa_v']:>9.3g}  {row['log10_kappa_cum']:>8.1f}  "
            f"{row['rel_error_k']['0.5']:>9.3f}  {row['rel_error_v']['0.5']:>9.3f}"
        )
    if rotations:
        _print_rotations(analysis["rotations"])
    if layer_similarity:
        from kvconvert.methods.minicache.layer_similarity import similarity_table

        click.echo(similarity_table(analysis["layer_similarity"]))
    if "lorc_auto" in analysis:
        _print_allocation(analysis["lorc_auto"])
    if "lorc_joint" in analysis:
        _print_joint_allocation(analysis["lorc_joint"])
    if "zack_auto" in analysis:
        _print_zack_allocation(analysis["zack_auto"])
    pngs = ["spectra.png", "condition.png", "ranks.png"] + ["heads.png"] * heads
    pngs += ["layer_similarity.png"] * layer_similarity + ["zack_allocation.png"] * ("zack_auto" in analysis)
    click.echo(f"wrote {out}/analysis.json, " + ", ".join(pngs))


def _analysis(source: Any, heads: bool, profile_tokens: int | None, rotations: bool, compare_calib: str | None,
              layer_similarity: bool, calib: str | None, calib_tokens: int, seed: int) -> dict[str, Any]:  # fmt: skip
    """``kvconvert analyze``'s numbers: spectra always, the parts that run the model when asked."""
    from kvconvert.analysis.spectra import analyze_spectra

    if compare_calib is not None and not rotations:
        raise KVConvertError("--compare-calib needs --rotations")
    analysis = analyze_spectra(source)
    if heads:
        from kvconvert.analysis.spectra import analyze_heads

        analysis["heads"] = analyze_heads(source, profile_tokens)
    if rotations:
        from kvconvert.methods.zack.rotations import analyze_rotations

        analysis["rotations"] = analyze_rotations(source, calib, compare_calib, calib_tokens, seed)
    if layer_similarity:
        from kvconvert.methods.minicache.layer_similarity import measure_layer_similarity

        analysis["layer_similarity"] = measure_layer_similarity(source, calib, calib_tokens, seed=seed)
    return analysis


def _budget_list(text: str | None) -> list[float]:
    """``--allocation``'s budgets, each in (0, 1]."""
    if text is None:
        return []
    try:
        budgets = [float(b) for b in text.split(",")]
    except ValueError:
        budgets = []
    if not budgets or any(not 0 < b <= 1 for b in budgets):
        raise KVConvertError(f"--allocation takes comma-separated budgets in (0, 1], got {text!r}")
    return budgets


def _planned(source: Any, budgets: list[float], method_class: Any, config_class: Any, record: Any,
             **options: Any) -> dict[str, Any]:  # fmt: skip
    """``record(plan, layout)`` of ``method_class(config_class(kv_budget=b, schedule="auto", **options))``,
    planned (not converted) at each budget b: what the conversion would write to ``kvconvert.json``."""
    from kvconvert.pipeline import plan_conversion

    result = {}
    for budget in budgets:
        method = method_class(config_class(kv_budget=budget, schedule="auto", **options))
        layout = plan_conversion(source, method).layout
        assert method.plan_ is not None, "plan_conversion runs the plan"
        result[f"{budget:g}"] = record(method.plan_, layout)
    return result


def _auto_allocation(source: Any, budgets: list[float], calib: str | None, calib_tokens: int,
                     seed: int, latent: str = "separate") -> dict[str, Any]:  # fmt: skip
    """``lorc --schedule auto [--latent joint]``'s ranks per layer and side at each budget (joint: the one
    latent's rank twice, and the weights of K's and V's errors in it)."""
    from kvconvert.methods.lorc.method import LorcConfig, LorcMethod

    return _planned(source, budgets, LorcMethod, LorcConfig, lambda plan, layout: {
        "budget": plan.budget, "rank_k": plan.rank_k, "rank_v": plan.rank_v, "probe_rank": plan.probe_rank,
        "probe_kl_k": plan.probe_kl_k, "probe_kl_v": plan.probe_kl_v,
        **({"joint_scales": plan.joint_scales} if plan.joint_scales is not None else {}),
    }, calib=calib, calib_tokens=calib_tokens, seed=seed, latent=latent)  # fmt: skip


def _zack_allocation(source: Any, budgets: list[float], calib: str | None, calib_tokens: int,
                     seed: int) -> dict[str, Any]:  # fmt: skip
    """``zack --schedule auto``'s widths per layer, KV head and side at each budget."""
    from kvconvert.methods.zack.method import ZackConfig, ZackMethod

    return _planned(source, budgets, ZackMethod, ZackConfig, lambda plan, layout: {
        "budget": plan.budget, "rank_k": plan.rank_k, "rank_v": plan.rank_v, "probe_kl": plan.probe_kl,
        "head_dim": layout.head_dim,
    }, calib=calib, calib_tokens=calib_tokens, seed=seed)  # fmt: skip


def _print_zack_allocation(result: dict[str, Any]) -> None:
    click.echo("ZACK --schedule auto (widths by measured loss; per layer, K heads | V heads):")
    for budget, plan in result.items():
        click.echo(f"  budget {budget} (achieved {plan['budget']:.3f}, of {plan['head_dim']} per head):")
        for layer, (k, v) in enumerate(zip(plan["rank_k"], plan["rank_v"], strict=True)):
            click.echo(f"    {layer:>3}  {' '.join(map(str, k))} | {' '.join(map(str, v))}")


def _print_allocation(result: dict[str, Any]) -> None:
    click.echo("LoRC --schedule auto (ranks by measured loss; K/V per layer):")
    for budget, plan in result.items():
        ranks = " ".join(f"{k}/{v}" for k, v in zip(plan["rank_k"], plan["rank_v"], strict=True))
        click.echo(f"  budget {budget} (achieved {plan['budget']:.3f}, probed at rank {plan['probe_rank']}): {ranks}")


def _print_joint_allocation(result: dict[str, Any]) -> None:
    click.echo("LoRC --latent joint (one latent per layer for K and V, its rank by measured loss):")
    for budget, plan in result.items():
        ranks = " ".join("-" if r is None else str(r) for r in plan["rank_k"])
        click.echo(f"  budget {budget} (achieved {plan['budget']:.3f}): {ranks}")


def _print_rotations(result: dict[str, Any]) -> None:
    click.echo(f"ZACK rotations on {result['calib']} ({result['tokens']} tokens): CV of leading singular values "
               f"across heads: QK {result['qk_max_sv_cv']:.1%}, VW {result['vw_max_sv_cv']:.1%}")  # fmt: skip
    for budget, plan in result["plans"].items():
        click.echo(f"  budget {budget}: r = {plan['removal_rate']:.4f} (achieved {plan['kv_budget']:.3f})")
    if "compare" in result:
        cmp = result["compare"]
        for side, title in (("qk", "R_QK"), ("vw", "R_VW")):
            row = cmp[side]
            click.echo(f"  vs {cmp['calib']}: {title} ε̄ = {row['epsilon']:.3e}, δ̄ = {row['delta']:.3e}, "
                       f"δ̄/ε̄ = {row['ratio']:.2%}; energy kept at budget {cmp['at_budget']}: "
                       f"{row['captured_energy_mean']:.2%} (min {row['captured_energy_min']:.2%})")  # fmt: skip
