"""The options commands share, declared once as dataclass fields (``SourceOptions``: the source model;
``ConversionOptions``: source, output and cache storage) and turned into click options by
``kvconvert.cli.fields``; calibration's group is ``kvconvert.methods.options.Calibration``."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvconvert.cli.common import user_errors
from kvconvert.cli.fields import field_options
from kvconvert.io.outdir import parse_size, refuse_existing, refuse_overlap
from kvconvert.methods.options import Calibration, option

if TYPE_CHECKING:  # torch and transformers load with the command that needs them, not for --help
    from kvconvert.runtime.kvconvert_codec import QuantSpec


@dataclass(frozen=True, kw_only=True)
class SourceOptions:
    """Where the source model comes from, and where its calibration runs."""

    model: str = option(help="Hub id or local directory of the source model.")
    revision: str | None = option(None, help="Hub branch, tag or commit of --model.")
    allow_pickle: bool = option(False, help="Read pickled .bin weights (weights_only=True).")
    device: str = option(
        "auto",
        help="Where calibration and profiling run the model (one layer at a time): cpu, cuda, cuda:N, or auto "
        "(the first GPU if there is one). Weight rewrites stay on the CPU.",
    )


@dataclass(frozen=True, kw_only=True)
class ConversionOptions(SourceOptions):
    """The options every conversion command shares (source, output, storage of the cache)."""

    out: Path = option(help="Output directory.")
    force: bool = option(False, help="Replace an existing --out.")
    # the storage options: None keeps a recipe's (or the default) value
    kv_bits: Literal["16", "8", "4", "3", "2"] | None = option(
        None, help="Storage of what the cache holds: 16 = the model's dtype (default), 8/4/3/2-bit integers."
    )
    kv_group: int | None = option(None, help="Values per quantization group / tokens per key block (default 64).")
    kv_residual: int | None = option(None, help="Newest tokens kept unquantized (default 128).")
    kv_sink: int | None = option(
        None, help="First tokens of every sequence kept unquantized: attention sinks (kvconvert extension; default 0)."
    )
    kv_rotate: bool | None = option(
        None,
        help="Rotate values (randomized Hadamard per group) before quantizing them (kvconvert extension; default off).",
    )
    kv_layout: Literal["kivi", "token"] | None = option(
        None,
        help="kivi (default): keys per channel, values per token. token (kvconvert extension, quant and razor, "
        "4-bit): both per token after a Hadamard rotation, in the layout torch's int4 kernel reads, so CPU "
        "decoding reads the codes without dequantizing the cache (razor: its retrieval heads and windows); on an "
        "NVIDIA GPU with Triton its own kernel reads them.",
    )
    kv_format: Literal["int", "fp8"] | None = option(
        None,
        help="int (default): the integer storage above. fp8 (quant only): float8 e4m3 with static scales calibrated "
        "on --calib text, written as compressed-tensors' kv_cache_scheme, so vLLM and SGLang load it as it is.",
    )
    kv_scale_strategy: Literal["tensor", "head"] | None = option(
        None, help="fp8 scales: one per layer (tensor, default; every engine backend) or one per KV head (head)."
    )
    kv_include_local: bool | None = option(
        None,
        help="Also quantize sliding-window layers' caches (Gemma 2/3); by default they stay stock, bounded by "
        "the window.",
    )
    kv_local_bits: Literal["8", "4", "3", "2"] | None = option(
        None,
        help="Sliding-window layers' width (Gemma 2/3), quantized apart from the others' --kv-bits (implies "
        "--kv-include-local): their caches hold at most a window, so more bits there cost little at long context.",
    )
    kv_value_bits: Literal["8", "4", "3", "2"] | None = option(
        None,
        help="Values' width apart from --kv-bits, which then sets the keys' (kvconvert extension): values often "
        "take fewer bits than keys for the same loss. With --kv-layout token (quant, razor): 4-bit token-layout keys "
        "beside values stored per token, rotated, at this width; decode steps read both sides' codes.",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = option(
        "auto", help="Output dtype; auto keeps the source's."
    )
    max_shard_size: str = option("5GB", help="Largest output shard.")
    quiet: bool = option(False, help="No progress bar or summary table.")

    def storage(self, base: QuantSpec | None = None) -> QuantSpec:
        """The cache storage these options ask for; options not given keep ``base``'s (a recipe's)."""
        from kvconvert.recipe import storage_spec

        given = {"kv_bits": None if self.kv_bits is None else int(self.kv_bits), "kv_group": self.kv_group,
                 "kv_residual": self.kv_residual, "kv_sink": self.kv_sink, "kv_rotate": self.kv_rotate,
                 "kv_include_local": self.kv_include_local, "kv_layout": self.kv_layout, "kv_format": self.kv_format,
                 "kv_scale_strategy": self.kv_scale_strategy,
                 "kv_local_bits": None if self.kv_local_bits is None else int(self.kv_local_bits),
                 "kv_value_bits": None if self.kv_value_bits is None else int(self.kv_value_bits)}  # fmt: skip
        return storage_spec(given, "options", base)


source_options = field_options(SourceOptions)  # analyze's: the source alone
calibration_options = field_options(Calibration)  # --calib, --calib-tokens, --seed as every method spells them


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

    return field_options(ConversionOptions)(wrapper)
