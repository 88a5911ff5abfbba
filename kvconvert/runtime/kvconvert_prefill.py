"""Attention of a chunk of queries (a prefill) over a layer's past and present through SDPA's fused kernel, with the
mask transformers hands over turned into an additive bias a block of query rows at a time.

A prompt that goes into the cache in one forward (``generate``'s prefill) asks every query row's bias: whole, in
float32, ``[b, 1, n, n]`` is 256 MB at 8K tokens and 4 GB at 32K, and SDPA with any explicit mask also computes the
causal mask's upper half. The source model's SDPA takes ``is_causal`` there and holds no mask at all, so such a
bias made a converted checkpoint's prefill need more memory than its source's (SmolLM2-135M, one 8K prompt, peak over
the loaded model: source 585 MiB, razor 1,116, LoRC and ZACK ~600, measured with glibc returning freed blocks). Here
no padding and no past run ``is_causal`` (no bias), and every other mask becomes a bias ``BIAS_BYTES`` at a time.
Copied verbatim into every output directory; imports only torch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# The most bytes of float32 bias one SDPA call of a chunk takes (rows of queries × the keys × the batch): 64 MB is 512
# query rows over 32K keys at batch 1; SDPA reads every key for each block of its own (64-256 rows) anyway, so fewer
# rows a call cost no extra reads.
BIAS_BYTES = 1 << 26


def additive_mask(
    mask: torch.Tensor | None, q_len: int, kv_len: int, dtype: torch.dtype, device: torch.device,
    rows: slice | None = None, columns: torch.Tensor | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """Normalise whatever mask transformers built into a finite additive bias ``[b|1, 1, q, kv]``.

    transformers passes a boolean mask (True = attend), an additive float mask, or None when
    plain causal masking suffices. A finite minimum instead of -inf keeps rows that are fully
    masked (left-padding positions) NaN-free, so their garbage never poisons cached keys.
    ``rows``: only these of the ``q_len`` query rows; ``columns``: only these positions (an index), picked before the
    bias is widened to ``dtype`` (razor's windows: 26 ms a layer gathering float32 rows of 4K, 2 AMD EPYC cores).
    """
    minimum = torch.finfo(dtype).min
    start, stop, _ = (rows or slice(0, q_len)).indices(q_len)
    if mask is None:
        if q_len == 1 and columns is None:
            return None
        query_pos = torch.arange(start, stop, device=device)[:, None] + (kv_len - q_len)
        positions = torch.arange(kv_len, device=device) if columns is None else columns
        return torch.where(positions[None, :] <= query_pos, 0.0, minimum).to(dtype)[None, None]
    mask = mask[..., -q_len:, :kv_len][..., start:stop, :]
    if columns is not None:
        mask = mask.index_select(-1, columns)
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, minimum).to(dtype)
    return mask.to(dtype).clamp(min=minimum)


def last_row_valid(mask: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """Which of the ``kv_len`` positions the last query row sees ``[b|1, kv]`` (None: every one, no padding): the
    tokens a cache keeps, built from that row alone."""
    bias = additive_mask(mask, q_len, kv_len, torch.float32, device, rows=slice(q_len - 1, q_len))
    return None if bias is None else bias[:, 0, -1, :] == 0


def query_blocks(mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int) -> Iterator[slice]:
    """The query rows of a chunk in blocks whose float32 bias (``additive_mask(..., rows=block)``) stays within
    ``BIAS_BYTES``."""
    step = max(1, BIAS_BYTES // (4 * kv_len * (batch if mask is not None else 1)))
    for start in range(0, q_len, step):
        yield slice(start, min(start + step, q_len))


def chunk_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, scale: float,
    causal: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Attention of a chunk of queries ``[b, H, q, e]`` (a prefill) over keys ``[b, k|1, n, e]`` and values
    ``[b, k|1, n, v]`` with the additive ``bias [b|1, 1, q, n]`` (or ``causal``: q = n, no bias), through SDPA's fused
    kernel: the scores are never materialised (in float32 ``[b, H, q, n]``: 150 MB a layer for 512 queries over 8K
    tokens of SmolLM2), and on a CPU it runs several times faster than scores, softmax and product apart. A latent
    every head shares (one head) stands on either side, broadcast to the other's heads. Keys and values of different
    widths are padded with zeros to the wider (the same scores and sums): torch's CPU kernel takes only equal widths,
    else runs its unfused math. ``[b, H, q, v]``."""
    heads, width = max(keys.shape[1], values.shape[1]), max(keys.shape[-1], values.shape[-1])
    keys, values = keys.expand(-1, heads, -1, -1), values.expand(-1, heads, -1, -1)
    pad = torch.nn.functional.pad
    if keys.shape[-1] < width:
        query, keys = pad(query, (0, width - keys.shape[-1])), pad(keys, (0, width - keys.shape[-1]))
    wide = values if values.shape[-1] == width else pad(values, (0, width - values.shape[-1]))
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys, wide, attn_mask=bias, scale=scale, is_causal=causal, enable_gqa=heads != query.shape[1]
    )
    return out[..., : values.shape[-1]]


def prefill_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:  # fmt: skip
    """``chunk_attention`` under transformers' ``mask`` (``additive_mask``'s input), by ``query_blocks``: the bias is
    never built for more rows than ``BIAS_BYTES`` holds, and a prompt without padding or past takes none."""
    q_len, kv_len = query.shape[2], keys.shape[2]
    if mask is None and q_len == kv_len:
        return chunk_attention(query, keys, values, None, scale, causal=True)
    parts = [
        chunk_attention(query[:, :, rows], keys, values,
                        additive_mask(mask, q_len, kv_len, query.dtype, query.device, rows=rows), scale)
        for rows in query_blocks(mask, query.shape[0], q_len, kv_len)
    ]  # fmt: skip
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
