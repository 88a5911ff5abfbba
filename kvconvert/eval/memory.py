"""KV-cache bytes measured from the live cache objects, never from a formula.

Works for any transformers ``Cache`` (stock or kvconvert's): every tensor reachable from the
cache or its layers is counted once (shared storage is de-duplicated).
"""

from __future__ import annotations

import types
from typing import Any

import torch

# never followed: code, classes and modules (their attributes are not cache state)
_OPAQUE = (torch.nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def _tensors(obj: Any, visited: set[int]) -> list[torch.Tensor]:
    """Tensors held by ``obj``'s attributes, followed through lists, tuples, dicts and plain
    objects (a cache layer may keep its state in helper objects, or share it with another layer)."""
    if torch.is_tensor(obj):
        return [obj]
    if id(obj) in visited or isinstance(obj, _OPAQUE):
        return []
    visited.add(id(obj))
    if isinstance(obj, (list, tuple)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif hasattr(obj, "__dict__"):
        items = vars(obj).values()
    else:
        return []
    return [t for item in items for t in _tensors(item, visited)]


def cache_nbytes(cache: Any) -> int:
    """Bytes held by every tensor reachable from ``cache`` (its layers included)."""
    tensors = _tensors(cache, set())
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
