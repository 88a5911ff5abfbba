"""``kvconvert lorc``'s options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvconvert.errors import KVConvertError
from kvconvert.methods.options import calib_option, calib_tokens_option, option, seed_option

Schedule = Literal["progressive", "uniform", "auto"]
Target = Literal["kv", "k", "v"]
Latent = Literal["separate", "joint", "mla"]
MlaSizes = Literal["budget", "vllm"]


@dataclass(frozen=True)
class LorcConfig:
    """LoRC: low-rank K/V weights, the cache holds rank-d_c latents (any MHA/GQA model)."""

    kv_budget: float = option(help="Cached bytes per token ÷ original, in (0, 1].")
    schedule: Schedule = option(
        "progressive",
        help="Per-layer ranks from cumulative condition numbers (paper eq. 13), one ratio for all layers, or "
        "auto: per layer and side by measured loss on calibration text (extension; implies --calib).",
    )
    # log10 κ̃: paper F.1 gives 30 for Llama-3-8B and 90 for Llama-2-13B / Llama-3-70B without units; raw κ̃
    # reaches 1e68 on SmolLM2, so it must be log10.
    threshold: float | None = option(None, help="Leave layers with log10 κ̃ above this uncompressed.")
    compress: Target = option("kv", help="Which projections.")
    # Extension: activation-aware factorization on calibration text (implied by schedule="auto").
    calibrate: bool = False
    calib: str | None = calib_option(
        "Factor to minimise the error of the keys and values (through W_O) on this text, not of the weights "
        "(extension; bare --calib: the shipped calib_data/).",
        turns_on="calibrate",
    )
    calib_tokens: int = calib_tokens_option()
    chunk_len: int = 512
    seed: int = seed_option()
    probe_chunks: int = 4  # schedule="auto": held-out chunks each sensitivity probe is scored on
    # refit through both measurements by ``linalg.loss_curve``
    probe_rounds: int = option(
        1,
        help="--schedule auto: rounds of loss probes; each later round re-measures every side at the rank the "
        "last allocation gave it and refits its loss curve through both measurements (extension).",
    )
    refine_steps: int = option(
        0,
        help="After the closed-form factorization, this many Adam steps per layer on the error of the attention "
        "output (softmax and W_O included) against the source layer, layer by layer on calibration text "
        "(extension; implies --calib; 0: off).",
    )
    refine_chunks: int = 8  # calibration chunks each layer's refinement fits
    distill_steps: int = option(
        0,
        help="--latent mla: after the layer-wise fit, this many Adam steps on the whole exported model's attention "
        "projections, on the KL from the source's next-token distribution over calibration chunks, backpropagated "
        "through every layer (extension; loads the source and the export whole; 0: off).",
    )
    # calibration chunks of ``distill_len`` tokens the distillation fits (fewer where the text holds fewer): 16
    # rather than 8 measured +53.1 % instead of +54.3 % on SmolLM2 at 0.5 (docs/lorc.md); the fit overfits its text
    distill_chunks: int = 16
    distill_len: int = 1024
    # MLA-style (DeepSeek-V2; TransMLA and MHA2MLA convert to it)
    latent: Latent = option(
        "separate",
        help="One latent per layer for K and one for V (the paper), or joint: one latent both are rebuilt from, "
        "K's and V's errors weighted by their measured loss (extension, MLA-style; needs --schedule auto), or "
        "mla: a standard DeepSeek-V3 checkpoint (one latent + a shared RoPE key per layer, the same width in "
        "every layer) that stock transformers, vLLM and SGLang load without kvconvert (extension; implies --calib).",
    )
    # latent="mla": the relative distances (tokens) over which a key part that loses its rotation is averaged
    mla_distance: int | None = option(
        None,
        help="--latent mla: score the key parts the shared RoPE key cannot hold with their mean rotation over "
        "relative distances 0..N-1 spread evenly (default: as each head's attention spreads on calibration text).",
    )
    mla_rope_dim: int | Literal["auto"] | None = option(
        None,
        help="--latent mla: width of the RoPE key all heads share (qk_rope_head_dim), which keeps the fastest "
        "frequencies (default: the head width, at most 64: what engines' MLA kernels take), or auto: a quarter, "
        "half, three quarters and all of that width, each built as it would be written (--refine-steps included), "
        "and the one with the lowest KL from the source on held-out calibration text kept (extension).",
    )
    mla_sizes: MlaSizes = option(
        "budget",
        help="--latent mla: the export's kv_lora_rank and RoPE key width: the budget's, or vllm: 512 + 64, the one "
        "size every vLLM MLA kernel takes (its CPU build's only one), the budget's latent and key zero-padded to "
        "it: the same model, whose cache then holds 576 values per token and layer; a budget whose latent would "
        "exceed 512 is refused (extension).",
    )

    def __post_init__(self) -> None:
        if not 0 < self.kv_budget <= 1:
            raise KVConvertError(f"kv_budget must be in (0, 1], got {self.kv_budget}")
        if self.schedule not in ("progressive", "uniform", "auto"):
            raise KVConvertError(f"schedule must be progressive, uniform or auto, got {self.schedule!r}")
        if self.compress not in ("kv", "k", "v"):
            raise KVConvertError(f"compress must be kv, k or v, got {self.compress!r}")
        if self.schedule == "auto":
            if self.threshold is not None:
                raise KVConvertError("--threshold belongs to the condition-number schedules; auto measures each layer")
            object.__setattr__(self, "calibrate", True)  # its losses are measured on calibration text
        if self.probe_chunks < 1:
            raise KVConvertError(f"probe_chunks must be >= 1, got {self.probe_chunks}")
        if self.probe_rounds < 1:
            raise KVConvertError(f"probe_rounds must be >= 1, got {self.probe_rounds}")
        if self.probe_rounds > 1 and self.schedule != "auto":
            raise KVConvertError("--probe-rounds belongs to --schedule auto")
        if self.refine_steps < 0 or self.refine_chunks < 1:
            raise KVConvertError(f"refine_steps must be >= 0 and refine_chunks >= 1, got {self.refine_steps} "
                                 f"and {self.refine_chunks}")  # fmt: skip
        if self.refine_steps:
            object.__setattr__(self, "calibrate", True)  # it fits on calibration activations
        if self.distill_steps < 0 or self.distill_chunks < 1 or self.distill_len < 2:
            raise KVConvertError(f"distill_steps must be >= 0, distill_chunks >= 1 and distill_len >= 2, got "
                                 f"{self.distill_steps}, {self.distill_chunks} and {self.distill_len}")  # fmt: skip
        if self.distill_steps and self.latent != "mla":
            raise KVConvertError("--distill-steps fits a DeepSeek-V3 export as stock transformers builds it: it "
                                 "needs --latent mla")  # fmt: skip
        if self.latent not in ("separate", "joint", "mla"):
            raise KVConvertError(f"latent must be separate, joint or mla, got {self.latent!r}")
        rope = self.mla_rope_dim
        if rope is not None and self.latent != "mla":
            raise KVConvertError("--mla-rope-dim is the width of an MLA export's RoPE key: it needs --latent mla")
        if self.mla_sizes not in ("budget", "vllm"):
            raise KVConvertError(f"mla_sizes must be budget or vllm, got {self.mla_sizes!r}")
        if self.mla_sizes != "budget" and self.latent != "mla":
            raise KVConvertError("--mla-sizes sets an MLA export's kv_lora_rank and RoPE width: it needs --latent mla")
        if rope is not None and rope != "auto" and (rope < 2 or rope % 2):
            raise KVConvertError(f"--mla-rope-dim takes an even width >= 2 or auto; got {rope}")
        if self.mla_distance is not None and (self.latent != "mla" or self.mla_distance < 1):
            raise KVConvertError(f"--mla-distance takes a whole number of tokens >= 1, with --latent mla; got "
                                 f"{self.mla_distance}")  # fmt: skip
        if self.latent == "mla":
            # DeepSeek-V3's config has one kv_lora_rank for every layer and no per-layer opt-out
            for wrong, reason in (
                (self.schedule == "auto", "--schedule auto (one latent width for every layer)"),
                (self.threshold is not None, "--threshold (every layer becomes MLA)"),
                (self.compress != "kv", "--compress k/v (MLA rebuilds keys and values)"),
            ):
                if wrong:
                    raise KVConvertError(f"--latent mla does not combine with {reason}")
            object.__setattr__(self, "calibrate", True)  # the shared RoPE key and the latent are fitted on text
        if self.latent == "joint":
            if self.compress != "kv":
                raise KVConvertError("--latent joint shares one latent between K and V: it needs --compress kv")
            if self.schedule != "auto":
                raise KVConvertError("--latent joint needs --schedule auto (its K/V weights and ranks come from "
                                     "auto's loss probes)")  # fmt: skip
            if self.probe_rounds > 1:
                raise KVConvertError("--latent joint does not combine with --probe-rounds yet (its probes measure "
                                     "one side at a time)")  # fmt: skip
