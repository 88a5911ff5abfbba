"""Echo and induction scores of every attention head (RazorAttention §3.3).

The model reads K random tokens repeated four times. For a query at position i ≥ K the previous
occurrence of its token is at i − K (echo token) and the token that followed it at i − K + 1
(induction token). A head's echo/induction score is its attention weight on those positions,
averaged over all such queries. Scores are accumulated online, in chunks of query rows, inside
a registered attention function, so memory stays at one chunk's attention rows per head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from kvconvert.calib.hooks import AttentionObserver, observed_attention


@dataclass
class HeadScores:
    """Running sums per (layer, query head); ``echo``/``induction`` give the means ``[L, H]``."""

    num_layers: int
    num_heads: int
    period: int  # K: distance between two occurrences of a token
    echo_sum: torch.Tensor = field(init=False)
    induction_sum: torch.Tensor = field(init=False)
    count: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.echo_sum = torch.zeros(self.num_layers, self.num_heads, dtype=torch.float64)
        self.induction_sum = torch.zeros_like(self.echo_sum)
        self.count = torch.zeros(self.num_layers, dtype=torch.float64)

    @property
    def echo(self) -> torch.Tensor:
        return self.echo_sum / self.count.clamp(min=1)[:, None]

    @property
    def induction(self) -> torch.Tensor:
        return self.induction_sum / self.count.clamp(min=1)[:, None]

    def add(self, layer: int, probs: torch.Tensor, rows: torch.Tensor) -> None:
        """``probs [b, H, r, n]``: attention rows of queries at positions ``rows [r]`` (all ≥ period)."""
        echo_cols = (rows - self.period)[None, None, :, None].expand(probs.shape[0], probs.shape[1], -1, 1)
        self.echo_sum[layer] += probs.gather(-1, echo_cols).double().sum(dim=(0, 2, 3))
        self.induction_sum[layer] += probs.gather(-1, echo_cols + 1).double().sum(dim=(0, 2, 3))
        self.count[layer] += probs.shape[0] * rows.numel()


def _scoring_observer(scores: HeadScores, chunk: int) -> AttentionObserver:
    def observe(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float | None) -> None:  # fmt: skip
        """Echo/induction weights from causal softmax rows, chunk by chunk of query rows."""
        n, d = query.shape[2], query.shape[3]
        scale = d**-0.5 if scaling is None else scaling
        keys = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1).float()  # GQA: [b, H, n, d]
        positions = torch.arange(n, device=query.device)
        for start in range(scores.period, n, chunk):
            rows = positions[start : start + chunk]
            logits = (query[:, :, rows].float() @ keys.transpose(-1, -2)) * scale  # [b, H, r, n]
            logits = logits.masked_fill(positions[None, :] > rows[:, None], float("-inf"))
            scores.add(getattr(module, "layer_idx"), torch.softmax(logits, dim=-1), rows)  # noqa: B009

    return observe


@contextlib.contextmanager
def scoring_heads(model: Any, period: int, chunk: int = 256) -> Iterator[HeadScores]:
    """Accumulate echo/induction scores of ``model``'s heads while the block runs."""
    config = model.config
    scores = HeadScores(config.num_hidden_layers, config.num_attention_heads, period)
    with observed_attention(model, _scoring_observer(scores, chunk)):
        yield scores


def profiling_ids(vocab: int, tokens: int, exclude: set[int], seed: int = 0) -> torch.Tensor:
    """``[1, 4·tokens]``: ``tokens`` random ids (special ids excluded) repeated 4 times."""
    allowed = torch.tensor([t for t in range(vocab) if t not in exclude])
    generator = torch.Generator().manual_seed(seed)
    block = allowed[torch.randint(0, allowed.numel(), (tokens,), generator=generator)]
    return block.repeat(4)[None]


@torch.no_grad()
def profile_heads(model: Any, tokens: int, exclude: set[int], seed: int = 0, progress: bool = True) -> HeadScores:
    """Echo/induction scores of a loaded ``model`` (``profiling_ids``' sequence, one forward)."""
    ids = profiling_ids(model.config.vocab_size, tokens, exclude, seed)
    with scoring_heads(model, period=tokens) as scores:
        for _ in tqdm(range(1), desc="profiling heads", disable=not progress):
            model(ids, use_cache=False)
    return scores


def profile_heads_layer_by_layer(
    source: Any, adapter: Any, tokens: int, exclude: set[int], seed: int = 0, progress: bool = True
) -> HeadScores:
    """``profile_heads`` of a checkpoint on disk, one decoder layer in memory at a time
    (``run_layer_by_layer``): the same scores, with conversion memory bounded by one layer."""
    from kvconvert.calib.sequential import run_layer_by_layer

    ids = profiling_ids(source.config.vocab_size, tokens, exclude, seed)
    found: list[HeadScores] = []

    @contextlib.contextmanager
    def observe(model: Any) -> Iterator[None]:
        with scoring_heads(model, period=tokens) as scores:
            found.append(scores)
            yield

    run_layer_by_layer(source, adapter, ids, observe, progress=progress)
    return found[0]
