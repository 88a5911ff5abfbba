"""Prefill and decode throughput, measured on the real model and cache."""

from __future__ import annotations

import time
from typing import Any

import torch

from kvconvert.devices import model_device, synchronize


@torch.no_grad()
def measure_speed(model: Any, context: int, new_tokens: int, seed: int = 0) -> dict[str, float]:
    """Prefill ``context`` random tokens, then greedy-decode ``new_tokens`` one at a time.

    Returns prefill and decode tokens/s (batch 1). One untimed warm-up step precedes decoding.
    """
    vocab, device = model.config.vocab_size, model_device(model)
    ids = torch.randint(3, vocab, (1, context), generator=torch.Generator().manual_seed(seed)).to(device)
    synchronize(device)
    start = time.perf_counter()
    out = model(ids, use_cache=True)
    synchronize(device)
    prefill = time.perf_counter() - start
    state = {"cache": out.past_key_values, "token": out.logits[:, -1:].argmax(-1)}
    _decode(model, state, 1)  # warm-up
    decode = _decode(model, state, new_tokens)
    return {"prefill_tokens_per_s": context / prefill, "decode_tokens_per_s": new_tokens / decode}


@torch.no_grad()
def _prefill(model: Any, ids: torch.Tensor, chunk: int | None = None) -> dict[str, Any]:
    """Feed ``ids`` into a fresh cache, ``chunk`` tokens per call (None: all at once). Chunks bound the
    runtimes' score matrices (``[b, H, chunk, n]``: 10 GB for one 16K-token call on SmolLM2)."""
    step, cache = chunk or ids.shape[1], None
    for start in range(0, ids.shape[1], step):
        out = model(ids[:, start : start + step], past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
    return {"cache": cache, "token": out.logits[:, -1:].argmax(-1)}


@torch.no_grad()
def _decode(model: Any, state: dict[str, Any], steps: int) -> float:
    """``steps`` greedy decode steps from ``state`` (cache and last token, updated); seconds taken."""
    cache, token, device = state["cache"], state["token"], model_device(model)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    synchronize(device)
    state["cache"], state["token"] = cache, token
    return time.perf_counter() - start


def side_by_side(
    models: dict[str, Any], context: int, steps: int = 32, rounds: int = 2, seed: int = 0, chunk: int | None = 2048
) -> dict[str, dict[str, float]]:
    """Decode speed of several models after the same ``context`` random tokens, measured in one process:
    each model prefills once (its own cache), then the models take turns decoding ``steps`` greedy
    tokens, ``rounds`` times, so that a slow spell of the machine hits all of them; the best round
    counts. ``chunk``: prefill that many tokens per call (bounds memory at long context; None: all at
    once). Returns, per model, decode tokens/s and the bytes its cache held after the prefill."""
    from kvconvert.eval.memory import cache_nbytes

    vocab = next(iter(models.values())).config.vocab_size
    ids = torch.randint(3, vocab, (1, context), generator=torch.Generator().manual_seed(seed))
    states, best = {}, {}
    for name, model in models.items():
        states[name] = _prefill(model, ids.to(model_device(model)), chunk)
        states[name]["bytes"] = cache_nbytes(states[name]["cache"])
        _decode(model, states[name], 1)  # warm-up step
        best[name] = float("inf")
    for _ in range(rounds):
        for name, model in models.items():
            best[name] = min(best[name], _decode(model, states[name], steps))
    return {name: {"decode_tokens_per_s": steps / best[name], "cache_bytes": states[name]["bytes"]} for name in models}
