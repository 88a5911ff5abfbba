"""How alike adjacent layers' KV states are (MiniCache fig. 1a / 2b), measured on calibration text.

For every adjacent pair (l-1, l) and every token, the cosine similarity of the two layers' keys
(and values), each token's state taken as one vector over all KV heads (what MiniCache merges),
plus the per-KV-head cosines, the mean angular distance d = Ω/π, and the share of tokens eq. 4
would keep unmerged at γ. Runs the model one decoder layer at a time and keeps only the previous
layer's states, never a dump of all layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kvconvert.arch import adapter_for
from kvconvert.calib.hooks import observed_attention
from kvconvert.io.source import SourceCheckpoint
from kvconvert.runtime.kvconvert_merge import merge_tokens, retained_tokens

F64 = torch.float64


class _PairAccumulator:
    """Running sums per pair (l-1, l), l = 1..L-1, over chunks fed layer after layer."""

    def __init__(self, num_layers: int, num_kv_heads: int, gamma: float):
        pairs = num_layers - 1
        self.gamma = gamma
        self.previous: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # chunk -> (k, v) of the last layer
        self.seen_chunks = [0] * num_layers
        self.cos = torch.zeros(pairs, 2, dtype=F64)  # Σ over tokens, [pair, K|V]
        self.head_cos = torch.zeros(pairs, 2, num_kv_heads, dtype=F64)
        self.distance = torch.zeros(pairs, 2, dtype=F64)
        self.retained = torch.zeros(pairs, 2, dtype=F64)
        self.tokens = 0

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """``key/value [b, Hkv, n, dk]`` (after RoPE) of ``layer`` on the next chunk."""
        chunk = self.seen_chunks[layer]
        self.seen_chunks[layer] += 1
        current = (key.float(), value.float())
        before = self.previous.get(chunk)
        self.previous[chunk] = current
        if before is None or layer == 0:
            return
        if layer == 1:
            self.tokens += key.shape[0] * key.shape[2]
        pair = layer - 1
        for side, (first, second) in enumerate(zip(before, current, strict=True)):
            merged = merge_tokens(first, second, t=0.5)
            self.cos[pair, side] += torch.cos(merged.distance.double() * torch.pi).sum()
            self.distance[pair, side] += merged.distance.double().sum()
            heads = torch.nn.functional.cosine_similarity(first, second, dim=-1)  # [b, Hkv, n]
            self.head_cos[pair, side] += heads.double().sum(dim=(0, 2))
            b = first.shape[0]
            fresh = torch.tensor([torch.inf, -torch.inf]).repeat(b, 1)
            valid = torch.ones_like(merged.distance, dtype=torch.bool)
            keep, _ = retained_tokens(merged.distance, valid, fresh, self.gamma)
            self.retained[pair, side] += keep.double().sum()

    def result(self) -> list[dict[str, Any]]:
        n = max(self.tokens, 1)
        rows = []
        for pair in range(self.cos.shape[0]):
            row: dict[str, Any] = {"layers": [pair, pair + 1]}
            for side, name in enumerate(("k", "v")):
                row[f"cos_{name}"] = float(self.cos[pair, side] / n)
                row[f"distance_{name}"] = float(self.distance[pair, side] / n)
                row[f"retained_{name}"] = float(self.retained[pair, side] / n)
                row[f"cos_{name}_heads"] = [round(float(c / n), 6) for c in self.head_cos[pair, side]]
            rows.append(row)
        return rows


def measure_layer_similarity(
    source: SourceCheckpoint,
    calib: str | None = None,
    tokens: int = 16384,
    chunk_len: int = 512,
    seed: int = 0,
    gamma: float = 0.05,
    progress: bool = True,
) -> dict[str, Any]:
    """Adjacent-layer similarity of K and V on calibration text (see the module docstring).

    Returns ``{"pairs": [{"layers": [l-1, l], "cos_k", "cos_v", "distance_k", "distance_v",
    "retained_k", "retained_v", "cos_k_heads", "cos_v_heads"}, …], "calib", "tokens", "gamma"}``.
    """
    from kvconvert.calib.sequential import run_layer_by_layer
    from kvconvert.calib.text import calibration_set

    adapter = adapter_for(source.config)
    layout = adapter.layout()
    calib_set = calibration_set(source.path, calib, tokens, min(chunk_len, layout.context), seed)
    accumulator = _PairAccumulator(layout.num_layers, layout.num_kv_heads, gamma)

    def observer(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: Any) -> None:
        accumulator.observe(int(module.layer_idx), key, value)

    @contextlib.contextmanager
    def observe(model: Any) -> Iterator[None]:
        with observed_attention(model, observer):
            yield

    run_layer_by_layer(source, adapter, calib_set.chunks, observe, progress=progress)
    return {"pairs": accumulator.result(), "calib": calib_set.source, "tokens": calib_set.tokens, "gamma": gamma}


def pair_similarity(pair: dict[str, Any]) -> float:
    """The similarity a merge must keep: the smaller of the K and V mean cosines."""
    return min(pair["cos_k"], pair["cos_v"])


def shallowest_start(pairs: list[dict[str, Any]], num_layers: int, min_similarity: float) -> int | None:
    """Smallest S such that every pair (S, S+1), (S+2, S+3), … reaches ``min_similarity``; None if none does."""
    similar = [pair_similarity(p) >= min_similarity for p in pairs]  # similar[l-1]: pair (l-1, l)
    best = None
    for start in range(num_layers - 2, -1, -1):
        if all(similar[first] for first in range(start, num_layers - 1, 2)):
            best = start
    return best


def similarity_table(result: dict[str, Any], merged: set[tuple[int, ...]] | None = None) -> str:
    """``measure_layer_similarity``'s result as the table ``analyze`` and ``minicache`` print (``merged``:
    the pairs a plan merged, marked)."""
    lines = [f"adjacent-layer similarity on {result['calib']} ({result['tokens']} tokens; kept = unmerged at "
             f"γ = {result['gamma']}):"]  # fmt: skip
    header = f"{'pair':>7}  {'cos K':>7}  {'cos V':>7}  {'kept K':>7}  {'kept V':>7}"
    lines.append(header + ("  merged" if merged else ""))
    for row in result["pairs"]:
        a, b = row["layers"]
        mark = ("  yes" if (a, b) in merged else "") if merged else ""
        lines.append(f"{a:>3}-{b:<3}  {row['cos_k']:>7.3f}  {row['cos_v']:>7.3f}  {row['retained_k']:>7.1%}  "
                     f"{row['retained_v']:>7.1%}{mark}")  # fmt: skip
    return "\n".join(lines)
