"""Prefill and decode throughput, measured on the real model and cache."""

from __future__ import annotations

import time
from typing import Any

import torch


@torch.no_grad()
def measure_speed(model: Any, context: int, new_tokens: int, seed: int = 0) -> dict[str, float]:
    """Prefill ``context`` random tokens, then greedy-decode ``new_tokens`` one at a time.

    Returns prefill and decode tokens/s (batch 1). One untimed warm-up step precedes decoding.
    """
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, context), generator=torch.Generator().manual_seed(seed))
    start = time.perf_counter()
    out = model(ids, use_cache=True)
    prefill = time.perf_counter() - start
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    out = model(token, past_key_values=cache, use_cache=True)  # warm-up
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(new_tokens):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    decode = time.perf_counter() - start
    return {"prefill_tokens_per_s": context / prefill, "decode_tokens_per_s": new_tokens / decode}
