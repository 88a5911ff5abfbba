"""``kvconvert zack``'s options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvconvert.errors import KVConvertError
from kvconvert.methods.options import calib_option, calib_tokens_option, option, seed_option


@dataclass(frozen=True)
class ZackConfig:
    """ZACK: calibrated per-head rotations, adaptive widths; attention runs in the compressed space.

    Exactly one of ``kv_budget``, ``removal_rate``, ``target_agreement``."""

    kv_budget: float | None = option(None, help="Cached bytes per token ÷ original, in (0, 1].")
    removal_rate: float | None = option(None, help="Singular-value mass each head drops (eq. 6's r).")
    target_agreement: float | None = option(None, help="Smallest cache keeping this top-1 agreement (held-out).")
    calib: str | None = calib_option()
    calib_tokens: int = calib_tokens_option()  # ZACK §6.6: > 16K tokens of coherent text give stable rotations
    chunk_len: int = 512
    seed: int = seed_option()
    # The other side keeps full width, still rotated. The paper truncates both; "k" is kvconvert's
    # extension for models whose values do not survive truncation (small GQA models).
    compress: Literal["kv", "k", "v"] = option("kv", help="Which sides to truncate.")
    # "paper": R_VW from V‖W_Oᵀ stacked (§4.3). "output": V's Gram weighted by W_Oᵀ W_O.
    value_basis: Literal["paper", "output"] = option(
        "paper",
        help="V basis: the paper's V‖W_O rotation, or output: the one minimising the attention output's error "
        "on calibration text (extension).",
    )
    schedule: Literal["rate", "auto"] = option(
        "rate",
        help="Head widths: rate, the paper's one removal rate for all heads; auto (extension, with --kv-budget), "
        "each head's K and V width by the loss measured per layer and side on calibration text.",
    )
    probe_chunks: int = 4  # schedule="auto": held-out chunks each sensitivity probe is scored on

    def __post_init__(self) -> None:
        chosen = [n for n in ("kv_budget", "removal_rate", "target_agreement") if getattr(self, n) is not None]
        if len(chosen) != 1:
            raise KVConvertError("zack needs exactly one of --kv-budget, --removal-rate, --target-agreement")
        if self.kv_budget is not None and not 0 < self.kv_budget <= 1:
            raise KVConvertError(f"kv_budget must be in (0, 1], got {self.kv_budget}")
        if self.removal_rate is not None and not 0 <= self.removal_rate < 1:
            raise KVConvertError(f"removal_rate must be in [0, 1), got {self.removal_rate}")
        if self.target_agreement is not None and not 0 < self.target_agreement <= 1:
            raise KVConvertError(f"target_agreement must be in (0, 1], got {self.target_agreement}")
        if self.compress not in ("kv", "k", "v"):
            raise KVConvertError(f"compress must be kv, k or v, got {self.compress!r}")
        if self.value_basis not in ("paper", "output"):
            raise KVConvertError(f"value_basis must be paper or output, got {self.value_basis!r}")
        if self.schedule not in ("rate", "auto"):
            raise KVConvertError(f"schedule must be rate or auto, got {self.schedule!r}")
        if self.schedule == "auto" and self.kv_budget is None:
            raise KVConvertError("--schedule auto allocates a --kv-budget by measured loss; pass --kv-budget "
                                 "instead of --removal-rate or --target-agreement")  # fmt: skip
        if self.probe_chunks < 1:
            raise KVConvertError(f"probe_chunks must be >= 1, got {self.probe_chunks}")
