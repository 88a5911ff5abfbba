"""How much each attention head needs its whole cache: echo and induction scores (RazorAttention §3.3), or the
error razor's window would put into the layer's output (``window_errors``, a kvconvert extension).

Echo and induction: the model reads K random tokens repeated four times. For a query at position i ≥ K the previous
occurrence of its token is at i − K (echo token) and the token that followed it at i − K + 1
(induction token). A head's echo/induction score is its attention weight on those positions,
averaged over all such queries. Scores are accumulated online, in chunks of query rows, inside
a registered attention function, so memory stays at one chunk's attention rows per head.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from kvconvert.calib.hooks import AttentionObserver, observed_attention
from kvconvert.linalg import F64
from kvconvert.runtime.kvconvert_razor_ops import count_logit, window_budget


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
    ids = profiling_ids(source.config.vocab_size, tokens, exclude, seed)
    return _layer_by_layer(source, adapter, ids, lambda model: scoring_heads(model, period=tokens), progress)


def _layer_by_layer(source: Any, adapter: Any, ids: torch.Tensor, scoring: Any, progress: bool) -> Any:
    """What ``scoring(model)`` (a context manager yielding its accumulator) gathers while ``ids [n, T]`` run through
    ``source`` one decoder layer in memory at a time (``run_layer_by_layer``)."""
    from kvconvert.calib.sequential import run_layer_by_layer

    found: list[Any] = []

    @contextlib.contextmanager
    def observe(model: Any) -> Iterator[None]:
        with scoring(model) as scores:
            found.append(scores)
            yield

    run_layer_by_layer(source, adapter, ids, observe, progress=progress)
    return found[0]


# --------------------------------------------------------------------------- window errors
#
# Induction scores find the heads that copy (on SmolLM2 the top tenth of heads by induction carry 87 % of the attention
# that lands on a needle's digits while the model copies them), but at 8K tokens razor keeping half its heads whole
# by that score still lost needles that 4-bit storage alone kept: the heads that lose most when windowed are not
# only the copying ones. What razor changes is measurable directly: a windowed head attends over its sink, its
# newest L tokens and one compensation token (eq. 5), so the error it adds to the layer's output at a position is
# ``W_Oʰ (o_full − o_window)``. Measured at the far end of long calibration windows, where a window drops most.


def window_errors(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, sink: int,
                  window: int, window_frac: float, o_grams: torch.Tensor, scaling: float) -> torch.Tensor:  # fmt: skip
    """Per query head, the mean over query positions ``rows [r]`` of ``‖W_Oʰ (o_full − o_window)‖``: how far the
    head's attention output moves, through the output projection, when it keeps only its first ``sink`` tokens,
    the newest ``L = max(window, (p + 1)·window_frac)`` tokens at position p, and one compensation token for the
    rest (their mean key and value, logit + ln N_d: razor's runtime, ``compensated_attention``).

    ``query [H, n, dk]``, ``keys``/``values`` ``[Hkv, n, dk]`` (after RoPE, as attention reads them; query heads of
    a KV group adjacent), ``o_grams [H, dk, dk]`` (``linalg.head_output_grams``). ``[H]`` float64."""
    heads, n, dk = query.shape
    kv_heads, group, r = keys.shape[0], heads // keys.shape[0], rows.numel()
    q = query[:, rows].to(F64).reshape(kv_heads, group * r, dk)  # a KV group's query rows together
    k, v = keys.to(F64), values.to(F64)
    at = rows.repeat(group)  # position of each of the G·r rows
    pos = torch.arange(n)
    logits = (q @ k.transpose(-1, -2)) * scaling  # [Hkv, G·r, n]
    causal = pos[None, :] <= at[:, None]
    full = torch.softmax(logits.masked_fill(~causal, -torch.inf), dim=-1) @ v
    kept_recent = torch.tensor([window_budget(p + 1, window, window_frac) for p in at.tolist()])  # L per row
    last_dropped = at - kept_recent  # tokens sink..last_dropped fall out of the window
    kept = causal & ((pos[None, :] < sink) | (pos[None, :] > last_dropped[:, None]))
    dropped = (last_dropped - sink + 1).clamp(min=0)  # N_d
    upto = torch.clamp(last_dropped + 1, min=sink)  # prefix sums: tokens [sink, upto)
    zero = torch.zeros(kv_heads, 1, dk, dtype=F64)
    sums_k, sums_v = (torch.cat([zero, t.cumsum(dim=1)], dim=1) for t in (k, v))
    mean_k, mean_v = ((s[:, upto] - s[:, sink : sink + 1]) / dropped.clamp(min=1)[:, None].to(F64)
                      for s in (sums_k, sums_v))  # fmt: skip
    comp = (q * mean_k).sum(-1) * scaling + count_logit(dropped.to(F64), F64)  # no weight where nothing was dropped
    probs = torch.softmax(torch.cat([logits.masked_fill(~kept, -torch.inf), comp[..., None]], dim=-1), dim=-1)
    approx = probs[..., :-1] @ v + probs[..., -1:] * mean_v
    error = (full - approx).reshape(heads, r, dk)
    return torch.einsum("hrd,hde,hre->hr", error, o_grams.to(F64), error).clamp(min=0).sqrt().mean(dim=-1)


@dataclass
class WindowErrors:
    """Running mean of ``window_errors`` per (layer, query head)."""

    num_layers: int
    num_heads: int
    total: torch.Tensor = field(init=False)
    count: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.total = torch.zeros(self.num_layers, self.num_heads, dtype=F64)
        self.count = torch.zeros(self.num_layers, dtype=F64)

    @property
    def mean(self) -> torch.Tensor:
        return self.total / self.count.clamp(min=1)[:, None]


@contextlib.contextmanager
def scoring_window_errors(model: Any, o_grams: list[torch.Tensor], sink: int, window: int, window_frac: float,
                          rows: int, layers: Collection[int] | None = None) -> Iterator[WindowErrors]:  # fmt: skip
    """Accumulate ``window_errors`` at the last ``rows`` positions of every sequence ``model`` reads in the block, in
    ``layers`` (default all; the others stay 0); ``o_grams[layer] [H, dk, dk]``."""
    config = model.config
    errors = WindowErrors(config.num_hidden_layers, config.num_attention_heads)

    def observe(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float | None) -> None:  # fmt: skip
        layer, n = getattr(module, "layer_idx"), query.shape[2]  # noqa: B009
        if layers is not None and layer not in layers:
            return
        positions = torch.arange(max(0, n - rows), n)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        for b in range(query.shape[0]):
            errors.total[layer] += window_errors(query[b], key[b], value[b], positions, sink, window, window_frac,
                                                 o_grams[layer], scale)  # fmt: skip
            errors.count[layer] += 1

    with observed_attention(model, observe):
        yield errors


def profile_window_errors_layer_by_layer(source: Any, adapter: Any, chunks: torch.Tensor, o_grams: list[torch.Tensor],
                                         sink: int, window: int, window_frac: float, rows: int = 64,
                                         layers: Collection[int] | None = None,
                                         progress: bool = True) -> torch.Tensor:  # fmt: skip
    """``window_errors`` of every head ``[L, H]`` in ``layers`` (default all; the others 0), averaged over ``chunks
    [n, T]`` (their last ``rows`` positions), one decoder layer in memory at a time."""
    scoring = functools.partial(scoring_window_errors, o_grams=o_grams, sink=sink, window=window,
                                window_frac=window_frac, rows=rows, layers=layers)  # fmt: skip
    errors: WindowErrors = _layer_by_layer(source, adapter, chunks, scoring, progress)
    return errors.mean
