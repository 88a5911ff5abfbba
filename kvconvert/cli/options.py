"""The options commands share: source, output and storage, calibration; ``ConversionOptions`` holds them."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvconvert.cli.fields import field_options
from kvconvert.io.outdir import parse_size, refuse_existing, refuse_overlap
from kvconvert.methods.options import Calibration

if TYPE_CHECKING:  # torch and transformers load with the command that needs them, not for --help
    from kvconvert.runtime.kvconvert_codec import QuantSpec

from kvconvert.cli.common import user_errors


def source_options(fn: Callable[..., Any]) -> Callable[..., Any]:
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


def output_options(fn: Callable[..., Any]) -> Callable[..., Any]:
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
    out: Path
    revision: str | None = None
    allow_pickle: bool = False
    device: str = "auto"
    force: bool = False
    dtype: str = "auto"
    max_shard_size: str = "5GB"
    quiet: bool = False
    kv_bits: str | None = None  # the storage options: None keeps a recipe's (or the default) value
    kv_group: int | None = None
    kv_residual: int | None = None
    kv_sink: int | None = None
    kv_rotate: bool | None = None
    kv_include_local: bool | None = None
    kv_layout: str | None = None

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


def conversion_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add the shared source/output options and hand them to ``fn`` as one ``options`` argument."""
    names = [f.name for f in dataclasses.fields(ConversionOptions)]

    @functools.wraps(fn)
    def wrapper(**kwargs: Any) -> Any:
        options = ConversionOptions(**{name: kwargs.pop(name) for name in names})
        user_errors(check_options)(options)  # at once: before torch and the source load
        return fn(options=options, **kwargs)

    return source_options(output_options(wrapper))


# --calib, --calib-tokens, --seed as every method spells them (analyze: the group alone)
calibration_options = field_options(Calibration)
