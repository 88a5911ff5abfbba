"""``kvconvert minicache``'s options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvconvert.errors import KVConvertError
from kvconvert.methods.options import calib_option, calib_tokens_option, option, seed_option


@dataclass(frozen=True)
class MiniCacheConfig:
    """MiniCache: layer pairs from mid-depth share one KV direction tensor + per-layer norms + retained tokens.

    At most one of ``start_layer``, ``kv_budget``, ``min_similarity``."""

    start_layer: int | None = option(None, help="First merged layer S (default L/2; L merges nothing).")
    kv_budget: float | None = option(None, help="Merge the fewest deepest pairs meeting this budget.")
    min_similarity: float | None = option(None, help="Calibrate; S = shallowest layer whose pairs keep this cosine.")
    t: float = option(0.6, help="SLERP parameter (1 leans to layer l).")  # eq. 3
    gamma: float = option(0.05, help="Retention threshold (0: none, 1: all).")  # eq. 4
    # "average": the paper's mean baseline (table G)
    merge: Literal["slerp", "average", "subspace"] = option(
        "slerp",
        help="Merge function; subspace (extension, xKV): a pair shares one calibrated latent per token, widths by "
        "loss.",
    )
    # Not --kv-sink (tokens kept unquantized) nor razor's --window-sink (tokens kept beside a window).
    sink: int = option(
        4,
        flags=("--unmerged-sink", "--sink"),
        help="--merge subspace: first tokens of a sequence kept exact (unmerged) in both layers of a pair "
        "(attention sinks).",
    )
    calibrate: bool = False  # measure adjacent-layer similarity (always on with min_similarity)
    calib: str | None = calib_option(
        "Measure adjacent-layer similarity on this text (bare --calib: the shipped calib_data/); "
        "--merge subspace fits its latents on it.",
        turns_on="calibrate",
    )
    calib_tokens: int = calib_tokens_option()
    chunk_len: int = 512
    seed: int = seed_option()

    def __post_init__(self) -> None:
        chosen = [n for n in ("start_layer", "kv_budget", "min_similarity") if getattr(self, n) is not None]
        if len(chosen) > 1:
            raise KVConvertError("minicache takes at most one of --start-layer, --kv-budget, --min-similarity")
        if self.start_layer is not None and self.start_layer < 0:
            raise KVConvertError(f"start_layer must be >= 0, got {self.start_layer}")
        if self.kv_budget is not None and not 0 < self.kv_budget <= 1:
            raise KVConvertError(f"kv_budget must be in (0, 1], got {self.kv_budget}")
        if self.min_similarity is not None and not -1 <= self.min_similarity <= 1:
            raise KVConvertError(f"min_similarity is a cosine, in [-1, 1]; got {self.min_similarity}")
        for name in ("t", "gamma"):
            if not 0 <= getattr(self, name) <= 1:
                raise KVConvertError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.merge not in ("slerp", "average", "subspace"):
            raise KVConvertError(f"merge must be slerp, average or subspace, got {self.merge!r}")
        if self.sink < 0:
            raise KVConvertError(f"sink must be >= 0, got {self.sink}")
        if self.merge == "subspace" and self.min_similarity is not None:
            raise KVConvertError("--merge subspace needs no similar layers; choose its pairs with --start-layer or "
                                 "its latent widths with --kv-budget, not --min-similarity")  # fmt: skip

    @property
    def measures(self) -> bool:
        """Measure adjacent-layer similarity (a subspace merge calibrates its own statistics instead)."""
        return (self.calibrate and self.merge != "subspace") or self.min_similarity is not None
