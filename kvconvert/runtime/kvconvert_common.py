"""Shared runtime pieces: RoPE application, attention masks, cache byte accounting.

Copied verbatim into every kvconvert output directory; imports only torch.
"""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``r = cos.shape[-1]`` dims of every head (partial rotary leaves the rest).

    Shapes: x ``[b, h, n, dk]``, cos/sin ``[b|1, n, r]`` with ``r <= dk``. Same result as
    transformers' ``x·cos + rotate_half(x)·sin``, in three passes over x instead of five:
    ``rotate_half(x) = roll(x)`` with the first half negated, and the sign goes on the small
    sin table rather than on x. (Slim re-rotates every cached key at each step, so this matters.)
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    half = r // 2
    rotated = x if r == x.shape[-1] else x[..., :r]
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    out = rotated * cos
    out.addcmul_(rotated.roll(half, dims=-1), signed_sin)
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)


def additive_mask(
    mask: torch.Tensor | None, q_len: int, kv_len: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """Normalise whatever mask transformers built into a finite additive bias ``[b|1, 1, q, kv]``.

    transformers passes a boolean mask (True = attend), an additive float mask, or None when
    plain causal masking suffices. A finite minimum instead of -inf keeps rows that are fully
    masked (left-padding positions) NaN-free, so their garbage never poisons cached keys.
    """
    minimum = torch.finfo(dtype).min
    if mask is None:
        if q_len == 1:
            return None
        query_pos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
        allowed = torch.arange(kv_len, device=device)[None, :] <= query_pos
        return torch.where(allowed, 0.0, minimum).to(dtype)[None, None]
    mask = mask[..., -q_len:, :kv_len]
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, minimum).to(dtype)
    return mask.to(dtype).clamp(min=minimum)


def softmax_rows(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the last dim in float32 (half-precision softmax loses mass), cast back."""
    return torch.softmax(scores.float(), dim=-1).to(dtype)
