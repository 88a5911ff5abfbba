"""Perplexity, KL(reference ‖ model) and top-1 agreement over non-overlapping windows."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from kvconvert.devices import model_device, synchronize
from kvconvert.eval.memory import PeakMemory, page_in

ROWS = 128  # positions whose full-vocabulary log-probs are held in float64 at once


@dataclass
class QualityResult:
    tokens: int  # predicted tokens (each window's first token is context only)
    ppl: float
    reference_ppl: float | None = None
    kl_mean: float | None = None  # mean over predicted tokens of KL(p_reference ‖ p_model), nats
    top1_agreement: float | None = None  # fraction of tokens whose argmax agrees
    # context protocol only: per model ("model", "reference" when it went through its cache too)
    costs: dict[str, WindowCosts] = field(default_factory=dict)


@dataclass
class WindowCosts:
    """What putting a window's context into the cache costs: prefill seconds summed over windows, and the
    largest peak memory one window's scoring (its prefill and its continuation) added (``PeakMemory``)."""

    windows: int = 0
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    peak_bytes: int | None = None

    def add(self, seconds: float, tokens: int, peak: int | None) -> None:
        self.windows += 1
        self.prefill_seconds += seconds
        self.prefill_tokens += tokens
        if peak is not None:
            self.peak_bytes = max(peak, self.peak_bytes or 0)


def windows(token_ids: torch.Tensor, ctx: int) -> list[torch.Tensor]:
    """Non-overlapping ``[1, <=ctx]`` windows; a trailing window shorter than 2 tokens is dropped."""
    return [
        token_ids[i : i + ctx][None] for i in range(0, token_ids.numel(), ctx) if token_ids[i : i + ctx].numel() > 1
    ]


def window_logits(model: Any, window: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """Logits ``[1, n, V]`` of one window: one forward, or ``chunk`` tokens at a time through the
    cache (what token-dropping caches need to be measured: a single forward attends over everything)."""
    if chunk is None:
        return model(window, use_cache=False).logits
    cache, parts = None, []
    for start in range(0, window.shape[1], chunk):
        out = model(window[:, start : start + chunk], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        parts.append(out.logits)
    return torch.cat(parts, dim=1)


BeforeLast = Callable[[Any, torch.Tensor], None]  # (the cache so far or None, the last chunk's ids)


def prefill(
    model: Any, ids: torch.Tensor, chunk: int | None = None, before_last: BeforeLast | None = None, past: Any = None
) -> tuple[Any, torch.Tensor]:
    """``ids [b, n]`` into the model's own cache, ``chunk`` tokens per forward (None: one forward; chunks keep
    a long prompt's activations bounded, as engines' chunked prefill does) -> (cache, logits ``[b, 1, V]`` of
    the last position: only those are kept, a 262k vocabulary × 8K positions would be 8 GB). ``before_last``:
    called with the cache (None before a first forward) and the last chunk's ids before that chunk goes in.
    ``past``: a cache to go on from (None: a fresh one)."""
    cache, logits = past, None
    step = chunk or ids.shape[1]
    for start in range(0, ids.shape[1], step):
        if before_last is not None and start + step >= ids.shape[1]:
            before_last(cache, ids[:, start:])
        out = model(ids[:, start : start + step], past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache, logits = out.past_key_values, out.logits
    assert logits is not None, "prefill needs at least one token"
    return cache, logits


def scored_logits(
    model: Any,
    window: torch.Tensor,
    chunk: int | None,
    context: int | None,
    through_cache: bool = True,
    costs: WindowCosts | None = None,
    before_last: BeforeLast | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits ``[1, m, V]``, targets ``[1, m]``) of the tokens a window scores.

    Without ``context``: every token after the first (``window_logits``). With ``context`` (the
    context-compression protocol): the first ``context`` tokens go into the cache (in one forward, or
    ``chunk`` tokens at a time), the rest are scored in one forward through that cache;
    ``through_cache=False`` (a stock reference, for which the cache changes nothing) takes the same
    logits from one forward. ``costs`` receives the prefill's seconds and the window's peak memory;
    ``before_last`` goes to the context's ``prefill``."""
    if context is None:
        return window_logits(model, window, chunk)[:, :-1], window[:, 1:]
    targets = window[:, context:]
    if not through_cache:
        # only the scored positions' logits: all of them would be 8 GB for a 262k vocabulary at 8K tokens
        scored = window.shape[1] - context
        return model(window[:, :-1], use_cache=False, logits_to_keep=scored).logits[:, -scored:], targets
    device = model_device(model)
    with PeakMemory(device) as peak:
        synchronize(device)
        started = time.perf_counter()
        cache, last = prefill(model, window[:, :context], chunk, before_last)
        synchronize(device)
        seconds = time.perf_counter() - started
        rest = model(window[:, context:-1], past_key_values=cache, use_cache=True)
        logits = torch.cat([last[:, -1:], rest.logits], dim=1)
        del cache, rest
    if costs is not None:
        costs.add(seconds, context, peak.bytes)
    return logits, targets


class FixedReference:
    """A stock reference's scored logits on the windows of one text, computed once: a planner scores many
    candidates against the same source on the same windows (at 8K tokens each reference forward costs as
    much as a candidate's). Pass it to ``evaluate_quality`` as the reference."""

    @torch.no_grad()
    def __init__(self, model: Any, token_ids: torch.Tensor, ctx: int, context: int | None = None):
        self.logits = [
            scored_logits(model, w, None, context, False)[0] for w in _scored_windows(token_ids, ctx, context)
        ]


def _scored_windows(token_ids: torch.Tensor, ctx: int, context: int | None) -> list[torch.Tensor]:
    """The windows that score something: with ``context``, a trailing window without a continuation is dropped."""
    return [w for w in windows(token_ids, ctx) if context is None or w.shape[1] > context + 1]


@torch.no_grad()
def evaluate_quality(
    model: Any,
    token_ids: torch.Tensor,
    ctx: int,
    reference: Any | None = None,
    progress: bool = False,
    chunk: int | None = None,
    context: int | None = None,
    context_bytes: BeforeLast | None = None,
) -> QualityResult:
    """Score ``token_ids [n]`` window by window (only one window's logits are ever held).

    For every window ``w``: log-probs of ``w[1:]`` given ``w[:-1]`` from the model (fed ``chunk``
    tokens at a time when given; with ``context``, only the tokens after the first ``context``, read
    through the cache, see ``scored_logits``) and from the reference (a stock model: one forward, since
    feeding a full cache in chunks changes nothing but the time — except with ``context`` and ``chunk``
    together, where it goes through its cache the same way so that prefill time and peak memory are
    measured side by side); NLL, KL and argmax agreement are summed in float64. ``context_bytes``: the first
    window's ``before_last`` (``runner.ContextBytes``: the cache measured on the way).
    """
    nll = ref_nll = kl = 0.0
    agree = count = 0
    costs: dict[str, WindowCosts] = {}
    if context is not None:
        for loaded in (model, reference):
            if loaded is not None and not isinstance(
                loaded, FixedReference
            ):  # peak memory counts what scoring adds, not weights paged in on first use
                page_in(loaded)  # nor the one-off buffers of a first forward (thread pools, kernel caches)
                prefill(loaded, token_ids[None, :16].to(model_device(loaded)))
        costs["model"] = WindowCosts()
        if reference is not None and chunk is not None and not isinstance(reference, FixedReference):
            costs["reference"] = WindowCosts()
    scored = _scored_windows(token_ids, ctx, context)
    for index, window in enumerate(tqdm(scored, desc="eval", unit="window", disable=not progress)):
        logits, targets = scored_logits(model, window, chunk, context, costs=costs.get("model"),
                                        before_last=context_bytes if index == 0 else None)  # fmt: skip
        ref_logits = None
        if isinstance(reference, FixedReference):
            ref_logits = reference.logits[index]
        elif reference is not None:
            side_by_side = "reference" in costs
            ref_logits = scored_logits(reference, window, chunk if side_by_side else None, context, side_by_side,
                                       costs.get("reference"))[0]  # fmt: skip
        count += targets.numel()
        # float64 log-probs ROWS positions at a time: peak memory stays one window of logits in the model's dtype
        for start in range(0, targets.shape[1], ROWS):
            rows = slice(start, start + ROWS)
            target = targets[:, rows, None]
            logp = torch.log_softmax(logits[:, rows].double(), dim=-1)
            nll -= logp.gather(-1, target).sum().item()
            if ref_logits is not None:
                ref_logp = torch.log_softmax(ref_logits[:, rows].double(), dim=-1)
                ref_nll -= ref_logp.gather(-1, target).sum().item()
                kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
                agree += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
    if count == 0:
        raise ValueError("need at least 2 tokens to evaluate")
    result = QualityResult(tokens=count, ppl=math.exp(nll / count), costs=costs)
    if reference is not None:
        result.reference_ppl = math.exp(ref_nll / count)
        result.kl_mean = kl / count
        result.top1_agreement = agree / count
    return result
