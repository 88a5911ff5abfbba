"""Prefill and decode throughput, measured on the real model and cache."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from kvconvert.devices import model_device, synchronize

# The attention ``packed_decode`` gives a source: transformers' SDPA, but a decode step's query heads always packed per
# KV head. Without a mask (batch 1, rows unpadded) transformers passes ``enable_gqa=True`` instead, and torch's CPU
# kernel takes that 5-6× slower in bfloat16 (one layer of SmolLM2's heads at 1 × 4K: 2.17 against 0.37 ms; float32
# 0.28 against 0.30, 2 AMD EPYC cores): a converted checkpoint timed against it would be flattered.
PACKED_DECODE = "sdpa_packed_decode"


@contextlib.contextmanager
def readers_built() -> Iterator[None]:
    """Decode speed as a long-running process reaches it: kvconvert's compiled CPU readers built at their first call
    (``KVCONVERT_COMPILE=on``, the warm-up step paying the build), where ``auto``, the default, builds them only after
    minutes of decoding and a timed run of a few steps would measure the eager ops. A setting the user chose stays."""
    chosen = os.environ.get("KVCONVERT_COMPILE")
    if chosen is None:
        os.environ["KVCONVERT_COMPILE"] = "on"
    try:
        yield
    finally:
        if chosen is None:
            os.environ.pop("KVCONVERT_COMPILE", None)


@torch.no_grad()
@readers_built()
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


def ragged_batch(vocab: int, context: int, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` rows of random tokens, left-padded to ``context``: row i holds ``context − i·context/(2·batch)``
    tokens (the longest is ``context``, the shortest a little over half), as a server's batch of requests of
    different lengths. Returns (ids, attention mask) ``[batch, context]``."""
    ids = torch.randint(3, vocab, (batch, context), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : row * context // (2 * batch)] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _packed_decode_sdpa(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' ``sdpa_attention_forward``, a one-token step's G query heads of each KV head stacked as G query
    rows of that head (``[b, Hkv, G, d]``; what transformers does itself under a mask): each KV head read once."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or kwargs.get("position_bias") is not None or kwargs.get("softcap"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    batch, heads, _, dim = query.shape
    stacked = query.reshape(batch, heads // groups, groups, dim)  # the mask [b|1, 1, 1, n] broadcasts over the rows
    out = torch.nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=attention_mask,
                                                           scale=kwargs.get("scaling"))  # fmt: skip
    return out.reshape(batch, heads, 1, -1).transpose(1, 2).contiguous(), None


def packed_decode(model: Any) -> Any:
    """``model`` (a transformers model on SDPA) set to decode through ``PACKED_DECODE``: the fastest its own attention
    runs a step on a CPU, the reference a converted checkpoint is also timed against (``side_by_side``). Returned."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_DECODE, _packed_decode_sdpa)
    AttentionMaskInterface.register(PACKED_DECODE, sdpa_mask)
    model.set_attn_implementation(PACKED_DECODE)
    return model


@contextlib.contextmanager
def timed_packed(model: Any) -> Iterator[Any]:
    """``model`` through ``packed_decode`` inside the block where it runs on transformers' SDPA on a CPU, its own
    attention again after: ``kvconvert eval`` times its reference so, against the source at its fastest, not against
    the slower unmasked path of batch 1 (measured on CPUs only: a GPU's kernels take ``enable_gqa`` natively). None
    (no reference): nothing to do."""
    before = None if model is None else getattr(model.config, "_attn_implementation", None)
    if before != "sdpa" or model_device(model).type != "cpu":
        yield model
        return
    packed_decode(model)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


@torch.no_grad()
def _prefill(
    model: Any, ids: torch.Tensor, chunk: int | None = None, mask: torch.Tensor | None = None,
    static_length: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Feed ``ids`` into a fresh cache, ``chunk`` tokens per call (None: all at once). Chunks bound the
    runtimes' score matrices (``[b, H, chunk, n]``: 10 GB for one 16K-token call on SmolLM2). ``mask``:
    left padding, positions counting the real tokens only as ``generate`` counts them (then kept in the
    state for the decode steps). ``static_length``: start from an empty static cache of that many tokens, as
    ``generate(cache_implementation="static")`` does (a kvconvert checkpoint swaps in its own)."""
    from transformers import StaticCache

    padded: dict[str, Any] = {}
    step = chunk or ids.shape[1]
    cache = None if static_length is None else StaticCache(config=model.config, max_cache_len=static_length)
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    for start in range(0, ids.shape[1], step):
        end = start + step
        if mask is not None and positions is not None:
            padded = {"attention_mask": mask[:, :end], "position_ids": positions[:, start:end]}
        out = model(ids[:, start:end], past_key_values=cache, use_cache=True, logits_to_keep=1, **padded)
        cache = out.past_key_values
    state = {"cache": cache, "token": out.logits[:, -1:].argmax(-1)}
    if mask is not None and positions is not None:
        state.update(mask=mask, next=positions[:, -1:] + 1)
    return state


@torch.no_grad()
def _decode(model: Any, state: dict[str, Any], steps: int) -> float:
    """``steps`` greedy decode steps from ``state`` (cache and last token; with left padding the mask and
    the next positions; all updated); seconds taken."""
    cache, token, device = state["cache"], state["token"], model_device(model)
    mask, position = state.get("mask"), state.get("next")
    forward = state.get("forward", model)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        padded: dict[str, Any] = {}
        if mask is not None and position is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            padded = {"attention_mask": mask, "position_ids": position}
            position = position + 1
        out = forward(token, past_key_values=cache, use_cache=True, **padded)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    synchronize(device)
    state["cache"], state["token"] = cache, token
    if mask is not None:
        state["mask"], state["next"] = mask, position
    return time.perf_counter() - start


@readers_built()
def side_by_side(
    models: dict[str, Any],
    context: int,
    steps: int = 32,
    rounds: int = 2,
    seed: int = 0,
    chunk: int | None = 2048,
    batch: int = 1,
    compiled: bool = False,
    static: bool = False,
    capacity: float | None = None,
) -> dict[str, dict[str, float]]:
    """Decode speed of several models after the same ``context`` random tokens, measured in one process:
    each model prefills once (its own cache), then the models take turns decoding ``steps`` greedy
    tokens, ``rounds`` times, so that a slow spell of the machine hits all of them; the best round
    counts. ``chunk``: prefill that many tokens per call (bounds memory at long context; None: all at
    once). ``batch`` > 1: that many left-padded rows of different lengths (``ragged_batch``), decoded
    together. ``compiled``: each model decodes from a static cache (what ``generate(cache_implementation=
    "static")`` makes, sized for the whole run) through ``torch.compile(forward, fullgraph=True)``, batch 1 only;
    a model whose cache is not static (its method has none yet) gets no figure; ``static``: the same caches, decoded
    eagerly (``generate(cache_implementation="static")`` without a compile); ``capacity``: static caches hold that
    many times ``context`` tokens (as ``generate`` sizes them for its new tokens; default: just the run's). Returns,
    per model, decode tokens/s (all rows) and the bytes its cache held after the prefill."""
    from kvconvert.eval.memory import cache_nbytes

    if (compiled or static) and batch != 1:
        raise ValueError("static caches are measured at batch 1 (a growing padding mask would recompile each step)")
    vocab = next(iter(models.values())).config.vocab_size
    ids, mask = ragged_batch(vocab, context, batch, seed)
    states, best = {}, {}
    for name, model in models.items():
        device = model_device(model)
        # batch 1 has no padding: no mask, positions implied (the plain decode loop users write)
        length = context + (rounds + 1) * steps + 2 if compiled or static else None
        length = max(length, int(capacity * context)) if length and capacity else length
        state = _prefill(model, ids.to(device), chunk, mask.to(device) if batch > 1 else None, length)
        if length and not state["cache"].is_compileable:
            continue
        state["bytes"] = cache_nbytes(state["cache"])
        if compiled:
            state["forward"] = torch.compile(model.forward, fullgraph=True, dynamic=False)
        _decode(model, state, 2 if compiled else 1)  # warm-up (compiled: the graph is built here)
        states[name], best[name] = state, float("inf")
    if compiled:  # measured: the first steps of each graph after another model's compile run up to 100× slower
        for name in states:
            _decode(models[name], states[name], steps)
    for _ in range(rounds):
        for name in states:
            best[name] = min(best[name], _decode(models[name], states[name], steps))
    return {name: {"decode_tokens_per_s": batch * steps / best[name], "cache_bytes": states[name]["bytes"]}
            for name in states}  # fmt: skip
