"""fp8 KV-cache scales, calibrated the way llm-compressor calibrates them, and written the way vLLM and
SGLang read them: compressed-tensors' ``kv_cache_scheme`` in ``config.json`` and one ``k_scale`` /
``v_scale`` tensor per attention block (shape ``[1]``, or ``[Hkv, 1, 1]`` per KV head).

A scale is the largest absolute key (value) seen on calibration text — after RoPE, as the cache
receives it — divided by e4m3's largest finite value (448), so the calibrated range maps onto fp8's
whole range; larger values at serving time saturate (``kvconvert_codec.fp8_store``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kvconvert.calib.hooks import observed_attention
from kvconvert.runtime.kvconvert_codec import FP8_MAX

# compressed-tensors' name for a scale strategy (``QuantizationStrategy``)
STRATEGY_NAMES = {"tensor": "tensor", "head": "attn_head"}


def scales_from_amax(amax: torch.Tensor, strategy: str, dtype: torch.dtype) -> torch.Tensor:
    """Scales for per-head absolute maxima ``amax [Hkv]``: ``[Hkv]`` per head, ``[1]`` per tensor, rounded up
    to ``dtype`` (the checkpoint stores them there, and the engines read exactly that value: a scale
    rounded down would clip the calibrated maximum). An all-zero head gets scale 1."""
    top = amax.double() if strategy == "head" else amax.double().max().reshape(1)
    scale = torch.where(top > 0, top / FP8_MAX, torch.ones_like(top))
    stored = scale.to(dtype)
    bumped = torch.nextafter(stored, stored.new_full((), torch.inf))
    return torch.where(stored.double() < scale, bumped, stored)


def scale_tensor(scales: tuple[float, ...], strategy: str, dtype: torch.dtype) -> torch.Tensor:
    """The checkpoint tensor for one side's scales, in compressed-tensors' shape for ``strategy``."""
    values = torch.tensor(scales, dtype=torch.float64).to(dtype)
    return values.reshape(-1, 1, 1) if strategy == "head" else values.reshape(1)


def kv_cache_scheme(strategy: str) -> dict[str, Any]:
    """``config.json``'s ``quantization_config``: compressed-tensors' format with only a KV-cache scheme,
    as llm-compressor writes it for a static fp8 KV cache (weights untouched: no config groups)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "compressed",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": {
            "num_bits": 8,
            "type": "float",
            "strategy": STRATEGY_NAMES[strategy],
            "dynamic": False,
            "symmetric": True,
        },
    }


@contextlib.contextmanager
def kv_amax(model: Any, num_layers: int, num_kv_heads: int) -> Iterator[list[list[torch.Tensor]]]:
    """``amax[layer] = [keys [Hkv], values [Hkv]]``: the largest absolute key and value per KV head that
    each layer's attention received inside the block (float64, CPU)."""
    amax = [[torch.zeros(num_kv_heads, dtype=torch.float64) for _ in range(2)] for _ in range(num_layers)]

    def observe(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: Any) -> None:
        for side, states in enumerate((key, value)):
            seen = states.detach().abs().amax(dim=(0, 2, 3)).double()
            amax[module.layer_idx][side] = torch.maximum(amax[module.layer_idx][side], seen)

    with observed_attention(model, observe):
        yield amax
