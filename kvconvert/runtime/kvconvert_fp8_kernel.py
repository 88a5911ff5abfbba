"""Decode over float8 e4m3 storage (``Fp8Layer``: the serving engines' format, one static scale per layer or per KV
head): a Triton kernel that reads the codes as stored, and its plain-torch reference. Copied verbatim into every
output directory; Triton is optional (see ``kvconvert_kernels``).

A step of the stock model reads an fp8 cache back whole as 16-bit tensors (a full-size write and re-read) before SDPA
reads it once more: three times the bytes of the codes. The kernel reads each code once. A KV head's G query rows
share every code they read (one ``tl.dot`` over the group's rows, padded to 16), the layer's scales multiply the
scores and the weighted sum instead of the codes (``q·(s·c) = s·(q·c)``), e4m3 widens exactly to bfloat16 / float32,
products accumulate in float32, and long caches are cut into token splits merged afterwards (flash-decoding).
"""

from __future__ import annotations

import torch

from .kvconvert_kernels import (
    _pow2,
    interpreted,
    merged_splits,
    sixteen_bit_products,
    split_bounds,
    split_count,
    split_partials,
    triton,
)

if triton is not None:
    import triton.language as tl

# Launch shape, chosen by measurement on an NVIDIA H200 (bench/kernel_sweep.py): tokens per tile, warps and pipeline
# stages per program, and how many programs per multiprocessor the token splits aim for.
FP8_TILE, FP8_WARPS, FP8_STAGES, FP8_PROGRAMS_PER_SM = 128, 4, 3, 4


def fp8_decode_reference(
    query: torch.Tensor, key_codes: torch.Tensor, value_codes: torch.Tensor, key_scale: torch.Tensor,
    value_scale: torch.Tensor, bias: torch.Tensor | None, scale: float, length: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``query [b, Hkv, G, d]``, ``key_codes / value_codes [b, Hkv, n, d]`` (e4m3, or their bytes as uint8), the
    static scales ``[Hkv]`` or ``[1]``, ``bias [b, n]`` additive or None, ``length`` (a 0-d tensor or None): only
    the first ``length`` tokens are read. Returns ``[b, Hkv, G, d]`` float32: softmax attention over the codes' values
    (code × scale), in float32."""
    kv_heads, n = key_codes.shape[1], key_codes.shape[2]

    def values_of(codes: torch.Tensor, per_head: torch.Tensor) -> torch.Tensor:
        f8 = codes.view(torch.float8_e4m3fn) if codes.dtype == torch.uint8 else codes
        return f8.float() * per_head.float().expand(kv_heads)[None, :, None, None]

    scores = torch.einsum("bhgd,bhnd->bhgn", query.float(), values_of(key_codes, key_scale)) * scale
    if bias is not None:
        scores = scores + bias.float()[:, None, None, :]
    if length is not None:
        scores = scores.masked_fill(torch.arange(n, device=scores.device) >= length, float("-inf"))
    return torch.einsum("bhgn,bhnd->bhgd", torch.softmax(scores, dim=-1), values_of(value_codes, value_scale))


if triton is not None:

    @triton.jit
    def _e4m3(codes, NATIVE: tl.constexpr):
        """e4m3 bytes as float32: converted (sm_89 and later), else by moving bits into float16 (as
        ``kvconvert_codec.fp8_as_half``: exact, 256 times smaller; the caller's scales carry the 256)."""
        if NATIVE:
            return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        c = codes.to(tl.uint16)
        return (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _fp8_decode_kernel(
        query, keys, values, key_scale, value_scale, bias, length, part_acc, part_ml,
        kv_heads, n, split_len, scale, scale_stride,
        sqr, skr, skn, svr, svn, sbb, spr, sps, smr, sms,
        G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, TILE: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_LENGTH: tl.constexpr, HALF: tl.constexpr, DOT: tl.constexpr, NATIVE: tl.constexpr,
    ):  # fmt: skip
        """Program (row × KV head r, split j): the G query rows of KV head r over the tokens of split j, TILE at a
        time, an online softmax in float32. ``HALF``: the query's own bfloat16 / float16 operands on tensor cores
        (e4m3 widens exactly to either), else float32 products (``DOT``: ``ieee``, as a float32 model computes).
        Writes the unnormalised sum and (max, denominator) per query row."""
        r = tl.program_id(0)
        split = tl.program_id(1)
        row = r // kv_heads
        head = r % kv_heads
        start, stop = split_bounds(n, length, split_len, HAS_LENGTH)
        rows = tl.arange(0, G_PAD)
        chans = tl.arange(0, D)
        offs = tl.arange(0, TILE)
        live = rows < G
        q = tl.load(query + r * sqr + rows[:, None] * D + chans[None, :], mask=live[:, None], other=0.0)
        if not HALF:
            q = q.to(tl.float32)
        # the key scale multiplies the scores, the value scale the sum: the codes are used as they are
        unit = 1.0 if NATIVE else 256.0  # (``_e4m3``)
        # (Inductor passes a float argument as float64: every factor is made float32)
        k_scale = (tl.load(key_scale + head * scale_stride).to(tl.float32) * (scale * unit)).to(tl.float32)
        v_scale = (tl.load(value_scale + head * scale_stride).to(tl.float32) * unit).to(tl.float32)
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        for first in range(start, stop, TILE):
            tokens = first + offs
            inside = tokens < stop
            k = tl.load(keys + r * skr + tokens[:, None] * skn + chans[None, :], mask=inside[:, None], other=0)
            s = tl.dot(q, tl.trans(_e4m3(k, NATIVE).to(q.dtype)), input_precision=DOT) * k_scale
            if HAS_BIAS:
                s += tl.load(bias + row * sbb + tokens, mask=inside, other=0.0)[None, :]
            s = tl.where(inside[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(values + r * svr + tokens[:, None] * svn + chans[None, :], mask=inside[:, None], other=0)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), _e4m3(v, NATIVE).to(q.dtype), input_precision=DOT)
            m_i = m_new
        out = part_acc + r * spr + split * sps + rows[:, None] * D + chans[None, :]
        tl.store(out, acc * v_scale, mask=live[:, None])
        ml = part_ml + r * smr + split * sms + rows * 2
        tl.store(ml, m_i, mask=live)
        tl.store(ml + 1, l_i, mask=live)


def fp8_decode_triton(
    query: torch.Tensor, key_codes: torch.Tensor, value_codes: torch.Tensor, key_scale: torch.Tensor,
    value_scale: torch.Tensor, bias: torch.Tensor | None, scale: float, length: torch.Tensor | None = None,
    splits: int | None = None, tile: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    native: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """``fp8_decode_reference`` in one launch, grid (rows × KV heads, token splits), the splits merged in torch. The
    caches are read where they are (token rows of ``d`` contiguous codes); ``length`` is read on the device, so a
    static cache's step keeps its shapes (CUDA graphs) and skips the slots not written yet. ``splits``, ``tile``,
    ``num_warps``, ``num_stages``: the launch shape (default: the measured ``FP8_*``). ``native``: convert e4m3 in
    hardware (default: where it has it, sm_89 on, and in the interpreter), else by moving bits (``_e4m3``)."""
    assert triton is not None, "Triton is not installed (pip install 'kvconvert[kernels]')"
    batch, kv_heads, group, dim = query.shape
    n = key_codes.shape[2]
    assert dim >= 16 and dim & (dim - 1) == 0, "fp8_decode_triton: heads of a power-of-two width >= 16"
    tile = tile or FP8_TILE
    # the kernel indexes rows × KV heads as one axis and channels contiguously (a cropped cache, a slice along its
    # tokens, is read in place)
    key_codes, value_codes = (c if c.stride(-1) == 1 and c.stride(0) == kv_heads * c.stride(1) else c.contiguous()
                              for c in (key_codes.view(torch.uint8), value_codes.view(torch.uint8)))  # fmt: skip
    half = sixteen_bit_products(query)
    query = query.contiguous() if half else query.float().contiguous()
    if native is None:
        native = interpreted() or not query.is_cuda or torch.cuda.get_device_capability(query.device) >= (8, 9)
    rows = batch * kv_heads
    if splits is None:
        splits = split_count(rows, n // (4 * tile), query.device, FP8_PROGRAMS_PER_SM)
    split_len = triton.cdiv(triton.cdiv(n, splits), tile) * tile
    n_splits = triton.cdiv(n, split_len)
    part_acc, part_ml = split_partials(rows, n_splits, group, dim, query.device)
    bias_t = bias.float().contiguous() if bias is not None else part_acc  # any pointer when HAS_BIAS is off
    length_t = length if length is not None else part_acc
    scale_stride = 1 if key_scale.numel() > 1 else 0
    _fp8_decode_kernel[(rows, n_splits)](
        query, key_codes, value_codes, key_scale.float().contiguous(), value_scale.float().contiguous(), bias_t,
        length_t, part_acc, part_ml, kv_heads, n, split_len, scale, scale_stride,
        group * dim, key_codes.stride(1), key_codes.stride(2), value_codes.stride(1), value_codes.stride(2),
        bias_t.stride(0), part_acc.stride(0), part_acc.stride(1), part_ml.stride(0), part_ml.stride(1),
        G=group, D=dim, G_PAD=max(16, _pow2(group)), TILE=tile, HAS_BIAS=bias is not None,
        HAS_LENGTH=length is not None, HALF=half, DOT="tf32" if half else "ieee", NATIVE=native,
        num_warps=num_warps or FP8_WARPS, num_stages=num_stages or FP8_STAGES,
    )  # fmt: skip
    acc, ml = merged_splits(part_acc, part_ml, batch)
    return acc / ml[..., 1:]
