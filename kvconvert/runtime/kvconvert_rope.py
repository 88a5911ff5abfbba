"""RoPE on keys turned when read, for runtimes that cache them unturned (LoRC's rebuilt keys, slim's pre-RoPE keys,
ZACK's): transformers' rotate-half arithmetic in fewer passes, the channel pairs' layout that makes it one complex
product, and scores taken a piece of the cache at a time. Copied verbatim into every output directory; imports only
torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_major: bool = False) -> torch.Tensor:
    """Rotate the first ``r = cos.shape[-1]`` dims of every head (partial rotary leaves the rest).

    Shapes: x ``[b, h, n, dk]``, cos/sin ``[b|1, n, r]`` with ``r <= dk``. Same result as
    transformers' ``x·cos + rotate_half(x)·sin``, written as one product and two in-place half-width
    multiply-adds: ``rotate_half`` (a roll, i.e. a concatenation) would copy x once more and, on a
    CPU, cost 8× the arithmetic (measured on 16×4096×64). Slim and LoRC re-rotate every cached key
    at each step, so this is their decode's hot loop.

    ``x`` a token-major cache viewed per head (``[b, n, h, dk]`` transposed): by default rotated in its own
    layout and returned as the same kind of view (what a kernel reading token rows wants); ``head_major``
    writes a contiguous ``[b, h, n, dk]`` instead, which a score product ``q @ kᵀ`` reads as it is: rotating
    into it costs what rotating in place does, and the product no longer copies the keys per head first
    (a LoRC decode step at 8 rows × 1K tokens: 1.2 ms a layer instead of 2.2 on 2 cores).
    """
    if x.dim() == 4 and not x.is_contiguous() and _rows_token_major(x):
        writable = not (torch.compiler.is_compiling() or x.requires_grad or cos.requires_grad or sin.requires_grad)
        if head_major and cos.shape[-1] == x.shape[-1] and writable:  # out= takes neither dynamo nor autograd
            out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
            return _rotate(x, cos.unsqueeze(1), sin.unsqueeze(1), out=out)
        # rotated in its own layout ([b, n, h, dk]), where the elementwise passes run contiguously (3× faster
        # on a CPU than writing through the strided view)
        return _rotate(x.transpose(1, 2), cos.unsqueeze(2), sin.unsqueeze(2)).transpose(1, 2)
    return _rotate(x, cos.unsqueeze(1), sin.unsqueeze(1))


def rotary_pairs(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """cos/sin ``[b, n, r]`` as ``r/2`` complex numbers ``cos θ + i·sin θ``, one per channel pair ``(j, j + r/2)``, so
    that RoPE is one complex product over keys laid out in pairs (``pair_order``; ``rotate_pairs``); None where
    that does not express it: the halves' angles differ (a RoPE variant), the dtype has no complex form (half
    precision), or under ``torch.compile`` (inductor has no complex arithmetic)."""
    half = cos.shape[-1] // 2
    if torch.compiler.is_compiling() or cos.dtype not in (torch.float32, torch.float64) or cos.requires_grad:
        return None
    if not (torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])):
        return None
    return torch.complex(cos[..., :half].contiguous(), sin[..., :half].contiguous())


def pair_order(head_dim: int, rotated: int) -> torch.Tensor:
    """The channel order of one head that puts RoPE's pairs ``(j, j + rotated/2)`` side by side (then the
    channels RoPE leaves alone): a head's channels read in this order make ``rotate_pairs``' layout."""
    half = rotated // 2
    pairs = torch.stack([torch.arange(half), torch.arange(half, rotated)], dim=1).reshape(-1)
    return torch.cat([pairs, torch.arange(rotated, head_dim)])


def rotate_pairs(tokens: torch.Tensor, pairs: torch.Tensor, heads: int) -> torch.Tensor:
    """RoPE on keys whose channels are in ``pair_order``: ``tokens [b, n, heads·dk]`` times ``pairs [b|1, n, r/2]``
    (``rotary_pairs``), written head-major ``[b, heads, n, dk]`` for a score product. One complex product reads each
    key once, where ``apply_rotary`` runs three passes over it (a LoRC decode step at 4K tokens on a CPU: 0.17 ms
    a layer instead of 0.47)."""
    b, n, width = tokens.shape
    dk, r = width // heads, 2 * pairs.shape[-1]
    x = tokens.view(b, n, heads, dk)
    pairs_in = torch.view_as_complex(x[..., :r].unflatten(-1, (r // 2, 2))).transpose(1, 2)  # [b, heads, n, r/2]
    if tokens.requires_grad or pairs.requires_grad:  # out= takes no autograd
        turned = torch.view_as_real(pairs_in * pairs[:, None]).flatten(-2)
        return turned if r == dk else torch.cat([turned, x[..., r:].transpose(1, 2)], dim=-1)
    out = torch.empty(b, heads, n, dk, dtype=tokens.dtype, device=tokens.device)
    torch.mul(pairs_in, pairs[:, None], out=torch.view_as_complex(out[..., :r].unflatten(-1, (r // 2, 2))))
    if r < dk:
        out[..., r:] = x[..., r:].transpose(1, 2)
    return out


def to_pairs(x: torch.Tensor, heads: int, rotated: int) -> torch.Tensor:
    """``x [..., heads·dk]`` in the model's channel order -> each head's channels in ``pair_order(dk, rotated)``
    (a copy); ``from_pairs`` undoes it."""
    return _transposed_rotary(x, heads, (2, rotated // 2))


def from_pairs(x: torch.Tensor, heads: int, rotated: int) -> torch.Tensor:
    """``x [..., heads·dk]`` with each head's channels in ``pair_order(dk, rotated)`` -> the model's order."""
    return _transposed_rotary(x, heads, (rotated // 2, 2))


def _transposed_rotary(x: torch.Tensor, heads: int, grid: tuple[int, int]) -> torch.Tensor:
    """Each head's first ``grid[0]·grid[1]`` channels read as a ``grid`` matrix and written transposed, the rest
    as they are: ``(2, r/2)`` interleaves RoPE's two halves into pairs, ``(r/2, 2)`` splits them again."""
    *lead, width = x.shape
    per_head, rotated = x.reshape(*lead, heads, width // heads), grid[0] * grid[1]
    turned = per_head[..., :rotated].unflatten(-1, grid).transpose(-1, -2).flatten(-2)
    if rotated < per_head.shape[-1]:
        turned = torch.cat([turned, per_head[..., rotated:]], dim=-1)
    return turned.reshape(*lead, width)


def rotate_in_pairs(
    tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, pairs: torch.Tensor | None = None
) -> torch.Tensor:
    """RoPE on ``tokens [b, n, heads·dk]`` whose channels are in ``pair_order`` (cos/sin ``[b|1, n, r]`` as the
    model's rotary gives them), written head-major ``[b, heads, n, dk]``: ``rotate_pairs`` where ``pairs``
    (``rotary_pairs``) expresses it, else the same rotate-half arithmetic on the interleaved channels (half
    precision, ``torch.compile``, a RoPE variant whose halves' angles differ)."""
    if pairs is not None:
        return rotate_pairs(tokens, pairs, heads)
    b, n, width = tokens.shape
    x = tokens.view(b, n, heads, width // heads).transpose(1, 2)
    r = cos.shape[-1]
    half = r // 2
    low, high = x[..., 0:r:2], x[..., 1:r:2]
    cos_low, cos_high, sin_low, sin_high = (t.unsqueeze(1) for t in (cos[..., :half], cos[..., half:],
                                                                       sin[..., :half], sin[..., half:]))  # fmt: skip
    turned = torch.stack([low * cos_low - high * sin_low, high * cos_high + low * sin_high], dim=-1).flatten(-2)
    return turned if r == x.shape[-1] else torch.cat([turned, x[..., r:]], dim=-1)


def _rows_token_major(x: torch.Tensor) -> bool:
    """``x [b, h, n, dk]`` is a ``[b, n, h·dk]`` tensor viewed per head, each row contiguous: the rows may lie apart
    (a latent store's rows are the fronts of one buffer with room to grow: ``TokenStore._grown``)."""
    _, h, n, dk = x.shape
    return x.stride(3) == 1 and x.stride(1) == dk and (x.stride(2) == h * dk or n == 1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``apply_rotary`` with cos/sin already broadcastable to ``x[..., :r]``; ``out`` (full rotary only): where the
    result is written."""
    r = cos.shape[-1]
    half = r // 2
    rotated = x if r == x.shape[-1] else x[..., :r]
    out = rotated * cos if out is None else torch.mul(rotated, cos, out=out)
    out[..., :half].addcmul_(rotated[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(rotated[..., :half], sin[..., half:])
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)


# A decode step that turns (LoRC: rebuilds, then turns) every cached key takes them about this many bytes (float32) at a
# time (``scores_by_piece``). Measured on 2 AMD EPYC cores, a layer's rebuild + RoPE + scores of LoRC 0.5 on SmolLM2:
# 8 rows × 4K 5.9 ms whole, 4.1 in 3 MB pieces (glibc's default allocator: 17 against 4), 16 × 8K 20 against 16;
# slim's RoPE + scores (16 heads of 64) at 1 × 4K 1.40 against 1.00, 8 × 4K 13.1 against 11.8; one piece (the same)
# at 1 × 4K for LoRC and 8 × 1K for both.
KEY_PIECE_BYTES = 3 << 20


def scores_by_piece(
    query: torch.Tensor, length: int, width: int, keys: Callable[[int, int], torch.Tensor]
) -> torch.Tensor:  # fmt: skip
    """``query [b, H', m, dk] @ kᵀ`` over ``length`` cached tokens whose keys ``keys(start, stop)`` gives head-major
    (``[b, H', stop − start, dk]``, ``width`` float32 channels a token and row), a piece of about ``KEY_PIECE_BYTES``
    at a time: each piece is scored while still in the CPU's caches, where keys turned all at once (25 MB a layer at
    8 rows × 4K of SmolLM2's LoRC) go out to memory and are read back. The same products for every token. On a CPU
    only: elsewhere each piece would be launches of their own (16 rows × 8K in 3 MB: 32 pieces a layer)."""
    step = max(1, KEY_PIECE_BYTES // (4 * query.shape[0] * width)) if query.device.type == "cpu" else max(length, 1)
    parts = [query @ keys(at, min(at + step, length)).transpose(-1, -2) for at in range(0, length, step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def turns_on_query_side(keys: torch.Tensor, q_len: int) -> bool:
    """Whether a step scores its unturned keys by ``turned_scores``: one query a row, compiled for a CPU."""
    return q_len == 1 and keys.device.type == "cpu" and torch.compiler.is_compiling()


def turned_scores(query: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  paired: bool) -> torch.Tensor:  # fmt: skip
    """Scores of one turned query per head ``[b, H, 1, dk]`` against keys cached unturned ``[b, n, Hk·dk]`` (``H`` a
    multiple of ``Hk``: a GQA group reads its KV head), turned by rotate-half RoPE ``cos/sin [b|1, n, r]`` (channels
    past ``r`` left as they are), each head's channels in the model's order or, ``paired``, in ``pair_order``:
    ``[b, H, 1, n]``, the same sums as ``query @ turn(keys)ᵀ``. RoPE moves onto the query side: the key channel ``c``
    meets ``q_c·cos_c − rotate_half(q)_c·sin'_c`` (``sin'``: the angle of the channel it is turned with, the halves of
    ``sin`` swapped), one multiply-and-sum over each key that never writes a turned copy. For ``torch.compile`` on a
    CPU, where inductor fuses it into one pass over the cache (slim's 16 heads of 64 at 4K: 0.38 ms where turning
    and then scoring takes 1.76, AMD EPYC); eagerly the coefficients would be a tensor as large as the keys."""
    b, heads, _, dk = query.shape
    n, kv_heads, r = keys.shape[1], keys.shape[-1] // dk, cos.shape[-1]
    half = r // 2
    q = query.reshape(b, kv_heads, heads // kv_heads, dk)  # the query heads of a group side by side
    turned = q[..., :r]
    if paired:  # channel 2j is the model's j, 2j + 1 its partner j + r/2
        swapped = torch.stack([turned[..., 1::2], -turned[..., 0::2]], dim=-1).flatten(-2)
        cos_c = torch.stack([cos[..., :half], cos[..., half:]], dim=-1).flatten(-2)
        sin_c = torch.stack([sin[..., half:], sin[..., :half]], dim=-1).flatten(-2)
    else:
        swapped = torch.cat([turned[..., half:], -turned[..., :half]], dim=-1)
        cos_c, sin_c = cos, torch.cat([sin[..., half:], sin[..., :half]], dim=-1)
    if r < dk:  # partial rotary: the rest of each key meets the query as it is
        swapped = torch.nn.functional.pad(swapped, (0, dk - r))
        cos_c = torch.nn.functional.pad(cos_c, (0, dk - r), value=1.0)
        sin_c = torch.nn.functional.pad(sin_c, (0, dk - r))
    cos_c, sin_c = cos_c[:, :, None, None], sin_c[:, :, None, None]  # [b|1, n, 1, 1, dk]
    coefficients = q[:, None] * cos_c + swapped[:, None] * sin_c  # [b, n, Hk, G, dk], fused away when compiled
    scores = (keys.view(b, n, kv_heads, 1, dk) * coefficients).sum(-1)  # [b, n, Hk, G]
    return scores.permute(0, 2, 3, 1).reshape(b, heads, 1, n)
