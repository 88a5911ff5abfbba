"""Decode over quantized storage in KIVI's layout: a Triton kernel that reads 4-bit codes as stored and its plain-torch
reference (the torch reader a CPU decodes with: ``kvconvert_folded``). Copied verbatim into every output directory;
Triton is optional (see ``kvconvert_kernels``).
"""

from __future__ import annotations

import math

import torch

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

if triton is not None:
    import triton.language as tl

# ``kivi_decode`` reads a 4-bit cache in KIVI's layout as it is stored (``kvconvert_codec``): keys per channel, in
# blocks of B tokens (``key_codes [b, Hkv, nb, d, B/2]``: channel c's B codes two per byte, token 2j in the low
# nibble; ``key_scale/zero [b, Hkv, nb, d]``), values per token (``value_codes [b, Hkv, n, P]``: channels 2i and
# 2i + 1 in byte i; ``value_scale/zero [b, Hkv, n, groups]``, channel c in group c // size). A KV head's G query
# rows share every code they read (one ``tl.dot`` over the group's rows), keys are dequantized per block with its
# channel scales, values per token, and nothing of the cache is ever written back in float. The exact parts of the
# cache (sink copies, recent tokens, this step's token) are few: the caller attends to them in torch and merges
# with the kernel's partial result (``merge_partials``), as flash-decoding merges its splits (the torch reader,
# ``kivi_decode_folded``, takes them into its own softmax instead).


def kivi_decode_reference(
    query: torch.Tensor, key_codes: torch.Tensor, key_scale: torch.Tensor, key_zero: torch.Tensor,
    value_codes: torch.Tensor, value_scale: torch.Tensor, value_zero: torch.Tensor, bias: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``query [b, Hkv, G, d]``, the cache as above (4-bit), ``bias [b, n]`` additive or None. Returns the
    unnormalised partial ``(acc [b, Hkv, G, d], ml [b, Hkv, G, 2])``: ``acc = Σ exp(s − m)·v`` with ``m`` the
    largest score and ``l = Σ exp(s − m)``. Plain torch: every code unpacked and dequantized, then attention."""
    batch, kv_heads, blocks, dim, half = key_codes.shape
    block, n = 2 * half, value_codes.shape[2]
    nibbles = torch.stack([key_codes & 15, key_codes >> 4], dim=-1).flatten(-2).float()  # [b, Hkv, nb, d, B]
    keys = nibbles * key_scale.float()[..., None] + key_zero.float()[..., None]
    keys = keys.transpose(-1, -2).reshape(batch, kv_heads, blocks * block, dim)  # [b, Hkv, n, d]
    codes = torch.stack([value_codes & 15, value_codes >> 4], dim=-1).flatten(-2)[..., :dim].float()
    size = math.ceil(dim / value_scale.shape[-1])
    group = torch.arange(dim, device=query.device) // size
    values = codes * value_scale.float()[..., group] + value_zero.float()[..., group]  # [b, Hkv, n, d]
    scores = torch.einsum("bhgd,bhnd->bhgn", query.float(), keys[:, :, :n]) * scale
    if bias is not None:
        scores = scores + bias.float()[:, None, None, :]
    m = scores.amax(-1)
    p = torch.exp(scores - m[..., None])
    acc = torch.einsum("bhgn,bhnd->bhgd", p, values)
    return acc, torch.stack([m, p.sum(-1)], dim=-1)


def kivi_kernel_fits(bits: int, block: int, dim: int) -> bool:
    """What ``kivi_decode_triton`` reads: 4-bit codes, blocks of a power of two ≥ 32 tokens (each half a
    ``tl.dot`` operand of ≥ 16) and heads of a power-of-two width ≥ 32."""
    return bits == 4 and all(x >= 32 and x & (x - 1) == 0 for x in (block, dim))


if triton is not None:

    @triton.jit
    def _kivi_values(codes, scales, zeros, tokens, p, halves, n, size, svn, sgn, DOT: tl.constexpr,
                     MAGIC: tl.constexpr):  # fmt: skip
        """``p [G_PAD, T]`` times the values of ``tokens [T]`` (dequantized per token and channel group), as
        the even channels' and the odd channels' sums ``[G_PAD, D/2]`` each."""
        inside = (tokens < n)[:, None]
        v = tl.load(codes + tokens[:, None] * svn + halves[None, :], mask=inside, other=0)
        g_lo = (2 * halves // size)[None, :]
        g_hi = ((2 * halves + 1) // size)[None, :]
        rows_s, rows_z = scales + tokens[:, None] * sgn, zeros + tokens[:, None] * sgn
        v_lo = _widened(v & 15, MAGIC) * tl.load(rows_s + g_lo, mask=inside, other=0.0).to(tl.float32)
        v_lo += tl.load(rows_z + g_lo, mask=inside, other=0.0).to(tl.float32)
        v_hi = _widened(v >> 4, MAGIC) * tl.load(rows_s + g_hi, mask=inside, other=0.0).to(tl.float32)
        v_hi += tl.load(rows_z + g_hi, mask=inside, other=0.0).to(tl.float32)
        return tl.dot(p, v_lo.to(p.dtype), input_precision=DOT), tl.dot(p, v_hi.to(p.dtype), input_precision=DOT)

    @triton.jit
    def _widened(codes, MAGIC: tl.constexpr):
        """Codes 0-15 (uint8) as float32: converted, or (``MAGIC``) their bits put under 2^23's exponent and 2^23
        taken away, exactly (an integer OR and a float subtraction: the CUDA guide lists integer-to-float conversion at
        a fraction of the float instructions' throughput)."""
        if MAGIC:
            return (codes.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        return codes.to(tl.float32)

    @triton.jit
    def _tile_scores(q, k, tokens, stop, bias_row, scale, HAS_BIAS: tl.constexpr, DOT: tl.constexpr):
        """``q [G_PAD, D]`` against keys ``k [D, T]`` of ``tokens [T]``: scaled scores, biased, -inf past ``stop``."""
        s = (tl.dot(q, k, input_precision=DOT) * scale).to(tl.float32)  # (Inductor's float args are float64)
        inside = tokens < stop
        if HAS_BIAS:
            s += tl.load(bias_row + tokens, mask=inside, other=0.0)[None, :]
        return tl.where(inside[None, :], s, float("-inf"))

    @triton.jit
    def _kivi_decode_kernel(
        query, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero, bias, length, part_acc, part_ml,
        kv_heads, n, blocks_per_split, scale, size,
        sqr, skr, skb, skd, ssr, ssb, svr, svn, sgr, sgn, sbb, spr, sps, smr, sms,
        G: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr, G_PAD: tl.constexpr,
        D_HALF: tl.constexpr, DOT: tl.constexpr, HAS_LENGTH: tl.constexpr,
    ):  # fmt: skip
        """Program (row × KV head r, split j): the G query rows of KV head r over the blocks of split j, two
        half-blocks at a time (even and odd tokens: the two nibbles of a key byte), each value's even and odd
        channels (the two nibbles of a value byte) accumulated apart. Writes unnormalised sums, channel
        2i + parity at column 2i + parity, and (max, denominator) per query row. ``DOT``: the products' precision,
        ``ieee`` (float32, as a float32 model computes) or ``tf32`` (tensor cores, for half-precision models:
        still finer than their own bfloat16 / float16 products). ``HAS_LENGTH``: only the first ``length`` tokens
        (read on the device) are read."""
        r = tl.program_id(0)
        split = tl.program_id(1)
        row = r // kv_heads
        heads = tl.arange(0, G_PAD)
        chans = tl.arange(0, D)
        halves = tl.arange(0, D_HALF)
        live = heads < G
        q = tl.load(query + r * sqr + heads[:, None] * D + chans[None, :], mask=live[:, None], other=0.0)
        q = (q.to(tl.float32) * scale).to(tl.float32)  # (Inductor passes a float argument as float64)
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc_lo = tl.zeros((G_PAD, D_HALF), tl.float32)
        acc_hi = tl.zeros((G_PAD, D_HALF), tl.float32)
        pairs = tl.arange(0, HALF)
        if HAS_LENGTH:
            n = tl.minimum(n, tl.load(length))
        first = split * blocks_per_split
        # bounds known before the loop (no test inside it): what lets Triton pipeline the blocks' loads
        for blk in range(first, tl.minimum(first + blocks_per_split, tl.cdiv(n, 2 * HALF))):
            base = key_codes + r * skr + blk * skb
            packed = tl.load(base + chans[:, None] * skd + pairs[None, :])  # [D, HALF] uint8
            k_scale = tl.load(key_scale + r * ssr + blk * ssb + chans).to(tl.float32)
            k_zero = tl.load(key_zero + r * ssr + blk * ssb + chans).to(tl.float32)
            # q·k = Σ_c (q_c·s_c)·code + Σ_c q_c·z_c: the scale folds into the query, the zero into one bias
            q_scaled = q * k_scale[None, :]
            offset = tl.sum(q * k_zero[None, :], axis=1)  # [G_PAD]
            s_even = tl.dot(q_scaled, (packed & 15).to(tl.float32), input_precision=DOT) + offset[:, None]
            s_odd = tl.dot(q_scaled, (packed >> 4).to(tl.float32), input_precision=DOT) + offset[:, None]
            even = blk * 2 * HALF + 2 * pairs
            odd = even + 1
            if HAS_BIAS:
                s_even += tl.load(bias + row * sbb + even, mask=even < n, other=0.0)[None, :]
                s_odd += tl.load(bias + row * sbb + odd, mask=odd < n, other=0.0)[None, :]
            s_even = tl.where((even < n)[None, :], s_even, float("-inf"))
            s_odd = tl.where((odd < n)[None, :], s_odd, float("-inf"))
            m_new = tl.maximum(m_i, tl.maximum(tl.max(s_even, axis=1), tl.max(s_odd, axis=1)))
            alpha = tl.exp(m_i - m_new)
            p_even = tl.exp(s_even - m_new[:, None])
            p_odd = tl.exp(s_odd - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p_even, axis=1) + tl.sum(p_odd, axis=1)
            codes, scales, zeros = value_codes + r * svr, value_scale + r * sgr, value_zero + r * sgr
            # (the even tokens, then the odd ones: Triton compiles no loop over a tuple)
            lo_e, hi_e = _kivi_values(codes, scales, zeros, even, p_even, halves, n, size, svn, sgn, DOT, False)
            lo_o, hi_o = _kivi_values(codes, scales, zeros, odd, p_odd, halves, n, size, svn, sgn, DOT, False)
            acc_lo = acc_lo * alpha[:, None] + lo_e + lo_o
            acc_hi = acc_hi * alpha[:, None] + hi_e + hi_o
            m_i = m_new
        out = part_acc + r * spr + split * sps + heads[:, None] * D
        tl.store(out + 2 * halves[None, :], acc_lo, mask=live[:, None])
        tl.store(out + 2 * halves[None, :] + 1, acc_hi, mask=live[:, None])
        ml = part_ml + r * smr + split * sms + heads * 2
        tl.store(ml, m_i, mask=live)
        tl.store(ml + 1, l_i, mask=live)

    @triton.jit
    def _kivi_tile_kernel(
        query, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero, bias, length, part_acc, part_ml,
        kv_heads, n, blocks, split_len, scale,
        sqr, skr, skb, skd, ssr, ssb, svr, svn, sgr, sgn, sbb, spr, sps, smr, sms,
        G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, HALF: tl.constexpr, NB: tl.constexpr,
        GROUPS: tl.constexpr, GW: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LENGTH: tl.constexpr,
        LOW: tl.constexpr, DOT: tl.constexpr, SPLIT: tl.constexpr, MAGIC: tl.constexpr,
    ):  # fmt: skip
        """Program (row × KV head r, split j): the G query rows of KV head r over the tokens of split j, NB key
        blocks (NB·2·HALF tokens) at a time, shaped as the fp8 kernel is: each tile's codes are read as stored in
        wide contiguous runs (a key block's channel rows, a token's value bytes), dequantized in registers into one
        ``[D, TILE]`` key and one ``[TILE, D]`` value operand (nibbles rejoined into token / channel order), then one
        product each against the group's rows. ``LOW``: the operands in the query's bfloat16 / float16 (a code times
        its scale rounded as the model's own dequantized cache is), products accumulated in float32; else float32
        operands (``DOT``: ``ieee`` or ``tf32``). ``SPLIT``: nothing rejoined: the even and odd tokens (a byte's two
        nibbles) are two key operands, each value's even and odd channels two sums (as ``_kivi_decode_kernel``).
        ``MAGIC``: codes widened by ``_widened``'s bit trick. Writes the unnormalised sum and (max, denominator)."""
        r = tl.program_id(0)
        split = tl.program_id(1)
        row = r // kv_heads
        start, stop = split_bounds(n, length, split_len, HAS_LENGTH)
        rows = tl.arange(0, G_PAD)
        chans = tl.arange(0, D)
        live = rows < G
        q = tl.load(query + r * sqr + rows[:, None] * D + chans[None, :], mask=live[:, None], other=0.0)
        q = q if LOW else q.to(tl.float32)
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        acc_lo = tl.zeros((G_PAD, D // 2), tl.float32)  # (SPLIT: a value's even channels, and its odd ones)
        acc_hi = tl.zeros((G_PAD, D // 2), tl.float32)
        pairs = tl.arange(0, NB * HALF)
        halves = tl.arange(0, D // 2)
        codes_r, scales_r, zeros_r = value_codes + r * svr, value_scale + r * sgr, value_zero + r * sgr
        # key tile [D, NB, HALF]: channel c's codes of block b, two tokens a byte (the even one low)
        k_chan = tl.arange(0, D)[:, None, None]
        k_blk = tl.arange(0, NB)[None, :, None]
        k_byte = tl.arange(0, HALF)[None, None, :]
        # value tile [TILE, GROUPS, GW]: token t's bytes of channel group g, two channels a byte (the even one low)
        v_group = tl.arange(0, GROUPS)[None, :, None]
        v_byte = tl.arange(0, GW)[None, None, :]
        offs = tl.arange(0, NB * 2 * HALF)
        for first in range(start, stop, NB * 2 * HALF):
            blk = first // (2 * HALF) + k_blk
            in_blocks = (blk < blocks) & (blk * (2 * HALF) < stop)  # a block past the length is never read
            packed = tl.load(key_codes + r * skr + blk * skb + k_chan * skd + k_byte, mask=in_blocks, other=0)
            at = r * ssr + blk * ssb + k_chan  # [D, NB, 1]
            k_s = tl.load(key_scale + at, mask=in_blocks, other=0.0).to(tl.float32)
            k_z = tl.load(key_zero + at, mask=in_blocks, other=0.0).to(tl.float32)
            k_lo = _widened(packed & 15, MAGIC) * k_s + k_z
            k_hi = _widened(packed >> 4, MAGIC) * k_s + k_z
            if SPLIT:
                even = first + (pairs // HALF) * (2 * HALF) + 2 * (pairs % HALF)  # the low nibbles' tokens
                k_e = tl.reshape(k_lo, (D, NB * HALF)).to(q.dtype)
                k_o = tl.reshape(k_hi, (D, NB * HALF)).to(q.dtype)
                s_e = _tile_scores(q, k_e, even, stop, bias + row * sbb, scale, HAS_BIAS, DOT)
                s_o = _tile_scores(q, k_o, even + 1, stop, bias + row * sbb, scale, HAS_BIAS, DOT)
                m_new = tl.maximum(m_i, tl.maximum(tl.max(s_e, axis=1), tl.max(s_o, axis=1)))
                alpha = tl.exp(m_i - m_new)
                p_e, p_o = tl.exp(s_e - m_new[:, None]), tl.exp(s_o - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p_e, axis=1) + tl.sum(p_o, axis=1)
                lo_e, hi_e = _kivi_values(codes_r, scales_r, zeros_r, even, p_e.to(q.dtype), halves, stop, 2 * GW,
                                          svn, sgn, DOT, MAGIC)  # fmt: skip
                lo_o, hi_o = _kivi_values(codes_r, scales_r, zeros_r, even + 1, p_o.to(q.dtype), halves, stop,
                                          2 * GW, svn, sgn, DOT, MAGIC)  # fmt: skip
                acc_lo = acc_lo * alpha[:, None] + lo_e + lo_o
                acc_hi = acc_hi * alpha[:, None] + hi_e + hi_o
            else:
                k = tl.reshape(tl.join(k_lo, k_hi), (D, NB * 2 * HALF)).to(q.dtype)
                tokens = first + offs
                s = _tile_scores(q, k, tokens, stop, bias + row * sbb, scale, HAS_BIAS, DOT)
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                t3, ok3 = tokens[:, None, None], (tokens < stop)[:, None, None]
                v = tl.load(codes_r + t3 * svn + v_group * GW + v_byte, mask=ok3, other=0)
                at_v = t3 * sgn + v_group  # [TILE, GROUPS, 1]
                v_s = tl.load(scales_r + at_v, mask=ok3, other=0.0).to(tl.float32)
                v_z = tl.load(zeros_r + at_v, mask=ok3, other=0.0).to(tl.float32)
                v_lo = _widened(v & 15, MAGIC) * v_s + v_z
                v_hi = _widened(v >> 4, MAGIC) * v_s + v_z
                vals = tl.reshape(tl.join(v_lo, v_hi), (NB * 2 * HALF, D)).to(q.dtype)
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), vals, input_precision=DOT)
            m_i = m_new
        out = part_acc + r * spr + split * sps + rows[:, None] * D
        if SPLIT:
            tl.store(out + 2 * halves[None, :], acc_lo, mask=live[:, None])
            tl.store(out + 2 * halves[None, :] + 1, acc_hi, mask=live[:, None])
        else:
            tl.store(out + chans[None, :], acc, mask=live[:, None])
        ml = part_ml + r * smr + split * sms + rows * 2
        tl.store(ml, m_i, mask=live)
        tl.store(ml + 1, l_i, mask=live)


# Launch shape: warps and pipeline stages per program, and the programs per multiprocessor the token splits aim for
# (0: ``_split_len``'s rule, at least 64 blocks a split), measured on an H200 (bench/kernel_sweep.py). Values are
# dequantized per element: reading them per channel group instead (each group's scale folded into the probabilities,
# one batched product per group) was timed there too and ran no faster (327 vs 329 µs at 16 × 8K, 158 vs 155 µs at
# 1 × 32K) with 30-50× the error under TF32 (bench/results/kernel-sweep-h200-values-2026-11-27.md), so it was dropped.
KIVI_WARPS, KIVI_STAGES, KIVI_PROGRAMS_PER_SM = 4, 2, 8
# Tokens per iteration of the tile kernel (``_kivi_tile_kernel``; at least one key block); 0: the per-block kernel.
# Swept on an H200 (Llama-3-8B's attention; bench/results/kernel-sweep-h200-tiles-2026-11-27.md): 256 tokens, 4 warps,
# 2 stages, 8 programs per multiprocessor took 253 µs at 16 × 8K and 178 µs at 1 × 32K, where the per-block kernel's
# best took 339 and 272 µs in the same run.
KIVI_TILE = 256
KIVI_SPLIT = False  # the tile kernel's SPLIT form (not yet measured on a GPU: bench/kernel_sweep.py sweeps both)
KIVI_MAGIC = False  # its codes widened by a bit trick (``_widened``; not yet measured on a GPU, swept too)


def kivi_tile_fits(dim: int, groups: int) -> bool:
    """What the tile kernel reads besides ``kivi_kernel_fits``: value channel groups of a power-of-two width
    (whole bytes), so a token's bytes split into ``[groups, width / 2]``."""
    size = dim // groups
    return dim % groups == 0 and size >= 2 and size & (size - 1) == 0


def kivi_decode_triton(
    query: torch.Tensor, key_codes: torch.Tensor, key_scale: torch.Tensor, key_zero: torch.Tensor,
    value_codes: torch.Tensor, value_scale: torch.Tensor, value_zero: torch.Tensor, bias: torch.Tensor | None,
    scale: float, splits: int | None = None, precise: bool | None = None, num_warps: int | None = None,
    num_stages: int | None = None, length: torch.Tensor | None = None, tile: int | None = None,
    split_tiles: bool | None = None, magic: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``kivi_decode_reference`` in one launch, grid (rows × KV heads, token splits of whole blocks), the splits
    merged as ``merge_partials`` merges. ``precise``: float32 products (default: when the query is float32), else
    the tile kernel's 16-bit operands (TF32 in the per-block kernel). ``splits``, ``num_warps``, ``num_stages``: the
    launch shape (default: ``KIVI_*``). ``length`` (a 0-d tensor, read on the device): only the first ``length``
    tokens are read (a static cache's blocks quantized so far; its step keeps its shapes and skips the rest).
    ``tile``: tokens per iteration of the tile kernel (default ``KIVI_TILE``; 0, or value groups it cannot split:
    the per-block kernel); ``split_tiles``, ``magic``: its ``SPLIT`` and ``MAGIC`` forms (default ``KIVI_SPLIT``,
    ``KIVI_MAGIC``)."""
    precise = query.dtype == torch.float32 if precise is None else precise
    assert triton is not None, "Triton is not installed (pip install 'kvconvert[kernels]')"
    batch, kv_heads, group, dim = query.shape
    blocks, half = key_codes.shape[2], key_codes.shape[-1]
    assert kivi_kernel_fits(4, 2 * half, dim), "kivi_decode_triton: 4-bit codes, blocks of 2^k >= 32, dims >= 32"
    n, groups, tokens = value_codes.shape[2], value_scale.shape[-1], blocks * 2 * half
    tile = KIVI_TILE if tile is None else tile
    tiles = bool(tile) and kivi_tile_fits(dim, groups)
    blocks_a_step = 1 << (max(tile // (2 * half), 1).bit_length() - 1)  # whole blocks, a power of two (tl.arange)
    step = blocks_a_step * 2 * half if tiles else 2 * half  # tokens a program reads an iteration; splits: whole steps
    low = tiles and not precise and sixteen_bit_products(query)
    query = query.contiguous() if low else query.float().contiguous()
    key_codes, key_scale, key_zero, value_codes, value_scale, value_zero = (
        t.contiguous() for t in (key_codes, key_scale, key_zero, value_codes, value_scale, value_zero))  # fmt: skip
    rows = batch * kv_heads
    if splits is None and KIVI_PROGRAMS_PER_SM:
        splits = split_count(rows, tokens // (4 * step), query.device, KIVI_PROGRAMS_PER_SM)
    split_len = _split_len(tokens, rows, query.device, step, splits)  # in tokens, whole steps
    n_splits = triton.cdiv(tokens, split_len)
    part_acc, part_ml = split_partials(rows, n_splits, group, dim, query.device)
    bias_t = bias.float().contiguous() if bias is not None else part_acc  # any pointer when HAS_BIAS is off
    cache = (query, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero, bias_t,
             part_acc if length is None else length, part_acc, part_ml, kv_heads, n)  # fmt: skip
    strides = (group * dim, key_codes.stride(1), key_codes.stride(2), key_codes.stride(3), key_scale.stride(1),
               key_scale.stride(2), value_codes.stride(1), value_codes.stride(2), value_scale.stride(1),
               value_scale.stride(2), bias_t.stride(0), part_acc.stride(0), part_acc.stride(1), part_ml.stride(0),
               part_ml.stride(1))  # fmt: skip
    launch = dict(G=group, D=dim, G_PAD=max(16, _pow2(group)), HALF=half, HAS_BIAS=bias is not None,
                  HAS_LENGTH=length is not None, num_warps=num_warps or KIVI_WARPS,
                  num_stages=num_stages or KIVI_STAGES)  # fmt: skip
    if tiles:
        _kivi_tile_kernel[(rows, n_splits)](
            *cache, blocks, split_len, scale, *strides, NB=step // (2 * half), GROUPS=groups, GW=dim // groups // 2,
            LOW=low, DOT="ieee" if precise else "tf32", SPLIT=KIVI_SPLIT if split_tiles is None else split_tiles,
            MAGIC=KIVI_MAGIC if magic is None else magic, **launch,
        )  # fmt: skip
    else:
        _kivi_decode_kernel[(rows, n_splits)](
            *cache, split_len // (2 * half), scale, math.ceil(dim / groups), *strides, D_HALF=dim // 2,
            DOT="ieee" if precise else "tf32", **launch,
        )  # fmt: skip
    return merged_splits(part_acc, part_ml, batch)
