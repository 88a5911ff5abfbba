"""Second moments of adjacent layers' stacked K and V states, for shared subspaces (xKV, 2025).

For a layer pair (a, b) and each side (keys after RoPE, values) the stacked state of a token is
``x = [x_a, x_b]`` (all KV heads of both layers, ``2·Hkv·dk`` wide); ``PairMoments`` keeps Σx and Σxxᵀ
in float64, plus each layer's query Gram per KV group (what an error in a key costs in the scores).
Runs the model one decoder layer at a time (``run_layer_by_layer``) and keeps layer a's states of
every chunk only until layer b has run: memory is one layer's states over the calibration set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kvconvert.calib.hooks import observed_attention
from kvconvert.calib.stats import HeadGrams

F64 = torch.float64


class PairMoments:
    """Running sums over calibration tokens. ``sums[p] [2, n]`` and ``products[p] [2, n, n]`` (side 0:
    keys, 1: values; n = 2·Hkv·dk) per pair; ``grams``: the paired layers' per-head Grams (queries per KV
    group: what a key error costs); ``tokens`` counted once per pair."""

    def __init__(self, pairs: list[tuple[int, int]], num_layers: int, num_kv_heads: int, head_dim: int):
        self.pairs = pairs
        self.first = {a: p for p, (a, _) in enumerate(pairs)}
        self.second = {b: p for p, (_, b) in enumerate(pairs)}
        self.kv_heads, self.head_dim = num_kv_heads, head_dim
        width = 2 * num_kv_heads * head_dim
        self.sums = torch.zeros(len(pairs), 2, width, dtype=F64)
        self.products = torch.zeros(len(pairs), 2, width, width, dtype=F64)
        self.grams = HeadGrams(num_layers, num_kv_heads, head_dim)
        self.tokens = torch.zeros(len(pairs), dtype=torch.long)
        self._held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (pair, chunk) -> layer a
        self._chunk: dict[int, int] = {}

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """``query [b, H, n, dk]``, ``key/value [b, Hkv, n, dk]`` (after RoPE) of ``layer`` on its next chunk."""
        if layer not in self.first and layer not in self.second:
            return
        chunk = self._chunk.get(layer, 0)
        self._chunk[layer] = chunk + 1
        self.grams.add(layer, query, key, value)
        b, _, n, dk = query.shape
        states = [x.to(F64).transpose(1, 2).reshape(b * n, self.kv_heads * dk) for x in (key, value)]
        if layer in self.first:
            self._held[self.first[layer], chunk] = (states[0], states[1])
            return
        pair = self.second[layer]
        held = self._held.pop((pair, chunk))
        for side in range(2):
            stacked = torch.cat([held[side], states[side]], dim=1)  # [tokens, 2·Hkv·dk]
            self.sums[pair, side] += stacked.sum(0)
            self.products[pair, side] += stacked.T @ stacked
        self.tokens[pair] += b * n

    @property
    def query(self) -> dict[int, torch.Tensor]:
        """Σ qqᵀ ``[Hkv, dk, dk]`` over each paired layer's query heads per KV group (``HeadGrams.query``)."""
        return {layer: self.grams.query[layer] for pair in self.pairs for layer in pair}

    def covariance(self, pair: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean ``[n]``, centred covariance ``[n, n]``) of pair ``pair``'s stacked states on ``side``."""
        count = max(int(self.tokens[pair]), 1)
        mean = self.sums[pair, side] / count
        return mean, self.products[pair, side] / count - torch.outer(mean, mean)


def collect_pair_moments(
    source: Any, adapter: Any, pairs: list[tuple[int, int]], chunks: torch.Tensor, progress: bool = True
) -> PairMoments:
    """``PairMoments`` of ``pairs`` over calibration ``chunks [c, T]``, one layer-by-layer pass."""
    from kvconvert.calib.sequential import run_layer_by_layer

    layout = adapter.layout()
    moments = PairMoments(pairs, layout.num_layers, layout.num_kv_heads, layout.head_dim)

    def observer(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: Any) -> None:
        moments.observe(int(module.layer_idx), query, key, value)

    @contextlib.contextmanager
    def observe(model: Any) -> Iterator[None]:
        with observed_attention(model, observer):
            yield

    run_layer_by_layer(source, adapter, chunks, observe, progress=progress)
    unseen = [pair for pair, count in zip(pairs, moments.tokens.tolist(), strict=True) if count == 0]
    if unseen:
        raise RuntimeError(f"layer pairs {unseen} never ran during calibration")
    return moments
