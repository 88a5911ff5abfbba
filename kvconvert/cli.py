"""``kvconvert`` command line: each command parses its options, then calls the library."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from kvconvert import __version__
from kvconvert.errors import KVConvertError
from kvconvert.io.outdir import parse_size, refuse_existing, refuse_overlap
from kvconvert.plan import CANDIDATES as PLAN_CANDIDATES

if TYPE_CHECKING:  # torch and transformers load with the command that needs them, not for --help
    from kvconvert.runtime.kvconvert_codec import QuantSpec


def _source_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Options shared by every command that reads a source model."""
    fn = click.option(
        "--device", default="auto", show_default=True,
        help="Where calibration and profiling run the model (one layer at a time): cpu, cuda, cuda:N, or auto "
             "(the first GPU if there is one). Weight rewrites stay on the CPU.",
    )(fn)  # fmt: skip
    fn = click.option("--allow-pickle", is_flag=True, help="Read pickled .bin weights (weights_only=True).")(fn)
    fn = click.option("--revision", default=None, help="Hub branch, tag or commit of --model.")(fn)
    fn = click.option("--model", "model", required=True, help="Hub id or local directory of the source model.")(fn)
    return fn


def _output_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Options shared by every conversion command."""
    fn = click.option("--quiet", is_flag=True, help="No progress bar or summary table.")(fn)
    fn = click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output shard.")(fn)
    fn = click.option(
        "--dtype",
        type=click.Choice(["auto", "float32", "float16", "bfloat16"]),
        default="auto",
        show_default=True,
        help="Output dtype; auto keeps the source's.",
    )(fn)
    fn = click.option(
        "--kv-include-local/--no-kv-include-local", default=None,
        help="Also quantize sliding-window layers' caches (Gemma 2/3); by default they stay stock, bounded by "
             "the window.",
    )(fn)  # fmt: skip
    fn = click.option(
        "--kv-layout", type=click.Choice(["kivi", "token"]), default=None,
        help="kivi (default): keys per channel, values per token. token (kvconvert extension, quant and razor, "
             "4-bit): both per token after a Hadamard rotation, in the layout torch's int4 kernel reads, so CPU "
             "decoding reads the codes without dequantizing the cache (razor: its retrieval heads).",
    )(fn)  # fmt: skip
    fn = click.option(
        "--kv-rotate/--no-kv-rotate", default=None,
        help="Rotate values (randomized Hadamard per group) before quantizing them (kvconvert extension; default off).",
    )(fn)  # fmt: skip
    fn = click.option(
        "--kv-sink", type=int, default=None,
        help="First tokens of every sequence kept unquantized: attention sinks (kvconvert extension; default 0).",
    )(fn)  # fmt: skip
    fn = click.option("--kv-residual", type=int, default=None, help="Newest tokens kept unquantized (default 128).")(fn)
    fn = click.option(
        "--kv-group", type=int, default=None, help="Values per quantization group / tokens per key block (default 64)."
    )(fn)
    fn = click.option(
        "--kv-bits",
        type=click.Choice(["16", "8", "4", "3", "2"]),
        default=None,
        help="Storage of what the cache holds: 16 = the model's dtype (default), 8/4/3/2-bit integers.",
    )(fn)
    fn = click.option("--force", is_flag=True, help="Replace an existing --out.")(fn)
    fn = click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Output directory.")(fn)
    return fn


@dataclass(frozen=True)
class ConversionOptions:
    """The options every conversion command shares (source and output)."""

    model: str
    revision: str | None
    allow_pickle: bool
    device: str
    out: Path
    force: bool
    dtype: str
    max_shard_size: str
    quiet: bool
    kv_bits: str | None
    kv_group: int | None
    kv_residual: int | None
    kv_sink: int | None
    kv_rotate: bool | None
    kv_include_local: bool | None
    kv_layout: str | None

    def storage(self, base: QuantSpec | None = None) -> QuantSpec:
        """The cache storage these options ask for; options not given keep ``base``'s (a recipe's)."""
        from kvconvert.recipe import storage_spec

        given = {"kv_bits": None if self.kv_bits is None else int(self.kv_bits), "kv_group": self.kv_group,
                 "kv_residual": self.kv_residual, "kv_sink": self.kv_sink, "kv_rotate": self.kv_rotate,
                 "kv_include_local": self.kv_include_local, "kv_layout": self.kv_layout}  # fmt: skip
        return storage_spec(given, "options", base)


def check_options(options: ConversionOptions) -> None:
    """What can be checked of the shared options without loading anything."""
    parse_size(options.max_shard_size)
    if Path(options.model).expanduser().is_dir():  # a Hub id's snapshot cannot overlap a user's --out
        refuse_overlap(options.out.resolve(), [Path(options.model).expanduser()])
    refuse_existing(options.out, options.force)


def _conversion_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add the shared source/output options and hand them to ``fn`` as one ``options`` argument."""
    names = [f.name for f in dataclasses.fields(ConversionOptions)]

    @functools.wraps(fn)
    def wrapper(**kwargs: Any) -> Any:
        options = ConversionOptions(**{name: kwargs.pop(name) for name in names})
        _user_errors(check_options)(options)  # at once: before torch and the source load
        return fn(options=options, **kwargs)

    return _source_options(_output_options(wrapper))


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn KVConvertError into one line on stderr and exit status 2, without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KVConvertError as exc:
            _fail(str(exc))
        except Terminated:  # SIGTERM (see ``main``): outputs were already cleaned up
            click.echo("kvconvert: error: terminated; no output was written", err=True)
            sys.exit(143)  # 128 + SIGTERM, what shells and CI runners expect
        except KeyboardInterrupt:  # Ctrl-C: outputs were already cleaned up
            click.echo("kvconvert: error: interrupted; no output was written", err=True)
            sys.exit(130)
        except OSError as exc:  # a full disk, a permission, a vanished file: the OS's words, one line
            where = f" ({exc.filename})" if exc.filename else ""
            _fail(f"{exc.strerror or exc}{where}")

    return wrapper


MAX_ERROR_CHARS = 600  # an error quotes user input (a recipe value, a path): never let it flood the terminal


def _fail(message: str) -> NoReturn:
    """Print ``message`` as the one error line (newlines folded, length capped) and exit 2."""
    line = " ".join(message.split())
    if len(line) > MAX_ERROR_CHARS:
        line = line[: MAX_ERROR_CHARS - 1] + "…"
    click.echo(f"kvconvert: error: {line}", err=True)
    sys.exit(2)


class Terminated(KeyboardInterrupt):
    """SIGTERM, unwound like Ctrl-C (``finally`` blocks remove partial outputs) but reported as 143."""


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM (what CI runners send on cancel) unwinds like Ctrl-C, so partial outputs are removed."""
    raise Terminated


class _Commands(click.Group):
    """Click, with its usage errors (a missing option, a bad choice, a typo) as kvconvert's one line on
    stderr and exit status 2, like every other user error, instead of a usage block."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        run = super().main
        if not standalone_mode:
            return run(*args, standalone_mode=False, **kwargs)  # type: ignore[call-overload]
        try:
            status = run(*args, standalone_mode=False, **kwargs)  # type: ignore[call-overload]  # int: --help/exit
        except click.exceptions.NoArgsIsHelpError as exc:  # bare `kvconvert`: the help, as click prints it
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            command = exc.ctx.command_path if exc.ctx is not None else "kvconvert"
            _fail(f"{exc.format_message()} (see {command} --help)")
        except click.ClickException as exc:
            _fail(exc.format_message())
        except click.Abort:  # Ctrl-C while click itself was reading
            click.echo("kvconvert: error: interrupted", err=True)
            sys.exit(130)
        sys.exit(status if isinstance(status, int) else 0)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvconvert")
def main() -> None:
    """Convert Hugging Face causal LMs into checkpoints with a smaller KV cache."""
    import signal

    signal.signal(signal.SIGTERM, _terminate)


@main.command()
@_conversion_options
@click.option(
    "--max-v-error",
    type=float,
    default=1e-2,
    show_default=True,
    help="Refuse if V rebuilt from the cached K deviates more than this (relative RMS) in the output dtype.",
)
@click.option("--accept-v-error", is_flag=True, help="Convert even when V's error exceeds --max-v-error.")
@_user_errors
def slim(
    options: ConversionOptions,
    max_v_error: float,
    accept_v_error: bool,
) -> None:
    """Slim attention: cache only K, compute V = K·W_KV (exact; MHA models only)."""
    from kvconvert.methods.slim import SlimConfig, SlimMethod

    method = SlimMethod(SlimConfig(max_v_error=max_v_error, accept_v_error=accept_v_error))
    report = _convert(method, options)
    if not options.quiet:
        _print_layers(report, [("κ(W_K)", "kappa_k", ".3g"), ("V rel. error", "v_rel_error", ".2e"),
                               ("dtype rounding", "dtype_rel_error", ".2e")])  # fmt: skip
    click.echo(f"wrote {options.out} (slim, {_budget_words(report)})")


CALIB_DEFAULT = "<calib_data>"  # what a bare --calib stands for


def _optional_calibration(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--calib [SOURCE]`` (bare: the shipped calib_data/), ``--calib-tokens``, ``--seed``: for
    commands whose calibration is an option rather than the method itself."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn = click.option("--seed", type=int, default=0, show_default=True, help="Seed of the chunk shuffle.")(fn)
        fn = click.option("--calib-tokens", type=int, default=16384, show_default=True, help="Calibration tokens.")(fn)
        return click.option("--calib", is_flag=False, flag_value=CALIB_DEFAULT, default=None, help=help_text)(fn)

    return decorate


def _calib_source(calib: str | None) -> str | None:
    """The calibration source a method config takes: None stands for the shipped calib_data/."""
    return None if calib in (None, CALIB_DEFAULT) else calib


@main.command()
@_conversion_options
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
@_optional_calibration(
    "Factor to minimise the error of the keys and values (through W_O) on this text, not of the weights "
    "(extension; bare --calib: the shipped calib_data/)."
)
@_user_errors
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
        calibrate=calib is not None, calib=_calib_source(calib), calib_tokens=calib_tokens, seed=seed,
        refine_steps=refine_steps, probe_rounds=probe_rounds, latent=latent,  # type: ignore[arg-type]
    )  # fmt: skip
    report = _convert(LorcMethod(config, progress=not options.quiet), options)
    if not options.quiet:
        error = "rel_output_error" if config.calibrate else "rel_frobenius_error"
        _print_layers(report, [("κ(W_K)", "kappa_k", ".3g"), ("κ(W_V)", "kappa_v", ".3g"),
                               ("log10 κ̃", "log10_kappa_cum", ".1f"), ("rank K", "rank_k", ""),
                               ("rank V", "rank_v", ""), ("K error", f"k_{error}", ".3f"),
                               ("V error", f"v_{error}", ".3f"),
                               *([("K+V error", "kv_rel_output_error", ".3f")] if latent == "joint" else []),
                               *([("refine loss", "refine_loss_before", ".4f"),
                                  ("→ refined", "refine_loss_after", ".4f")] if refine_steps else [])])  # fmt: skip
    kind = f"{schedule}, joint latent" if latent == "joint" else schedule
    click.echo(f"wrote {options.out} (lorc {kind}, {_budget_words(report)})")


@main.command()
@_conversion_options
@click.option("--induction-frac", type=float, default=0.14, show_default=True, help="Top heads by induction score.")
@click.option("--echo-frac", type=float, default=0.01, show_default=True, help="Top heads by echo score.")
@click.option("--sink", type=int, default=4, show_default=True, help="First tokens every head keeps.")
@click.option("--window", type=int, default=None, help="Recent tokens kept (default min(4000, context/16)).")
@click.option(
    "--window-frac", type=float, default=0.2, show_default=True, help="Recent share kept: L = max(window, N·frac)."
)
@click.option("--kv-budget", type=float, default=None, help="Long-context budget; sets --window-frac.")
@click.option("--profile-tokens", type=int, default=None, help="K random tokens for profiling (repeated 4×).")
@_user_errors
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
    report = _convert(method, options)
    if not options.quiet:
        click.echo(f"{'layer':>5}  {'retrieval KV heads':<24}  {'max induction':>13}  {'max echo':>9}")
        for row in report["layers"]:
            heads = ",".join(map(str, row["retrieval_kv_heads"])) or "-"
            click.echo(f"{row['layer']:>5}  {heads:<24}  {max(row['induction_scores']):>13.3f}  "
                       f"{max(row['echo_scores']):>9.3f}")  # fmt: skip
    click.echo(f"wrote {options.out} (razor, {_budget_words(report)})")


def _calibration_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Options of every command that runs the model on calibration text."""
    fn = click.option("--seed", type=int, default=0, show_default=True, help="Seed of the chunk shuffle.")(fn)
    fn = click.option(
        "--calib-tokens", type=int, default=16384, show_default=True, help="Calibration tokens (512-token chunks)."
    )(fn)
    fn = click.option(
        "--calib",
        default=None,
        help="Calibration text: file, directory of *.txt, or dataset name[:config]:split:column (default calib_data/).",
    )(fn)
    return fn


@main.command()
@_conversion_options
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
@_calibration_options
@_user_errors
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
    report = _convert(ZackMethod(config, progress=not options.quiet), options)
    if not options.quiet:
        probed = [side for side in "kv" if f"{side}_probe_kl" in report["layers"][0]]
        probe_heads = "".join(f"  {side.upper()} probe KL" for side in probed)
        click.echo(f"{'layer':>5}  {'K widths':<24}  {'V widths':<24}{probe_heads}")
        for row in report["layers"]:
            click.echo(
                f"{row['layer']:>5}  {','.join(map(str, row['rank_k'])):<24}  {','.join(map(str, row['rank_v'])):<24}"
                + "".join(f"  {row[f'{side}_probe_kl']:>10.4f}" for side in probed)
            )
    rate = report["plan"]["removal_rate"]
    how = "widths by measured loss" if rate is None else f"r={rate:.4f}"
    click.echo(f"wrote {options.out} (zack {how}, {_budget_words(report)})")


@main.command()
@_conversion_options
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
@_optional_calibration(
    "Measure adjacent-layer similarity on this text (bare --calib: the shipped calib_data/); "
    "--merge subspace fits its latents on it."
)
@_user_errors
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
        calibrate=calib is not None, calib=_calib_source(calib),
        calib_tokens=calib_tokens, seed=seed,
    )  # fmt: skip
    report = _convert(MiniCacheMethod(config, progress=not options.quiet), options)
    plan = report["plan"]
    if not options.quiet and "layer_similarity" in plan:
        _print_layer_similarity(plan["layer_similarity"], merged={tuple(p) for p in plan["pairs"]})
    if not options.quiet and "ranks" in plan:
        click.echo(f"{'pair':>7}  {'K width':>7}  {'K loss':>8}  {'V width':>7}  {'V loss':>8}")
        for (a, b), (r_k, r_v) in zip(plan["pairs"], plan["ranks"], strict=True):
            row = report["layers"][a]
            click.echo(f"{a:>3}-{b:<3}  {r_k:>7}  {row['loss_k']:>8.4f}  {r_v:>7}  {row['loss_v']:>8.4f}")
    pairs = ", ".join(f"{a}-{b}" for a, b in plan["pairs"]) or "none"
    click.echo(f"wrote {options.out} (minicache from layer {plan['start_layer']}, pairs {pairs}; "
               f"{_budget_words(report)})")  # fmt: skip


@main.command()
@_conversion_options
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
@_user_errors
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
    report = _convert(QuantMethod(config, progress=not options.quiet), options)
    storage = report["kv_storage"]
    widths = (
        f"{storage['bits']}-bit"
        if "layers" not in storage
        else f"mixed widths ({report['plan']['kv_budget']:.3f} of 16-bit)"
    )
    layout = ", token layout" if storage.get("layout") == "token" else ""
    click.echo(f"wrote {options.out} (quant {widths}{layout}, groups of {storage['group']}, "
               f"{storage['residual']} recent tokens unquantized)")  # fmt: skip


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@_conversion_options
@_user_errors
def run(
    recipe: Path,
    options: ConversionOptions,
) -> None:
    """Convert with a recipe (YAML: method + options); the recipe is saved as DST/recipe.yaml."""
    from kvconvert.methods import build_method
    from kvconvert.recipe import load_recipe

    name, config, storage = load_recipe(recipe)
    report = _convert(build_method(name, config, storage), options)
    click.echo(f"wrote {options.out} ({name}, {_budget_words(report)})")


@main.command()
@click.argument("jobs_file", type=click.Path(path_type=Path))
@click.argument("summaries", nargs=-1, type=click.Path(path_type=Path))
@click.option("--summary", type=click.Path(path_type=Path), default=None, help="JSON summary (default: next to JOBS).")
@click.option("--no-measure", is_flag=True, help="Skip measuring each output's KV budget from its cache.")
@click.option(
    "--shard", default=None,
    help="I/N: run only the I-th of N slices of the jobs (sorted by name, dealt round-robin), for a CI matrix of N "
         "machines; each writes its own summary.",
)  # fmt: skip
@click.option(
    "--merge-summaries", is_flag=True,
    help="Run nothing: join the SUMMARIES of a sharded run into --summary, checking every job of JOBS appears once.",
)  # fmt: skip
@_user_errors
def batch(
    jobs_file: Path, summaries: tuple[Path, ...], summary: Path | None, no_measure: bool, shard: str | None,
    merge_summaries: bool,
) -> None:  # fmt: skip
    """Run every job of JOBS.yaml in order; skip up-to-date outputs; exit 1 if any job failed."""
    from kvconvert.batch import merge_summaries as merge
    from kvconvert.batch import parse_shard, run_batch

    if summaries and not merge_summaries:
        raise KVConvertError("summary files are arguments of --merge-summaries only")
    if merge_summaries:
        if shard is not None or not summaries:
            raise KVConvertError("--merge-summaries takes the shards' summary files (and no --shard)")
        summary = summary or jobs_file.with_suffix(".summary.json")
        result = merge(jobs_file, list(summaries), summary)
    else:
        parsed = None if shard is None else parse_shard(shard)
        default = ".summary.json" if parsed is None else f".shard-{parsed[0]}-of-{parsed[1]}.summary.json"
        summary = summary or jobs_file.with_suffix(default)
        _silence_libraries()  # a CI log: one line per job
        result = run_batch(jobs_file, summary, measure=not no_measure, echo=click.echo, shard=parsed)
    click.echo(f"{len(result.jobs) - result.failed} of {len(result.jobs)} jobs succeeded; summary: {summary}")
    if result.failed:
        sys.exit(1)


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--repo-id", required=True, help="ORG/NAME on the Hub.")
@click.option("--private", is_flag=True, help="Create the repository as private.")
@click.option("--revision", default=None, help="Branch to push to (created if missing).")
@click.option("--dry-run", is_flag=True, help="List what would be uploaded; contact nobody.")
@_user_errors
def push(directory: Path, repo_id: str, private: bool, revision: str | None, dry_run: bool) -> None:
    """Upload a converted directory to the Hub: the files kvconvert wrote there, with the model card
    refreshed from kvconvert.json / eval.json (written locally too once the upload succeeded)."""
    from kvconvert.io.hub import publish

    url, files, skipped = publish(directory, repo_id, private=private, revision=revision, dry_run=dry_run)
    if skipped:
        shown = ", ".join(skipped[:8]) + (f" and {len(skipped) - 8} more" if len(skipped) > 8 else "")
        click.echo(f"not uploading {len(skipped)} file(s) kvconvert did not write: {shown}", err=True)
    if url is None:
        for name, size in files:
            click.echo(f"{size:>14,}  {name}")
        target = f"{repo_id}{'@' + revision if revision else ''}{' (private)' if private else ''}"
        click.echo(f"dry run: {len(files)} files, {sum(size for _, size in files):,} bytes would go to {target}")
        return
    click.echo(f"pushed {len(files)} files: {url}")


def _silence_libraries() -> None:
    """--quiet (and batch): transformers' "Loading weights" and the Hub's download bars off too."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    disable_progress_bars()


def _convert(method: Any, options: ConversionOptions) -> dict[str, Any]:
    if options.quiet:
        _silence_libraries()
        method.progress = False  # `run --quiet` too: its method was built from a recipe
    from kvconvert.devices import computing_on, resolve_device
    from kvconvert.io.source import open_source
    from kvconvert.pipeline import convert

    method.storage = options.storage(method.storage)  # options given on the command line win over a recipe's
    device = resolve_device(options.device)
    source = open_source(options.model, revision=options.revision, allow_pickle=options.allow_pickle)
    with computing_on(device):
        result = convert(
            source,
            method,
            options.out,
            dtype=options.dtype,
            replace=options.force,
            max_shard_bytes=parse_size(options.max_shard_size),
            progress=not options.quiet,
        )
    return result.report


def _budget_words(report: dict[str, Any]) -> str:
    """The expected KV budget of a conversion, quantized storage included (then against a 16-bit cache)."""
    if "kv_budget_expected_vs_16bit" in report:
        return f"KV budget {report['kv_budget_expected_vs_16bit']:.3f} of a 16-bit cache at long context"
    long = " at long context" if report["method"] == "razor" else ""  # a window: reached at long context
    return f"KV budget {report['kv_budget_expected']:.3f}{long}"


def _print_layers(report: dict[str, Any], columns: list[tuple[str, str, str]]) -> None:
    """Per-layer table of the conversion report; missing values print as '-'."""
    click.echo(f"{'layer':>5}  " + "  ".join(f"{title:>14}" for title, _, _ in columns))
    for row in report["layers"]:
        cells = ["-" if row.get(key) is None else format(row[key], fmt) for _, key, fmt in columns]
        click.echo(f"{row['layer']:>5}  " + "  ".join(f"{c:>14}" for c in cells))


@main.command()
@_source_options
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
@_calibration_options
@_user_errors
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
        _print_layer_similarity(analysis["layer_similarity"])
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
    from kvconvert.methods.lorc import LorcConfig, LorcMethod

    return _planned(source, budgets, LorcMethod, LorcConfig, lambda plan, layout: {
        "budget": plan.budget, "rank_k": plan.rank_k, "rank_v": plan.rank_v, "probe_rank": plan.probe_rank,
        "probe_kl_k": plan.probe_kl_k, "probe_kl_v": plan.probe_kl_v,
        **({"joint_scales": plan.joint_scales} if plan.joint_scales is not None else {}),
    }, calib=calib, calib_tokens=calib_tokens, seed=seed, latent=latent)  # fmt: skip


def _zack_allocation(source: Any, budgets: list[float], calib: str | None, calib_tokens: int,
                     seed: int) -> dict[str, Any]:  # fmt: skip
    """``zack --schedule auto``'s widths per layer, KV head and side at each budget."""
    from kvconvert.methods.zack import ZackConfig, ZackMethod

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


def _print_layer_similarity(result: dict[str, Any], merged: set[tuple[int, ...]] | None = None) -> None:
    click.echo(f"adjacent-layer similarity on {result['calib']} ({result['tokens']} tokens; kept = unmerged at "
               f"γ = {result['gamma']}):")  # fmt: skip
    header = f"{'pair':>7}  {'cos K':>7}  {'cos V':>7}  {'kept K':>7}  {'kept V':>7}"
    click.echo(header + ("  merged" if merged else ""))
    for row in result["pairs"]:
        a, b = row["layers"]
        mark = ("  yes" if (a, b) in merged else "") if merged else ""
        click.echo(f"{a:>3}-{b:<3}  {row['cos_k']:>7.3f}  {row['cos_v']:>7.3f}  {row['retained_k']:>7.1%}  "
                   f"{row['retained_v']:>7.1%}{mark}")  # fmt: skip


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


@main.command("eval")
@click.option("--model", "model", required=True, help="Local model directory (converted or not).")
@click.option("--reference", default=None, help="Source model directory to compare against.")
@click.option("--data", required=True, help="Text file, or dataset spec name[:config]:split:column.")
@click.option("--ctx", type=int, default=1024, show_default=True, help="Window length (capped at the model's).")
@click.option("--max-tokens", type=int, default=None, help="Score only the first N tokens of --data.")
@click.option("--chunk", type=int, default=None, help="Feed each window through the cache N tokens at a time.")
@click.option("--context", type=int, default=None, help="Context protocol: N tokens into the cache in one forward…")
@click.option("--continuation", type=int, default=None, help="…then the next M scored in one forward through it.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="Also write results here.")
@click.option("--retrieval-lengths", default=None, help="Comma-separated prompt lengths for passkey/copy.")
@click.option("--no-retrieval", is_flag=True, help="Skip passkey and copy tests.")
@click.option("--no-speed", is_flag=True, help="Skip throughput measurement.")
@click.option(
    "--speed-contexts", default=None,
    help="Comma-separated context lengths (e.g. 1024,4096,16384): decode speed side by side with --reference "
         "after each, interleaved, best of 2.",
)  # fmt: skip
@click.option(
    "--device", default="auto", show_default=True,
    help="Where both models run: cpu, cuda, cuda:N, or auto (the first GPU if there is one).",
)  # fmt: skip
@click.option("--quiet", is_flag=True, help="No progress bar.")
@_user_errors
def eval_command(
    model: str,
    reference: str | None,
    data: str,
    ctx: int,
    max_tokens: int | None,
    chunk: int | None,
    context: int | None,
    continuation: int | None,
    json_out: Path | None,
    retrieval_lengths: str | None,
    no_retrieval: bool,
    no_speed: bool,
    speed_contexts: str | None,
    device: str,
    quiet: bool,
) -> None:
    """Perplexity, KL/top-1 vs --reference, measured KV bytes/token, speed, passkey and copy tests."""
    import json

    from kvconvert.eval.runner import EvalConfig, format_table, run_eval
    from kvconvert.io.model_card import is_eval_result
    from kvconvert.io.outdir import refuse_foreign_file, write_text_atomic

    try:
        lengths = tuple(int(n) for n in retrieval_lengths.split(",")) if retrieval_lengths else None
    except ValueError:
        raise KVConvertError(
            f"--retrieval-lengths must be comma-separated integers, got {retrieval_lengths!r}"
        ) from None
    try:
        contexts = tuple(int(n) for n in speed_contexts.split(",")) if speed_contexts else None
    except ValueError:
        raise KVConvertError(f"--speed-contexts must be comma-separated integers, got {speed_contexts!r}") from None
    if contexts is not None and (min(contexts) < 1 or no_speed):
        raise KVConvertError("--speed-contexts takes positive lengths and measures speed: not with --no-speed")
    if ctx < 2:
        raise KVConvertError(f"--ctx must be at least 2, got {ctx}")
    if chunk is not None and chunk < 1:
        raise KVConvertError(f"--chunk must be at least 1, got {chunk}")
    if (context is not None and context < 1) or (continuation is not None and continuation < 2):
        raise KVConvertError("--context must be at least 1 and --continuation at least 2")
    if context is not None and chunk is not None:
        raise KVConvertError("--chunk and --context are two protocols; give one")
    if lengths is not None and min(lengths) < 2:
        raise KVConvertError(f"--retrieval-lengths takes lengths of at least 2 tokens, got {retrieval_lengths!r}")
    if json_out is not None:  # before minutes of evaluation, not after
        refuse_foreign_file(json_out, "--json", is_eval_result, "a kvconvert eval result")
    if quiet:
        _silence_libraries()
    config = EvalConfig(
        data=data, ctx=ctx, max_tokens=max_tokens, chunk=chunk, context=context, continuation=continuation,
        retrieval_lengths=lengths, retrieval=not no_retrieval,
        speed=not no_speed, speed_contexts=contexts, progress=not quiet, device=device,
    )  # fmt: skip
    result = run_eval(model, reference, config)
    click.echo(format_table(result))
    if json_out is not None:
        write_text_atomic(json_out, json.dumps(result, indent=2) + "\n")


@main.command()
@click.option("--model", "model", required=True, help="Source model: Hub id or local directory.")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Plan directory to write.")
@click.option("--budgets", default="0.5,0.35,0.25,0.15", show_default=True,
              help="KV budgets (bytes ÷ a 16-bit cache's) to pick a recipe for.")  # fmt: skip
@click.option("--max-dppl", type=float, default=None, help="Also: the smallest budget within this Δppl (%).")
@click.option("--methods", default=",".join(PLAN_CANDIDATES), show_default=True, help="Methods to try.")
@click.option("--calib", default=None, help="Calibration text (file or directory); default: the shipped calib_data/.")
@click.option("--data", default=None, help="Score on this text instead of the end of the calibration text.")
@click.option("--context", type=int, default=512, show_default=True, help="Tokens into the cache per window.")
@click.option("--continuation", type=int, default=128, show_default=True, help="Tokens scored through it.")
@click.option("--windows", type=int, default=2, show_default=True, help="Windows scored per candidate.")
@click.option("--device", default="auto", show_default=True, help="Where scoring runs: cpu, cuda, cuda:N, auto.")
@click.option("--build", type=click.Path(path_type=Path), default=None,
              help="Also build the winner at --kv-budget into this directory.")  # fmt: skip
@click.option("--kv-budget", "build_budget", type=float, default=None, help="The budget --build builds for.")
@click.option("--force", is_flag=True, help="Replace an existing --out (and --build).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@_user_errors
def plan(model: str, out: Path, budgets: str, max_dppl: float | None, methods: str, calib: str | None,
         data: str | None, context: int, continuation: int, windows: int, device: str, build: Path | None,
         build_budget: float | None, force: bool, quiet: bool) -> None:  # fmt: skip
    """Convert and score every method's candidates on this model; write the frontier and the recipe
    that wins at each budget (build it with `kvconvert run PLAN/recipes/budget-B.yaml`)."""
    from kvconvert.plan import PlanConfig, format_report, run_plan

    if quiet:
        _silence_libraries()
    refuse_existing(out, force)  # before the source and the reference model load
    try:
        budget_values = tuple(float(b) for b in budgets.split(","))
    except ValueError:
        raise KVConvertError(f"--budgets must be comma-separated numbers, got {budgets!r}") from None
    if (build is None) != (build_budget is None):
        raise KVConvertError("--build and --kv-budget go together")
    if build is not None:
        refuse_existing(build, force, "--build")
    config = PlanConfig(
        budgets=budget_values if build_budget is None else tuple(sorted({*budget_values, build_budget})),
        max_dppl=max_dppl, methods=tuple(m.strip() for m in methods.split(",") if m.strip()), calib=calib,
        data=data, context=context, continuation=continuation, windows=windows, device=device, progress=not quiet,
    )  # fmt: skip
    result = run_plan(model, out, config, replace=force)
    click.echo(format_report(result))
    click.echo(f"wrote {out}/frontier.json, frontier.png and recipes/")
    if build is not None:
        from kvconvert.io.source import open_source
        from kvconvert.methods import build_method
        from kvconvert.pipeline import convert
        from kvconvert.recipe import load_recipe

        recipe = out / "recipes" / f"budget-{build_budget:g}.yaml"
        if not recipe.exists():
            raise KVConvertError(f"no candidate fits --kv-budget {build_budget:g}; the plan is in {out}")
        name, method_config, storage = load_recipe(recipe)
        built = convert(open_source(model), build_method(name, method_config, storage), build, replace=force,
                        progress=not quiet)  # fmt: skip
        click.echo(f"built {recipe.name} into {built.out}")


@main.command("import-llama2c")
@click.argument("checkpoint", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option("--out", "out", required=True, type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Replace an existing --out.")
@_user_errors
def import_llama2c(checkpoint: Path, tokenizer: Path | None, out: Path, force: bool) -> None:
    """Import a llama2.c (v0 .bin) model, and optionally its tok*.bin vocab, as an HF Llama directory."""
    from kvconvert.io.llama2c import import_llama2c as run_import

    run_import(checkpoint, out, tokenizer=tokenizer, replace=force)
    click.echo(f"wrote {out}")


@main.command("import-gguf")
@click.argument("gguf_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", "out", required=True, type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Replace an existing --out.")
@_user_errors
def import_gguf(gguf_file: Path, out: Path, force: bool) -> None:
    """Import a GGUF file (what transformers' GGUF loader reads: Llama, Qwen2, Gemma 3, …) as a float32
    safetensors HF directory: weights dequantized, tokenizer included. Needs `pip install 'kvconvert[gguf]'`."""
    from kvconvert.io.gguf_import import import_gguf as run_import

    refuse_existing(out, force)
    _silence_libraries()
    run_import(gguf_file, out, replace=force)
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
