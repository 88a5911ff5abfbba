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
    from kvconvert.methods.lorc import allocation as lorc_allocation
    from kvconvert.methods.zack import allocation as zack_allocation

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
            analysis["lorc_auto"] = lorc_allocation.auto_allocation(source, budgets, calib, calib_tokens, seed)
        if budgets and "lorc-joint" in allocation_methods:
            analysis["lorc_joint"] = lorc_allocation.auto_allocation(source, budgets, calib, calib_tokens, seed,
                                                                     latent="joint")  # fmt: skip
        if budgets and "zack" in allocation_methods:
            analysis["zack_auto"] = zack_allocation.auto_allocation(source, budgets, calib, calib_tokens, seed)
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
        from kvconvert.methods.zack.rotations import rotations_table

        click.echo(rotations_table(analysis["rotations"]))
    if layer_similarity:
        from kvconvert.methods.minicache.layer_similarity import similarity_table

        click.echo(similarity_table(analysis["layer_similarity"]))
    if "lorc_auto" in analysis:
        click.echo(lorc_allocation.allocation_table(analysis["lorc_auto"]))
    if "lorc_joint" in analysis:
        click.echo(lorc_allocation.joint_allocation_table(analysis["lorc_joint"]))
    if "zack_auto" in analysis:
        click.echo(zack_allocation.allocation_table(analysis["zack_auto"]))
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
