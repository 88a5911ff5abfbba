"""Decode over the 4-bit token layout on a GPU: a Triton kernel that reads the layout's codes as stored (a CPU reads
them with torch's int4 kernel, ``kvconvert_tokenlayout``) and the decode steps that call it, for a growing cache and
a static one. Copied verbatim into every output directory; Triton is optional (see ``kvconvert_kernels``).
"""

from __future__ import annotations

from typing import Any

import torch

from .kvconvert_codec import channel_groups, rotation
from .kvconvert_folded import exact_partial, merge_partials, unrotated, value_rotation
from .kvconvert_kernels import (
    _pow2,
    _split_len,
    merged_splits,
    sixteen_bit_products,
    split_bounds,
    split_count,
    split_partials,
    triton,
)
from .kvconvert_staticstore import StaticTokenStore
from .kvconvert_tokenlayout import KERNEL_ROWS, StaticTokenLayoutStore, TokenLayoutStore
from .kvconvert_tokenstore import TokenStore, decode_columns

if triton is not None:
    import triton.language as tl

# ``token_decode_triton`` reads the token layout (``TokenLayoutStore``) packed as ``KERNEL_ROWS`` packs it, what a
# store picks wherever this kernel may read it (``kernel_rows_wanted``). Per (row, KV head):
# - keys: codes ``[n, d/2]`` in blocks of BLK tokens, each block ``[d, BLK/2]`` bytes (channel c's bytes together),
#   byte j of channel c holding tokens j (low nibble) and j + BLK/2 (high) (``halves``; else 2j and 2j + 1); each
#   token's ``(scale, zero)`` per channel group ``[G, n, 2]``; a per-channel mean per B tokens (``center``), rotated
#   per group of ``size`` channels. ``q·k = q·center + Σ_g (q·R)_g·((code − 8)·s_g + z_g)``: the kernel takes the
#   rotated query and ``q·center`` per block (``offsets``, one small product in torch), and reads each code once.
# - values: ``Vᵀ``'s rows per block of R channels, ``[d/R, n, R/2]`` (token t's R/2 bytes of block c together, byte j
#   holding channels j and j + R/2, or 2j and 2j + 1), ``scale``/``zero [G, n]`` per token and channel group, in the
#   same convention. The weighted sum comes out rotated (undone by the caller, on ``[b, H, d]``) with its columns in
#   the order the bytes hold them (``_unpermuted``). Or (``--kv-value-bits``) values per token in KIVI's packing,
#   2 or 4 bits, ``code·s + z`` per group of channels, rotated as ``--kv-rotate`` stored them (``_kivi_token_values``).
# A KV head's G query rows share every code they read (one ``tl.dot`` over the group's rows); a tile of NB blocks is
# read as its two nibble halves (no interleave), keys dequantized after the product (per token and group: scale and
# zero multiply the dot product), values before it (per element). Exact tokens (the sink, the float tail, this step's)
# are attended in torch and merged with the kernel's partial, as flash-decoding merges its splits.

# Tokens a program reads in one iteration (whole packing blocks) and its launch shape: the fastest summed over 16 × 8K
# and 1 × 32K of Llama-3-8B's attention among 3 tiles × 2 warp counts × 2 pipeline depths × 3 program counts, on an
# H200 (bench/kernel_sweep.py, bench/results/kernel-sweep-h200-token-2026-11-29.md).
TOKEN_TILE, TOKEN_WARPS, TOKEN_STAGES, TOKEN_PROGRAMS_PER_SM = 64, 4, 2, 16


if triton is not None:

    @triton.jit
    def _token_values(codes, scales, zeros, tokens, inside, sgg, svc, SIZE: tl.constexpr, D: tl.constexpr,
                      R: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
        """The values of ``tokens [T]`` (``inside``: below the stop) dequantized per element: ``[T, D]`` in ``dtype``,
        columns in the bytes' order (block c, byte j, nibble)."""
        blocks = tl.arange(0, D // R)
        pairs = tl.arange(0, R // 2)
        ok = inside[:, None, None]
        v = tl.load(codes + blocks[None, :, None] * svc + tokens[:, None, None] * (R // 2) + pairs[None, None, :],
                    mask=ok, other=0)  # [T, D/R, R/2]  # fmt: skip
        at = ((blocks * R) // SIZE)[None, :, None] * sgg + tokens[:, None, None]  # the block's channel group
        s = tl.load(scales + at, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(zeros + at, mask=ok, other=0.0).to(tl.float32)
        low = ((v & 15).to(tl.float32) - 8.0) * s + z
        high = ((v >> 4).to(tl.float32) - 8.0) * s + z
        return tl.reshape(tl.join(low, high), (tokens.shape[0], D)).to(dtype)

    @triton.jit
    def _kivi_token_values(codes, scales, zeros, tokens, inside, sgt, svt, D: tl.constexpr, GS: tl.constexpr,
                           VBITS: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
        """``--kv-value-bits`` values (KIVI's per-token packing: channel c of a token in bits (c mod 8/b)·b of its
        byte c·b/8, ``code·s + z`` per group of GS channels) of ``tokens [T]``: ``[T, D]`` in ``dtype``, channel
        order."""
        groups = tl.arange(0, D // GS)
        pieces = tl.arange(0, GS * VBITS // 8)
        ok = inside[:, None, None]
        v = tl.load(codes + tokens[:, None, None] * svt + groups[None, :, None] * (GS * VBITS // 8)
                    + pieces[None, None, :], mask=ok, other=0)  # [T, groups, bytes a group]  # fmt: skip
        at = tokens[:, None, None] * sgt + groups[None, :, None]
        s = tl.load(scales + at, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(zeros + at, mask=ok, other=0.0).to(tl.float32)
        if VBITS == 4:  # channels 2j and 2j + 1 of a byte j
            planes = tl.join(v & 15, v >> 4)
        else:  # 2 bits: channels 4j … 4j + 3, the lowest bits first (a join appends its axis last: [.., i, j] is
            # plane 2i + j)
            planes = tl.join(tl.join(v & 3, (v >> 4) & 3), tl.join((v >> 2) & 3, v >> 6))
        vals = tl.reshape(planes, (tokens.shape[0], D // GS, GS)).to(tl.float32) * s + z
        return tl.reshape(vals, (tokens.shape[0], D)).to(dtype)

    @triton.jit
    def _token_decode_kernel(
        query, offsets, key_codes, key_pairs, value_codes, value_scale, value_zero, bias, length, part_acc, part_ml,
        kv_heads, n, split_len,
        sqr, sor, sog, skr, spr, spg, svr, svc, svt, sgr, sgg, sgt, sbb, sar, sas, smr, sms,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, SIZE: tl.constexpr, BLK: tl.constexpr,
        NB: tl.constexpr, HALVES: tl.constexpr, CENTER: tl.constexpr, R: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_LENGTH: tl.constexpr, DOT: tl.constexpr, VBITS: tl.constexpr, GS: tl.constexpr,
    ):  # fmt: skip
        """Program (row × KV head r, split j): the G query rows of KV head r (``query``: scaled, rotated per key
        group; its dtype is the products') over the tokens of split j, NB packing blocks at a time. Writes the
        unnormalised weighted sum (rotated as the values are stored, columns in the bytes' order) and (max,
        denominator) per query row. ``HAS_LENGTH``: only the first ``length`` tokens (read on the device) are read.
        ``VBITS``: 0, values in the token layout; 2 or 4, in KIVI's per-token packing, groups of ``GS`` channels."""
        r = tl.program_id(0)
        split = tl.program_id(1)
        row = r // kv_heads
        start, stop = split_bounds(n, length, split_len, HAS_LENGTH)
        rows = tl.arange(0, G_PAD)
        live = rows < G
        blocks = tl.arange(0, NB)
        byte = tl.arange(0, BLK // 2)
        chans = tl.arange(0, SIZE)
        # the tokens of a tile's low nibbles, as offsets from its first token ([NB, BLK/2] -> [T]); the high ones'
        # are these + ``step``
        if HALVES:
            low = tl.reshape(blocks[:, None] * BLK + byte[None, :], (NB * (BLK // 2),))
            step = BLK // 2
        else:
            low = tl.reshape(blocks[:, None] * BLK + 2 * byte[None, :], (NB * (BLK // 2),))
            step = 1
        dtype = query.dtype.element_ty
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        codes_r, scales_r, zeros_r = value_codes + r * svr, value_scale + r * sgr, value_zero + r * sgr
        for first in range(start, stop, NB * BLK):
            t_lo = first + low
            t_hi = t_lo + step
            in_lo, in_hi = t_lo < stop, t_hi < stop
            in_blocks = (first + blocks * BLK < stop)[None, :, None]  # a block past the stop is never read
            s_lo = tl.zeros((G_PAD, NB * (BLK // 2)), tl.float32)
            s_hi = tl.zeros((G_PAD, NB * (BLK // 2)), tl.float32)
            for g in tl.static_range(D // SIZE):
                q = tl.load(query + r * sqr + rows[:, None] * D + g * SIZE + chans[None, :], mask=live[:, None],
                            other=0.0)  # fmt: skip
                q_sum = tl.sum(q.to(tl.float32), axis=1)[:, None]
                # [SIZE, NB, BLK/2]: channel c's bytes of each block (block base: BLK rows of d/2 bytes)
                at = (first + blocks * BLK)[None, :, None] * (D // 2) + (g * SIZE + chans)[:, None, None] * (BLK // 2)
                packed = tl.load(key_codes + r * skr + at + byte[None, None, :], mask=in_blocks, other=0)
                d_lo = tl.dot(q, tl.reshape(packed & 15, (SIZE, NB * (BLK // 2))).to(dtype), input_precision=DOT)
                d_hi = tl.dot(q, tl.reshape(packed >> 4, (SIZE, NB * (BLK // 2))).to(dtype), input_precision=DOT)
                pairs = key_pairs + r * spr + g * spg
                # (code − 8)·s + z per token: the dot of the codes, less 8·Σq, times s, plus z·Σq
                scale_lo = tl.load(pairs + 2 * t_lo, mask=in_lo, other=0.0).to(tl.float32)[None, :]
                zero_lo = tl.load(pairs + 2 * t_lo + 1, mask=in_lo, other=0.0).to(tl.float32)[None, :]
                scale_hi = tl.load(pairs + 2 * t_hi, mask=in_hi, other=0.0).to(tl.float32)[None, :]
                zero_hi = tl.load(pairs + 2 * t_hi + 1, mask=in_hi, other=0.0).to(tl.float32)[None, :]
                s_lo += (d_lo - 8.0 * q_sum) * scale_lo + q_sum * zero_lo
                s_hi += (d_hi - 8.0 * q_sum) * scale_hi + q_sum * zero_hi
            centers = offsets + r * sor + rows[:, None] * sog
            s_lo += tl.load(centers + (t_lo // CENTER)[None, :], mask=live[:, None] & in_lo[None, :], other=0.0)
            s_hi += tl.load(centers + (t_hi // CENTER)[None, :], mask=live[:, None] & in_hi[None, :], other=0.0)
            if HAS_BIAS:
                s_lo += tl.load(bias + row * sbb + t_lo, mask=in_lo, other=0.0)[None, :]
                s_hi += tl.load(bias + row * sbb + t_hi, mask=in_hi, other=0.0)[None, :]
            s_lo = tl.where(in_lo[None, :], s_lo, float("-inf"))
            s_hi = tl.where(in_hi[None, :], s_hi, float("-inf"))
            m_new = tl.maximum(m_i, tl.maximum(tl.max(s_lo, axis=1), tl.max(s_hi, axis=1)))
            alpha = tl.exp(m_i - m_new)
            p_lo = tl.exp(s_lo - m_new[:, None])
            p_hi = tl.exp(s_hi - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p_lo, axis=1) + tl.sum(p_hi, axis=1)
            if VBITS == 0:
                v_lo = _token_values(codes_r, scales_r, zeros_r, t_lo, in_lo, sgg, svc, SIZE, D, R, dtype)
                v_hi = _token_values(codes_r, scales_r, zeros_r, t_hi, in_hi, sgg, svc, SIZE, D, R, dtype)
            else:
                v_lo = _kivi_token_values(codes_r, scales_r, zeros_r, t_lo, in_lo, sgt, svt, D, GS, VBITS, dtype)
                v_hi = _kivi_token_values(codes_r, scales_r, zeros_r, t_hi, in_hi, sgt, svt, D, GS, VBITS, dtype)
            acc = acc * alpha[:, None] + tl.dot(p_lo.to(dtype), v_lo, input_precision=DOT)
            acc += tl.dot(p_hi.to(dtype), v_hi, input_precision=DOT)
            m_i = m_new
        out = part_acc + r * sar + split * sas + rows[:, None] * D
        tl.store(out + tl.arange(0, D)[None, :], acc, mask=live[:, None])
        ml = part_ml + r * smr + split * sms + rows * 2
        tl.store(ml, m_i, mask=live)
        tl.store(ml + 1, l_i, mask=live)


def _unpermuted(acc: torch.Tensor, block: int, halves: bool) -> torch.Tensor:
    """The kernel's sums ``[..., d]``, columns in the bytes' order (block c, byte j, nibble), in channel order."""
    if not halves:  # byte j of a block holds channels 2j and 2j + 1: the bytes' order is the channels'
        return acc
    return acc.unflatten(-1, (-1, block // 2, 2)).transpose(-1, -2).flatten(-3)


def token_decode_triton(
    query: torch.Tensor, offsets: torch.Tensor, key_codes: torch.Tensor, key_pairs: torch.Tensor,
    value_codes: torch.Tensor, value_scale: torch.Tensor, value_zero: torch.Tensor, bias: torch.Tensor | None,
    *, block: int, halves: bool, center: int, value_block: int, value_halves: bool, size: int, value_bits: int = 0,
    value_group: int = 0, length: torch.Tensor | None = None, splits: int | None = None, tile: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The partial ``(acc [b, Hkv, G, d], ml [b, Hkv, G, 2])`` float32 of the query rows over the quantized tokens
    of a token-layout cache (``Σ exp(s − m)·v`` rotated per value group, and (max, denominator)), in one launch of
    grid (rows × KV heads, token splits), the splits merged as ``combine_partials`` merges.

    ``query [b, Hkv, G, d]``: scaled and rotated per key group; float32 products in float32 (``ieee``), bfloat16 /
    float16 in their own dtype (float32 accumulation; under the interpreter float32). ``offsets [b, Hkv, G, n/B]``
    float32: ``q·center`` of each block of ``center`` tokens. The cache as ``TokenLayoutStore`` holds it (rows
    ``block``/``halves``, value rows ``value_block``/``value_halves``, channel groups of ``size``), possibly with room
    past ``n`` (a static cache's buffers); or (``value_bits`` 2 or 4: ``--kv-value-bits``) values per token in KIVI's
    packing (``codes [b, Hkv, n, ·]``, ``scale``/``zero [b, Hkv, n, groups]``, groups of ``value_group`` channels),
    their sum then in channel order. ``bias [b, n]`` additive or None. ``length`` (a 0-d tensor read on the device):
    only the first ``length`` tokens are read."""
    assert triton is not None, "Triton is not installed (pip install 'kvconvert[kernels]')"
    batch, kv_heads, group, dim = query.shape
    n = key_codes.shape[-2]
    low = query.dtype != torch.float32 and sixteen_bit_products(query)
    query = (query if low else query.float()).contiguous()
    assert key_codes.stride(-1) == 1 and key_codes.stride(-2) == dim // 2, "key codes: whole rows of d/2 bytes"
    assert key_pairs.stride(-1) == 1 and key_pairs.stride(-2) == 2 and n % block == 0 and dim % size == 0
    assert value_codes.stride(-1) == value_scale.stride(-1) == 1 and value_zero.stride() == value_scale.stride()
    if value_bits:  # token-major: a token's bytes, a token's group scales
        assert value_codes.shape[-2] >= n and value_codes.shape[-1] * 8 == dim * value_bits and dim % value_group == 0
    else:
        assert value_codes.stride(-2) == value_block // 2 and size % value_block == 0, (size, value_block)
    rows = batch * kv_heads
    flat = [t.flatten(0, 1) for t in (offsets.float().contiguous(), key_codes, key_pairs, value_codes, value_scale,
                                      value_zero)]  # fmt: skip
    offsets, key_codes, key_pairs, value_codes, value_scale, value_zero = flat
    tile_blocks = 1 << (max(1, (TOKEN_TILE if tile is None else tile) // block).bit_length() - 1)
    step = tile_blocks * block
    if splits is None:
        splits = split_count(rows, n // (4 * step), query.device, TOKEN_PROGRAMS_PER_SM)
    split_len = _split_len(n, rows, query.device, step, splits)
    n_splits = triton.cdiv(n, split_len)
    part_acc, part_ml = split_partials(rows, n_splits, group, dim, query.device)
    bias_t = bias.float().contiguous() if bias is not None else part_acc  # any pointer when HAS_BIAS is off
    _token_decode_kernel[(rows, n_splits)](
        query, offsets, key_codes, key_pairs, value_codes, value_scale, value_zero, bias_t,
        part_acc if length is None else length, part_acc, part_ml, kv_heads, n, split_len,
        group * dim, offsets.stride(0), offsets.stride(1), key_codes.stride(0), key_pairs.stride(0),
        key_pairs.stride(1), value_codes.stride(0), value_codes.stride(1), value_codes.stride(-2),
        value_scale.stride(0), value_scale.stride(1), value_scale.stride(-2), bias_t.stride(0), part_acc.stride(0),
        part_acc.stride(1), part_ml.stride(0), part_ml.stride(1),
        G=group, G_PAD=max(16, _pow2(group)), D=dim, SIZE=size, BLK=block, NB=tile_blocks, HALVES=halves,
        CENTER=center, R=value_block, HAS_BIAS=bias is not None, HAS_LENGTH=length is not None,
        DOT="ieee" if query.dtype == torch.float32 else "tf32", VBITS=value_bits, GS=value_group or size,
        num_warps=num_warps or TOKEN_WARPS, num_stages=num_stages or TOKEN_STAGES,
    )  # fmt: skip
    acc, ml = merged_splits(part_acc, part_ml, batch)
    return (acc if value_bits else _unpermuted(acc, value_block, value_halves)), ml


# --------------------------------------------------------------------------- decode steps


def _key_layout(keys: TokenLayoutStore) -> dict[str, Any]:
    """``token_decode_triton``'s key layout arguments for a token-layout store (a growing one, or a static one's
    codec)."""
    assert keys.rows is not None
    return dict(block=keys.rows.block, halves=keys.rows.halves, center=keys.quant.group, size=keys.group_size())


def _value_layout(values: Any, dim: int, device: torch.device) -> tuple[dict[str, Any], torch.Tensor | None]:
    """``token_decode_triton``'s value arguments for a value store (the token layout's, or ``--kv-value-bits``
    values per token in KIVI's packing: a ``TokenStore`` or ``StaticTokenStore``), and the rotation its sum comes out
    in (None: none)."""
    if isinstance(values, TokenLayoutStore):
        size = values.group_size()
        r = values._value_block(size)
        assert values.rows is not None
        return dict(value_block=r, value_halves=values.rows.halves and r == values.rows.block), rotation(size, device)
    size = channel_groups(dim, values.quant.group)[1]
    layout = dict(value_block=0, value_halves=False, value_bits=values.quant.bits, value_group=size)
    return layout, value_rotation(values, dim, device)


def _kivi_values_fit(values: Any, dim: int) -> bool:
    """``--kv-value-bits`` values the kernel reads: per token, 2 or 4 bits, channel groups of a power of two that
    cover the width (whole bytes a group)."""
    groups, size = channel_groups(dim, values.quant.group)
    whole = groups * size == dim and size & (size - 1) == 0 and groups & (groups - 1) == 0 and size >= 4
    return not values.per_channel and values.quant.bits in (2, 4) and whole


def token_kernel_reads(keys: TokenStore, values: TokenStore, dim: int) -> bool:
    """``token_decode_kernel`` reads these stores: keys in the token layout packed as the kernel reads
    (``KERNEL_ROWS``: each key block a whole number of packing blocks), at least one block quantized, values in the
    token layout packed alike or per token in KIVI's packing (``--kv-value-bits``, ``_kivi_values_fit``)."""
    if not (isinstance(keys, TokenLayoutStore) and keys.blocks is not None and keys.rows == KERNEL_ROWS):
        return False
    if type(values) is TokenLayoutStore:
        reads = values.rows == KERNEL_ROWS
    else:
        reads = not isinstance(values, TokenLayoutStore) and _kivi_values_fit(values, dim)
    return reads and keys.quant.group % KERNEL_ROWS.block == 0 and dim % 32 == 0


def static_token_kernel_reads(keys: StaticTokenStore, values: StaticTokenStore, dim: int) -> bool:
    """``static_token_kernel_decode`` reads these static stores (``token_kernel_reads``' conditions)."""
    if not (isinstance(keys, StaticTokenLayoutStore) and keys.codes is not None and keys.codec.rows == KERNEL_ROWS):
        return False
    if isinstance(values, StaticTokenLayoutStore):
        reads = values.codec.rows == KERNEL_ROWS
    else:
        reads = values.codes is not None and _kivi_values_fit(values, dim)
    return reads and keys.quant.group % KERNEL_ROWS.block == 0 and dim % 32 == 0


def _decode(
    query: torch.Tensor, scaling: float, keys: TokenLayoutStore, key_held: tuple[torch.Tensor, ...], values: Any,
    value_held: tuple[torch.Tensor, ...], bias_q: torch.Tensor | None,
    exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], length: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """One decode step ``[b, H, 1, d]`` float32: the kernel over the quantized tokens (``key_held``: codes, (scale,
    zero) pairs, block means; ``value_held``: codes, scales, zeros; ``keys``/``values``: the stores or codecs that say
    how they are laid out), merged with the exact tokens' softmax (``exact``: keys, values, bias)."""
    batch, heads, _, dim = query.shape
    size = keys.group_size()
    q = query.reshape(batch, exact[0].shape[1], -1, dim).float()  # [b, Hkv, G, d], unscaled
    # scaled, rotated per key group, in the query's dtype (what the kernel multiplies); q·mean of each block in torch
    q_rot = ((q * scaling).view(-1, size) @ rotation(size, query.device)).view_as(q).to(query.dtype)
    codes, pairs, center = key_held
    offsets = torch.einsum("bhgd,bhcd->bhgc", q * scaling, center.float())
    value_layout, back = _value_layout(values, dim, query.device)
    value_codes, value_scale, value_zero = value_held
    acc, ml = token_decode_triton(q_rot, offsets, codes, pairs, value_codes, value_scale, value_zero, bias_q,
                                  length=length, **_key_layout(keys), **value_layout)  # fmt: skip
    parts = [(acc if back is None else unrotated(acc, back), ml), exact_partial(q, *exact, scaling)]
    return merge_partials(parts).view(batch, heads, 1, dim)


def token_decode_kernel(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
    keys: TokenLayoutStore, values: TokenStore, scaling: float,
    extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """``kvconvert_quant.token_decode`` through the kernel (``token_kernel_reads``): the same arguments, the quantized
    tokens read by ``token_decode_triton``, the sink, tail, this step's and ``extra`` tokens attended exactly and
    merged. Returns ``[b, H, 1, d]`` float32."""
    kb, vb = keys.blocks, values.blocks
    assert kb is not None and kb.center is not None and vb is not None
    bias_q, exact_k, exact_v, exact_bias = decode_columns(bias, keys, values, key, value, extra)
    return _decode(query, scaling, keys, (kb.codes, kb.scale, kb.center), values, (vb.codes, vb.scale, vb.zero),
                   bias_q, (exact_k, exact_v, exact_bias))  # fmt: skip


def static_token_kernel_decode(
    query: torch.Tensor, scaling: float, keys: StaticTokenLayoutStore, values: StaticTokenStore,
    filled: torch.Tensor, columns: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> torch.Tensor:  # fmt: skip
    """One decode step ``[b, H, 1, d]`` float32 over static token-layout stores (``static_token_kernel_reads``),
    writing nothing: the kernel over the blocks quantized so far (every buffer's shape fixed, the count read on the
    device), merged with the exact part. ``columns``: ``static_columns``' bias and exact part for this step."""
    assert keys.codes is not None and keys.scale is not None and keys.center is not None
    assert values.codes is not None and values.scale is not None and values.zero is not None
    codec = values.codec if isinstance(values, StaticTokenLayoutStore) else values
    held = (values.codes, values.scale, values.zero)
    return _decode(query, scaling, keys.codec, (keys.codes, keys.scale, keys.center), codec, held, *columns,
                   length=keys.quantized_count(filled))  # fmt: skip
