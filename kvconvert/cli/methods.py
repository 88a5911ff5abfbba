"""The conversion commands, one per registered method: parse, build the method, convert, print its table."""

from __future__ import annotations

import click

from kvconvert.cli.common import budget_words, main, run_conversion, user_errors
from kvconvert.cli.options import (
    ConversionOptions,
    calib_source,
    calibration_options,
    conversion_options,
    optional_calibration,
)


@main.command()
@conversion_options
@click.option(
    "--max-v-error",
    type=float,
    default=1e-2,
    show_default=True,
    help="Refuse if V rebuilt from the cached K deviates more than this (relative RMS) in the output dtype.",
)
@click.option("--accept-v-error", is_flag=True, help="Convert even when V's error exceeds --max-v-error.")
@user_errors
def slim(
    options: ConversionOptions,
    max_v_error: float,
    accept_v_error: bool,
) -> None:
    """Slim attention: cache only K, compute V = K·W_KV (exact; MHA models only)."""
    from kvconvert.methods.slim import SlimConfig, SlimMethod

    method = SlimMethod(SlimConfig(max_v_error=max_v_error, accept_v_error=accept_v_error))
    report = run_conversion(method, options)
    click.echo(f"wrote {options.out} (slim, {budget_words(report)})")


@main.command()
@conversion_options
@click.option("--kv-budget", type=float, required=True, help="Cached bytes per token ÷ original, in (0, 1].")
@click.option(
    "--schedule",
    type=click.Choice(["progressive", "uniform", "auto"]),
    default="progressive",
    show_default=True,
    help="Per-layer ranks from cumulative condition numbers (paper eq. 13), one ratio for all layers, or "
    "auto: per layer and side by measured loss on calibration text (extension; implies --calib).",
)
@click.option("--threshold", type=float, default=None, help="Leave layers with log10 κ̃ above this uncompressed.")
@click.option(
    "--compress", type=click.Choice(["kv", "k", "v"]), default="kv", show_default=True, help="Which projections."
)
@click.option(
    "--refine-steps", type=int, default=0, show_default=True,
    help="After the closed-form factorization, this many Adam steps per layer on the error of the attention "
    "output (softmax and W_O included) against the source layer, layer by layer on calibration text "
    "(extension; implies --calib; 0: off).",
)  # fmt: skip
@click.option(
    "--probe-rounds", type=int, default=1, show_default=True,
    help="--schedule auto: rounds of loss probes; each later round re-measures every side at the rank the last "
    "allocation gave it and refits its loss curve through both measurements (extension).",
)  # fmt: skip
@click.option(
    "--latent", type=click.Choice(["separate", "joint"]), default="separate", show_default=True,
    help="One latent per layer for K and one for V (the paper), or joint: one latent both are rebuilt from, "
    "K's and V's errors weighted by their measured loss (extension, MLA-style; needs --schedule auto).",
)  # fmt: skip
@optional_calibration(
    "Factor to minimise the error of the keys and values (through W_O) on this text, not of the weights "
    "(extension; bare --calib: the shipped calib_data/)."
)
@user_errors
def lorc(
    options: ConversionOptions,
    kv_budget: float,
    schedule: str,
    threshold: float | None,
    compress: str,
    refine_steps: int,
    probe_rounds: int,
    latent: str,
    calib: str | None,
    calib_tokens: int,
    seed: int,
) -> None:
    """LoRC: low-rank K/V weights, the cache holds rank-d_c latents (any MHA/GQA model)."""
    from kvconvert.methods.lorc import LorcConfig, LorcMethod

    config = LorcConfig(
        kv_budget=kv_budget, schedule=schedule, threshold=threshold, compress=compress,  # type: ignore[arg-type]
        calibrate=calib is not None, calib=calib_source(calib), calib_tokens=calib_tokens, seed=seed,
        refine_steps=refine_steps, probe_rounds=probe_rounds, latent=latent,  # type: ignore[arg-type]
    )  # fmt: skip
    report = run_conversion(LorcMethod(config, progress=not options.quiet), options)
    kind = f"{schedule}, joint latent" if latent == "joint" else schedule
    click.echo(f"wrote {options.out} (lorc {kind}, {budget_words(report)})")


@main.command()
@conversion_options
@click.option("--induction-frac", type=float, default=0.14, show_default=True, help="Top heads by induction score.")
@click.option("--echo-frac", type=float, default=0.01, show_default=True, help="Top heads by echo score.")
@click.option("--sink", type=int, default=4, show_default=True, help="First tokens every head keeps.")
@click.option("--window", type=int, default=None, help="Recent tokens kept (default min(4000, context/16)).")
@click.option(
    "--window-frac", type=float, default=0.2, show_default=True, help="Recent share kept: L = max(window, N·frac)."
)
@click.option("--kv-budget", type=float, default=None, help="Long-context budget; sets --window-frac.")
@click.option("--profile-tokens", type=int, default=None, help="K random tokens for profiling (repeated 4×).")
@user_errors
def razor(
    options: ConversionOptions,
    induction_frac: float,
    echo_frac: float,
    sink: int,
    window: int | None,
    window_frac: float,
    kv_budget: float | None,
    profile_tokens: int | None,
) -> None:
    """RazorAttention: full cache for retrieval heads, sink + window + compensation token for the rest."""
    from kvconvert.methods.razor import RazorConfig, RazorMethod

    config = RazorConfig(induction_frac=induction_frac, echo_frac=echo_frac, sink=sink, window=window,
                         window_frac=window_frac, kv_budget=kv_budget, profile_tokens=profile_tokens)  # fmt: skip
    method = RazorMethod(config, progress=not options.quiet)
    report = run_conversion(method, options)
    click.echo(f"wrote {options.out} (razor, {budget_words(report)})")


@main.command()
@conversion_options
@click.option("--kv-budget", type=float, default=None, help="Cached bytes per token ÷ original, in (0, 1].")
@click.option("--removal-rate", type=float, default=None, help="Singular-value mass each head drops (eq. 6's r).")
@click.option(
    "--target-agreement", type=float, default=None, help="Smallest cache keeping this top-1 agreement (held-out)."
)
@click.option(
    "--compress", type=click.Choice(["kv", "k", "v"]), default="kv", show_default=True, help="Which sides to truncate."
)
@click.option(
    "--value-basis",
    type=click.Choice(["paper", "output"]),
    default="paper",
    show_default=True,
    help="V basis: the paper's V‖W_O rotation, or output: the one minimising the attention output's error "
    "on calibration text (extension).",
)
@click.option(
    "--schedule",
    type=click.Choice(["rate", "auto"]),
    default="rate",
    show_default=True,
    help="Head widths: rate, the paper's one removal rate for all heads; auto (extension, with --kv-budget), "
    "each head's K and V width by the loss measured per layer and side on calibration text.",
)
@calibration_options
@user_errors
def zack(
    options: ConversionOptions,
    kv_budget: float | None,
    removal_rate: float | None,
    target_agreement: float | None,
    compress: str,
    value_basis: str,
    schedule: str,
    calib: str | None,
    calib_tokens: int,
    seed: int,
) -> None:
    """ZACK: calibrated per-head rotations, adaptive widths; attention runs in the compressed space."""
    from kvconvert.methods.zack import ZackConfig, ZackMethod

    config = ZackConfig(
        kv_budget=kv_budget,
        removal_rate=removal_rate,
        target_agreement=target_agreement,
        compress=compress,  # type: ignore[arg-type]
        value_basis=value_basis,  # type: ignore[arg-type]
        schedule=schedule,  # type: ignore[arg-type]
        calib=calib,
        calib_tokens=calib_tokens,
        seed=seed,
    )
    report = run_conversion(ZackMethod(config, progress=not options.quiet), options)
    rate = report["plan"]["removal_rate"]
    how = "widths by measured loss" if rate is None else f"r={rate:.4f}"
    click.echo(f"wrote {options.out} (zack {how}, {budget_words(report)})")


@main.command()
@conversion_options
@click.option("--start-layer", type=int, default=None, help="First merged layer S (default L/2; L merges nothing).")
@click.option("--kv-budget", type=float, default=None, help="Merge the fewest deepest pairs meeting this budget.")
@click.option(
    "--min-similarity", type=float, default=None, help="Calibrate; S = shallowest layer whose pairs keep this cosine."
)
@click.option("--t", "t", type=float, default=0.6, show_default=True, help="SLERP parameter (1 leans to layer l).")
@click.option("--gamma", type=float, default=0.05, show_default=True, help="Retention threshold (0: none, 1: all).")
@click.option(
    "--merge",
    type=click.Choice(["slerp", "average", "subspace"]),
    default="slerp",
    show_default=True,
    help="Merge function; subspace (extension, xKV): a pair shares one calibrated latent per token, widths by loss.",
)
@click.option(
    "--sink",
    type=int,
    default=4,
    show_default=True,
    help="--merge subspace: first tokens of a sequence kept exact (attention sinks).",
)
@optional_calibration(
    "Measure adjacent-layer similarity on this text (bare --calib: the shipped calib_data/); "
    "--merge subspace fits its latents on it."
)
@user_errors
def minicache(
    options: ConversionOptions,
    start_layer: int | None,
    kv_budget: float | None,
    min_similarity: float | None,
    t: float,
    gamma: float,
    merge: str,
    sink: int,
    calib: str | None,
    calib_tokens: int,
    seed: int,
) -> None:
    """MiniCache: layer pairs from mid-depth share one KV direction tensor + per-layer norms + retained tokens."""
    from kvconvert.methods.minicache import MiniCacheConfig, MiniCacheMethod

    config = MiniCacheConfig(
        start_layer=start_layer, kv_budget=kv_budget, min_similarity=min_similarity, t=t, gamma=gamma,
        merge=merge, sink=sink,  # type: ignore[arg-type]
        calibrate=calib is not None, calib=calib_source(calib),
        calib_tokens=calib_tokens, seed=seed,
    )  # fmt: skip
    report = run_conversion(MiniCacheMethod(config, progress=not options.quiet), options)
    plan = report["plan"]
    pairs = ", ".join(f"{a}-{b}" for a, b in plan["pairs"]) or "none"
    click.echo(f"wrote {options.out} (minicache from layer {plan['start_layer']}, pairs {pairs}; "
               f"{budget_words(report)})")  # fmt: skip


@main.command()
@conversion_options
@click.option(
    "--kv-budget", type=float, default=None, help="Bytes ÷ a 16-bit cache; widths per layer chosen by measured loss."
)
@click.option(
    "--min-bits", type=click.Choice(["2", "3", "4", "8"]), default="2", show_default=True, help="With --kv-budget."
)
@click.option(
    "--max-bits", type=click.Choice(["2", "3", "4", "8"]), default="4", show_default=True, help="With --kv-budget."
)
@click.option("--calib", default=None, help="With --kv-budget: calibration text (default: the shipped calib_data/).")
@click.option(
    "--calib-tokens", type=int, default=2048, show_default=True, help="Calibration tokens (512-token chunks)."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the chunk shuffle.")
@user_errors
def quant(
    options: ConversionOptions,
    kv_budget: float | None,
    min_bits: str,
    max_bits: str,
    calib: str | None,
    calib_tokens: int,
    seed: int,
) -> None:
    """Quantized KV cache alone (KIVI layout: keys per channel, values per token): the baseline to beat."""
    from kvconvert.methods.quant import QuantConfig, QuantMethod

    config = QuantConfig(kv_budget=kv_budget, min_bits=int(min_bits), max_bits=int(max_bits), calib=calib,
                         calib_tokens=calib_tokens, seed=seed)  # fmt: skip
    report = run_conversion(QuantMethod(config, progress=not options.quiet), options)
    storage = report["kv_storage"]
    widths = (
        f"{storage['bits']}-bit"
        if "layers" not in storage
        else f"mixed widths ({report['plan']['kv_budget']:.3f} of 16-bit)"
    )
    layout = ", token layout" if storage.get("layout") == "token" else ""
    click.echo(f"wrote {options.out} (quant {widths}{layout}, groups of {storage['group']}, "
               f"{storage['residual']} recent tokens unquantized)")  # fmt: skip
