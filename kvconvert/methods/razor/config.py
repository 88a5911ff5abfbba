"""``kvconvert razor``'s options (defaults: the paper's Table 2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvconvert.errors import KVConvertError
from kvconvert.methods.options import calib_option, option

HeadsBy = Literal["induction", "window-error"]


@dataclass(frozen=True)
class RazorConfig:
    """RazorAttention: full cache for retrieval heads, sink + window + compensation token for the rest."""

    heads_by: HeadsBy = option(
        "induction",
        help="How the heads kept whole are chosen. induction (the paper): echo and induction scores on repeated random "
        "tokens, --induction-frac / --echo-frac. window-error (kvconvert extension): the --whole-share of KV heads "
        "whose window would move the layer's output most, measured at the end of long windows of --calib text.",
    )
    induction_frac: float = option(0.14, help="Top heads by induction score.")
    echo_frac: float = option(0.01, help="Top heads by echo score.")
    # Not --kv-sink (tokens kept unquantized) nor minicache's --unmerged-sink (tokens kept out of a merge).
    sink: int = option(
        4, flags=("--window-sink", "--sink"), help="First tokens every non-retrieval head keeps beside its window."
    )
    # None: min(4000, context / 16), i.e. the paper's 4000 scaled down for short-context models
    window: int | None = option(None, help="Recent tokens kept (default min(4000, context/16)).")
    window_frac: float = option(0.2, help="Recent share kept: L = max(window, N·frac).")
    profile_tokens: int | None = option(None, help="K random tokens for profiling (repeated 4×).")
    whole_share: float = option(0.5, help="With --heads-by window-error: share of the KV heads kept whole.")
    profile_context: int | None = option(
        None, help="With --heads-by window-error: tokens per calibration window (default min(context, 8192))."
    )
    profile_windows: int = option(2, help="With --heads-by window-error: calibration windows measured.")
    calib: str | None = calib_option(
        "With --heads-by window-error: the text measured: file, directory of *.txt, or dataset "
        "name[:config]:split:column (default calib_data/)."
    )
    kv_budget: float | None = option(None, help="Long-context budget; sets --window-frac.")
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("induction_frac", "echo_frac", "window_frac", "whole_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise KVConvertError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.sink < 0 or (self.window is not None and self.window < 1):
            raise KVConvertError("sink must be >= 0 and window >= 1")
        if self.kv_budget is not None and not 0 < self.kv_budget <= 1:
            raise KVConvertError(f"kv_budget must be in (0, 1], got {self.kv_budget}")
        if self.profile_tokens is not None and self.profile_tokens < 2:
            raise KVConvertError(f"profile_tokens must be >= 2, got {self.profile_tokens}")
        if (self.profile_context is not None and self.profile_context < 2) or self.profile_windows < 1:
            raise KVConvertError(f"profile_context must be >= 2 and profile_windows >= 1, got {self.profile_context}, "
                                 f"{self.profile_windows}")  # fmt: skip
