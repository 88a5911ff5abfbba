"""What ``lorc --latent mla`` measures on calibration text, in one layer-by-layer pass: each attention layer's
input Gram (the factorizations' weighting) and, per query head, how its attention spreads over relative
distances (the mean rotation of the key parts that lose RoPE, ``methods.lorc.mla.mean_rotation``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

F64 = torch.float64


@contextlib.contextmanager
def accumulating_distances(model: Any, num_heads: int, length: int) -> Iterator[torch.Tensor]:
    """``hist [L, H, length]`` float64: Σ over queries of the attention probability each query head puts on
    the key ``Δ`` tokens back (stock softmax attention, causal), accumulated while the block runs."""
    from kvconvert.calib.hooks import observed_attention

    hist = torch.zeros(model.config.num_hidden_layers, num_heads, length, dtype=F64)
    steps = torch.arange(length)
    distance = (steps[:, None] - steps[None, :]).clamp(min=0)  # [m, n]: m − n where n ≤ m

    def observe(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: Any) -> None:
        n = query.shape[2]
        keys = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        for row in range(query.shape[0]):  # one chunk at a time: [H, n, n] probabilities
            scores = (query[row].float() @ keys[row].float().transpose(-1, -2)) * float(scaling)
            probs = scores.masked_fill(future, float("-inf")).softmax(-1).to(F64)
            index = distance[:n, :n].reshape(1, -1).expand(probs.shape[0], -1)
            hist[module.layer_idx, :, :n].scatter_add_(1, index, probs.reshape(probs.shape[0], -1))

    with observed_attention(model, observe):
        yield hist


def collect_mla_statistics(
    source: Any, adapter: Any, chunks: torch.Tensor, progress: bool = True
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per layer the mean ``x xᵀ [D, D]`` of the attention inputs, and the attention-distance histograms
    ``[L, H, T]`` over ``chunks [n, T]``, float64."""
    from kvconvert.calib.stats import accumulating_input_grams, complete_input_grams, observe_layers

    heads = adapter.layout().num_heads
    inputs, hist = observe_layers(source, adapter, chunks, [
        lambda model: accumulating_input_grams(model, adapter.attention_module_paths()),
        lambda model: accumulating_distances(model, heads, int(chunks.shape[1])),
    ], progress)  # fmt: skip
    return [g / chunks.numel() for g in complete_input_grams(inputs)], hist
