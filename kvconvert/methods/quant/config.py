"""``kvconvert quant``'s options (besides the storage options every command takes: ``--kv-bits`` …)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvconvert.errors import KVConvertError
from kvconvert.methods.options import calib_option, calib_tokens_option, option, seed_option

Width = Literal[2, 3, 4, 8]  # the integer widths a layer may get (``kvconvert_codec.BITS`` below 16)


@dataclass(frozen=True)
class QuantConfig:
    """Quantized KV cache alone (KIVI layout: keys per channel, values per token): the baseline to beat."""

    kv_budget: float | None = option(None, help="Bytes ÷ a 16-bit cache; widths per layer chosen by measured loss.")
    min_bits: Width = option(2, help="With --kv-budget.")
    max_bits: Width = option(4, help="With --kv-budget.")
    recall_context: int = option(0, help="Experimental, with --kv-budget: also weigh each width by what it costs "
                                 "recalling a fact from prompts this many tokens long made of the calibration text "
                                 "(0: off). On SmolLM2 at 8K it kept no more needles than without it "
                                 "(docs/quant.md).")  # fmt: skip
    recall_prompts: int = option(8, help="With --recall-context: how many prompts.")
    calib: str | None = calib_option("With --kv-budget: calibration text (default: the shipped calib_data/).")
    calib_tokens: int = calib_tokens_option(2048)  # the sensitivities need far less text than a fit
    seed: int = seed_option()

    def __post_init__(self) -> None:
        if self.kv_budget is not None and not 0 < self.kv_budget <= 1:
            raise KVConvertError(f"kv_budget must be in (0, 1], got {self.kv_budget}")
        if self.recall_context < 0 or self.recall_prompts < 1:
            raise KVConvertError(f"recall_context must be >= 0 and recall_prompts >= 1, got {self.recall_context}, "
                                 f"{self.recall_prompts}")  # fmt: skip
        if self.recall_context and self.kv_budget is None:
            raise KVConvertError("--recall-context weighs the widths --kv-budget chooses: give --kv-budget too")
        if self.min_bits not in (2, 3, 4, 8) or self.max_bits not in (2, 3, 4, 8) or self.min_bits > self.max_bits:
            raise KVConvertError(f"min_bits and max_bits must be 8, 4, 3 or 2 with min ≤ max, got {self.min_bits}, "
                                 f"{self.max_bits}")  # fmt: skip

    @property
    def choices(self) -> list[int]:
        return [b for b in (8, 4, 3, 2) if self.min_bits <= b <= self.max_bits]
