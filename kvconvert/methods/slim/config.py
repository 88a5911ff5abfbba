"""``kvconvert slim``'s options."""

from __future__ import annotations

from dataclasses import dataclass

from kvconvert.errors import KVConvertError
from kvconvert.methods.options import option


@dataclass(frozen=True)
class SlimConfig:
    """Slim attention: cache only K, compute V = K·W_KV (exact; MHA models only)."""

    # Measured on random inputs with K stored in the checkpoint dtype.
    max_v_error: float = option(
        1e-2,
        help="Refuse if V rebuilt from the cached K deviates more than this (relative RMS) in the output dtype.",
    )
    accept_v_error: bool = option(False, help="Convert even when V's error exceeds --max-v-error.")
    error_samples: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.max_v_error > 0:
            raise KVConvertError(f"max_v_error must be > 0, got {self.max_v_error}")
        if self.error_samples < 1:
            raise KVConvertError(f"error_samples must be >= 1, got {self.error_samples}")
