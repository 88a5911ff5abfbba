"""KV-cache bytes measured from the live cache objects, never from a formula.

Works for any transformers ``Cache`` (stock or kvconvert's): every tensor reachable from the
cache or its layers is counted once (shared storage is de-duplicated).
"""

from __future__ import annotations

from typing import Any

import torch


def _tensors(obj: Any) -> list[torch.Tensor]:
    found = []
    for value in vars(obj).values():
        if torch.is_tensor(value):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if torch.is_tensor(v))
        elif isinstance(value, dict):
            found.extend(v for v in value.values() if torch.is_tensor(v))
    return found


def cache_nbytes(cache: Any) -> int:
    """Bytes held by the tensors of ``cache`` and of each of its ``layers``."""
    tensors = _tensors(cache)
    for layer in getattr(cache, "layers", []):
        tensors.extend(_tensors(layer))
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.numel() == 0 or key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


@torch.no_grad()
def kv_bytes_per_token(model: Any, input_ids: torch.Tensor, short: int, long: int) -> float:
    """Growth of cache bytes per token (per sequence) between prefixes of ``short`` and ``long`` tokens.

    Measuring growth cancels fixed overheads, so the number is what each extra token costs.
    ``input_ids``: ``[b, >= long]``.
    """
    if not 0 < short < long <= input_ids.shape[1]:
        raise ValueError(f"need 0 < short < long <= {input_ids.shape[1]}, got {short}, {long}")
    sizes = []
    for length in (short, long):
        out = model(input_ids[:, :length], use_cache=True)
        sizes.append(cache_nbytes(out.past_key_values))
    return (sizes[1] - sizes[0]) / (long - short) / input_ids.shape[0]
