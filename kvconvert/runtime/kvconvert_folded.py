"""Attention over quantized storage in KIVI's layout in plain torch, from the codes (no float copy of the cache): the
reader a CPU decodes with (``kivi_decode_folded``), its parts that MiniCache's latents reuse, and the partial
softmaxes the runtimes merge with exact tokens; the largest reads through loops ``torch.compile`` builds from the same
algebra (``fused_call``). Copied verbatim into every output directory; imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from .kvconvert_codec import channel_groups, rotation
from .kvconvert_compiled import compiled_call
from .kvconvert_kernels import combine_partials
from .kvconvert_packing import bit_planes, codes_per_unit, column_groups, plane_count

# Scores more than 64 below a row's largest are floored there before ``torch.exp``: its CPU code takes a slow path for
# every argument whose result underflows (measured on 2 AMD EPYC cores: 8 rows × 1K scores of a decode step 26 µs,
# 275-700 µs when they lie below -88, as a padded batch's masked positions and a peaked head's far tokens do). The
# floor keeps what the weights meet downstream normal too: exp(-64) ≈ 1.6e-28 times a value scale down to 1e-10 is
# above float32's (and bfloat16's) smallest normal 1.2e-38, where the old floor's exp(-87) ≈ 1.6e-38 made a padded
# batch's weighted scales subnormal, which torch's int4 kernel reads 15× more slowly (bfloat16 [4, 1024] × int4
# [1024, 64]: 131 µs against 8.7 µs, Intel Xeon; 22 % of them subnormal at 8 left-padded rows of up to 1K tokens).
# A weight of 1.6e-28 instead of 0 changes no float32 sum it joins beside the largest weight's 1.
EXP_FLOOR = -64.0

# The torch reader widens codes to float32 a few blocks (keys) or tokens (values) at a time, about this many bytes of
# widened codes each: whole, a layer's planes are as large as a float32 copy of its cache (12.6 MB per side at 8 rows
# × 4K on SmolLM2, 100 MB at 8 × 32K), fresh memory on every step. Measured on 2 AMD EPYC cores, 8 × 4K keys' scores
# alone: 6.5 ms whole against 2.2 ms in 3 MB pieces with glibc's default allocator, 2.4 against 1.7 ms with a heap
# that never returns memory; in the whole model (4-bit KIVI, its values then still widened) 2 MB pieces were too many
# small ops (32 tok/s), 8 MB 38-42 tok/s, whole 36-38. Within a piece the same products in the same order.
PLANE_BYTES = 1 << 23

# On a CPU, eager decode steps read the largest caches' codes through readers compiled by ``torch.compile`` (Inductor:
# one C++ loop that widens each code in registers and never writes a plane): KIVI's keys at 8 rows × 4K tokens of
# SmolLM2 1.6–1.8 → 0.5 ms a layer, 4-bit KIVI's decode 1.19–1.26 → 1.45–1.58× the source's. A compiled call costs
# 110–170 µs inside a real step (dynamo's guards and wrappers run cold after a layer's weights streamed through the
# caches; 35 µs alone), so below ``FUSE_MIN_CODES`` bytes of 4-bit codes (as many codes at other widths) a reader
# loses (SmolLM2 at 1 × 1K, 92 KB of keys: KIVI 0.85 → 0.82× the source with the bound at 64 KB), while one call for
# the whole of ``kivi_decode_folded`` (values in KIVI's packing) wins from ``WHOLE_MIN_CODES`` (3-bit KIVI 1 × 1K
# 0.73 → 0.81×, 1 × 4K 0.90 → 1.05×, 8 × 4K 1.29 → 1.42×; 2 AMD EPYC cores, the runtimes before and after in one
# process, bench/results/ab-q3-whole-s66-*). When ``compiled_call`` builds them: kvconvert_compiled.py.
FUSE_MIN_CODES = 1 << 18
WHOLE_MIN_CODES = 1 << 15


def fuses(codes: torch.Tensor, bits: int = 0, least: int | None = None) -> bool:
    """Whether reading ``codes`` goes through a compiled reader (``fused_call``): an eager step on a CPU, as many
    codes as ``FUSE_MIN_CODES`` bytes of 4-bit ones (the eager ops' cost follows the codes, not the bytes: 2-bit codes
    compile from half the bytes, 8-bit from twice; unpacked ``codes``, ``bits`` 0, count their elements), or 3-bit
    codes of any size (their eager split into planes costs 1.4-7× the compiled loop from 1 row × 256 tokens of
    SmolLM2 to 8 × 1K: at 1 × 1K 430 against 159 µs a layer's keys, 2 AMD EPYC cores,
    ``bench/folded_readers_bench.py``). Inside a step ``torch.compile`` traces already, the caller's own ops are what
    it fuses. ``least``: another bound than ``FUSE_MIN_CODES`` (``kivi_decode_folded``'s whole read)."""
    held = codes.numel() * 4 // bits if bits else codes.numel()  # in bytes of 4-bit codes
    least = 0 if bits == 3 else FUSE_MIN_CODES if least is None else least
    return codes.device.type == "cpu" and held >= least and not torch.compiler.is_compiling()


def fused_call(name: str, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor, bits: int,
               traced: bool = False) -> torch.Tensor | None:  # fmt: skip
    """``fn`` compiled by Inductor (``compiled_call``) on ``tensors [b, Hkv, ...]`` as rows of b·Hkv (fewer sizes for
    its guards), its ``[b·Hkv, ...]`` result back as ``[b, Hkv, ...]``; or None where it cannot run. ``traced``: ``fn``
    itself, inside ``kivi_decode_folded`` traced whole."""
    rows = (t.flatten(0, 1) for t in tensors)
    out = fn(*rows, bits) if traced else compiled_call(name, fn, *rows, bits)
    return None if out is None else out.unflatten(0, tensors[0].shape[:2])


def kivi_decode_folded(
    query: torch.Tensor, key_codes: torch.Tensor, key_scale: torch.Tensor, key_zero: torch.Tensor,
    value_codes: torch.Tensor, value_scale: torch.Tensor, value_zero: torch.Tensor, bias: torch.Tensor | None,
    scale: float, key_bits: int = 4, value_bits: int = 4, key_factor: torch.Tensor | None = None,
    value_factor: torch.Tensor | None = None,
    exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    value_rotation: torch.Tensor | None = None, skip: int = 0,
    value_sum: Callable[[torch.Tensor], torch.Tensor] | None = None, value_width: int | None = None,
    value_span: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``kivi_decode_reference``'s partial from the codes in torch, the kernel's algebra without a float copy of the
    cache: keys' per-channel scales fold into the query per block (``q·k = Σ (q⊙s)·code + q·z``), values' per-token
    scales into the probabilities (``Σ p·v = Σ (p·s)·code + Σ p·z`` per channel group); each bit plane of the codes
    (``bit_planes``: 2 planes at 4 bits, 4 at 2 and at 3) is widened to float32 once and meets the G query rows of
    its KV head in one product. What a CPU decodes with: on 2 cores 1.0 ms against 2.1 ms for dequantize-then-SDPA
    per layer of SmolLM2 at 4K, 4-bit (3 KV heads × 3 query rows, measured). A packed byte's codes must share a
    value group (``kivi_folded_fits``). ``key_factor`` / ``value_factor`` ``[b, n]`` (or None):
    each token's stored key / value stands for itself times this number (MiniCache's merged directions times a
    layer's norms), applied to its score and to its weight in the values' sum, not to the cache.

    ``exact``: ``(keys, values, bias)``, exact tokens ``[b, Hkv, t, d]`` (a sink's copies, a float tail, this step's
    token) and their additive bias broadcasting to ``[b, Hkv, G, t]`` (or None), attended in the same softmax: the
    partial then covers both, where a second partial merged with this one would cost a CPU a dozen more small ops
    per layer and step. ``value_rotation``: the ``[size, size]`` rotation the stored values went through per channel
    group, undone on the codes' weighted sum (it is linear in the values) before the exact values join it.
    ``skip``: the first tokens held are left out (a sliding window dropped them from the front of its first block):
    cheaper than masking them, and ``bias`` and the factors then cover only the tokens after them. ``value_sum``:
    where the values' codes are not in KIVI's packing (``KiviInt4Values``), ``Σ p·v`` of weights ``[b, Hkv, G, n]``
    over all the quantized tokens, rotated as stored (``value_codes/scale/zero`` are then not read). ``value_width``:
    the values' channels where they are not as many as the keys' (ZACK's packed columns); ``value_span``: only the
    values' channels ``[lo, hi)`` are summed and returned (one KV head's of ZACK's: ``folded_value_span``).

    On a CPU, values in KIVI's packing are read by this function compiled whole (``WHOLE_MIN_CODES``)."""
    # fmt: off
    args = (query, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero, bias, scale, key_bits,
            value_bits, key_factor, value_factor, exact, value_rotation, skip, value_sum, value_width, value_span)
    # fmt: on
    # not where a layer's widths shape the graph (ZACK's packed columns: groups ending inside a byte, values of another
    # width than the keys), each layer's a graph of its own then, looked up among all the others at every call
    fits = value_sum is None and value_span is None and value_width in (None, key_codes.shape[3])
    if fits and value_groups(value_codes, value_scale, value_bits, value_width)[1] and fuses(
            key_codes, key_bits, WHOLE_MIN_CODES):  # fmt: skip
        whole = compiled_call("kivi_decode_folded", _DECODE_TRACED, query.float().contiguous(), *args[1:])
        if whole is not None:
            return whole
    return _decode(*args)


def _decode(
    query: torch.Tensor, key_codes: torch.Tensor, key_scale: torch.Tensor, key_zero: torch.Tensor,
    value_codes: torch.Tensor, value_scale: torch.Tensor, value_zero: torch.Tensor, bias: torch.Tensor | None,
    scale: float, key_bits: int, value_bits: int, key_factor: torch.Tensor | None, value_factor: torch.Tensor | None,
    exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None, value_rotation: torch.Tensor | None,
    skip: int, value_sum: Callable[[torch.Tensor], torch.Tensor] | None, value_width: int | None,
    value_span: tuple[int, int] | None, traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``kivi_decode_folded``'s arithmetic; ``traced``: inside its trace whole, the readers as compiled."""
    dim = value_width or key_codes.shape[3]
    scores = folded_scores(query, key_codes, key_scale, key_zero, key_bits, traced)[..., skip:] * scale
    n = scores.shape[-1]  # the quantized tokens read
    if skip and value_sum is None:
        value_codes, value_scale, value_zero = (t[:, :, skip:] for t in (value_codes, value_scale, value_zero))
    if key_factor is not None:
        scores = scores * key_factor.float()[:, None, None, :]
    if bias is not None:
        scores = scores + bias.float()[:, None, None, :]
    if exact is not None:
        direct = torch.matmul(query.float(), exact[0].float().transpose(-1, -2)) * scale
        scores = torch.cat([scores, direct if exact[2] is None else direct + exact[2].float()], dim=-1)
    top = scores.amax(-1)
    every = torch.exp((scores - top[..., None]).clamp_(min=EXP_FLOOR))  # [b, Hkv, G, n (+ t)]
    probs = every[..., :n]
    weights = probs if value_factor is None else probs * value_factor.float()[:, None, None, :]
    # values: per channel group g, (p ⊙ s_g) against the group's byte columns in every plane; p·z_g for its zeros
    if value_sum is not None:  # the values' codes are another store's to read (the dropped tokens weigh 0)
        acc = value_channels(value_sum(F.pad(weights, (skip, 0)) if skip else weights), value_rotation, dim)
    elif value_span is not None:
        acc = folded_value_span(weights, value_codes, value_scale, value_zero, value_bits, dim, value_span,
                                value_rotation, traced)  # fmt: skip
    else:
        summed = folded_value_sum(weights, value_codes, value_scale, value_zero, value_bits, dim, traced)
        acc = value_channels(summed, value_rotation, dim)
    if exact is not None:
        acc = acc + torch.matmul(every[..., n:], exact[1].float())
    return acc, torch.stack([top, every.sum(-1)], dim=-1)


_DECODE_TRACED = partial(_decode, traced=True)  # what ``torch.compile`` traces whole: the readers' compiled expressions


def folded_value_span(
    weights: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, width: int,
    span: tuple[int, int], rotation: torch.Tensor | None, traced: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``Σ p·v`` over the channels ``span = [lo, hi)`` of values of ``width`` channels only (``folded_value_sum``'s
    arguments), rotated back (``value_channels``): ``[b, Hkv, G, hi − lo]`` float32; where the store rotated its
    values, over the whole channel groups around them (a group's rotation mixes its channels). Channel group by
    channel group (``_values_by_group``); at 3 bits, whose bytes mix a row's channels, the whole row once."""
    size = -(-width // scale.shape[-1])
    lo, hi = span if rotation is None else (span[0] // size * size, -(-span[1] // size) * size)
    if bits == 3:
        acc = folded_value_sum(weights, codes, scale, zero, bits, width, traced)[..., lo:hi]
    else:
        acc = _values_by_group(weights, codes, scale, zero, bits, size, lo, hi, traced)
    if rotation is not None:
        acc = unrotated(acc, rotation)
    return acc[..., span[0] - lo : span[1] - lo]


def folded_value_sum(
    weights: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
    width: int | None = None, traced: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``Σ p·v`` for weights ``[b, Hkv, G, n]`` over values quantized per token in KIVI's packing (``codes [b, Hkv,
    n, P]``, ``scale/zero [b, Hkv, n, groups]``) without a float copy of them: ``(p⊙s_g)·code + p·z_g`` per channel
    group g. ``width``: the values' channels, whose groups of ``ceil(width / groups)`` (the codec's ``channel_groups``)
    may end inside a packed byte (ZACK's packed columns: 93 values in 2 groups of 47); None: groups of whole bytes.
    ``[b, Hkv, G, C]`` float32 (C ≥ width: the packed row's codes), rotated as stored. ``traced``: ``fused_call``'s."""
    groups, channels, planes = scale.shape[-1], codes.shape[-1] * 8 // bits, plane_count(bits)
    size, aligned = value_groups(codes, scale, bits, width)
    of_column, of_channel, starts = column_groups(planes, channels // planes, groups, size, codes.device)
    if traced or fuses(codes, bits):
        if aligned:
            fused = fused_call("folded_value_sum", _values_in_one, weights, codes, scale, zero, bits=bits,
                               traced=traced)  # fmt: skip
        elif bits != 3:
            return _values_by_group(weights, codes, scale, zero, bits, size, 0, channels, traced)
        else:  # 3-bit bytes mix channels: each column's group given as indices, one graph for every layer's widths
            rows = [t.flatten(0, 1) for t in (weights, codes, scale, zero)]
            call: Callable[..., Any] = _values_by_index if traced else partial(
                compiled_call, "folded_value_sum_spans", _values_by_index)  # fmt: skip
            fused = call(*rows, of_column, of_channel, bits)
            fused = None if fused is None else fused.unflatten(0, codes.shape[:2])
        if fused is not None:
            return fused
    zeros = weights @ zero.float()  # [b, Hkv, G, groups]: Σ p·z of every group at once
    summed = None
    for at in _pieces(codes, 2, bits):  # tokens a few at a time, their partial sums added up
        piece = _folded_values(weights[..., at], codes[:, :, at], scale[:, :, at], bits, starts)
        summed = piece if summed is None else summed + piece
    assert summed is not None
    if aligned:
        return (summed.unflatten(-1, (groups, -1)) + zeros[..., None]).flatten(-2)
    return summed + zeros.index_select(-1, of_channel)


def value_groups(codes: torch.Tensor, scale: torch.Tensor, bits: int, width: int | None) -> tuple[int, bool]:
    """``folded_value_sum``'s channel groups: their size, whether each is a whole run of columns in every plane."""
    groups, channels = scale.shape[-1], codes.shape[-1] * 8 // bits
    size = channels // groups if width is None else -(-width // groups)
    return size, groups * size == channels and size % plane_count(bits) == 0


def _values_by_group(
    weights: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, size: int,
    lo: int, hi: int, traced: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``folded_value_sum`` over channels ``[lo, hi)`` (groups of ``size`` that may end inside a packed byte: ZACK's
    packed columns) group by group, each over the bytes holding its channels, one scale a token (``_values_in_one``),
    a neighbour's channels sharing a byte cut off: 2-2.6× as fast as ``_values_by_index`` from 8 × 2K tokens of ZACK's
    packed SmolLM2 values, 3× on Llama-3.1-8B's shapes at 8 × 4K (2 AMD EPYC cores). ``[b, Hkv, G, hi − lo]``."""
    planes, groups = plane_count(bits), scale.shape[-1]
    parts = []
    for g in range(lo // size, min(-(-hi // size), groups)):
        start, end = max(lo, g * size), hi if g == groups - 1 else min(hi, (g + 1) * size)
        first = start // planes
        part = folded_value_sum(weights, codes[..., first : -(-end // planes)], scale[..., g : g + 1],
                                zero[..., g : g + 1], bits, traced=traced)  # fmt: skip
        parts.append(part[..., start - first * planes : end - first * planes])
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def _values_in_one(
    weights: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int
) -> torch.Tensor:  # fmt: skip
    """``folded_value_sum`` over rows ``[R, ·]`` (``b·Hkv``) as one expression for Inductor (``_scores_in_one``): per
    query row and plane, the sum over tokens of ``(p·s_g)·code`` for every channel group at once, the rows one by one
    so that a single loop widens each code once for all of them (8 rows × 4K of SmolLM2, 4-bit: 576 → 365 µs a
    layer; Llama's 4 rows a head and 2 groups: 2.14 → 1.09 ms).
    ``[R, G, groups·size]``."""
    rows, group, n = weights.shape
    groups = scale.shape[-1]
    w = weights.float()
    zeros = w @ zero.float()  # [R, G, groups]
    # plane k holds channels planes·i + k: per group [R, n, groups, size/planes]
    planes = [plane.view(rows, n, groups, -1) for plane in bit_planes(codes, bits)]
    summed = []
    for g in range(group):  # a graph per group size: a model has one
        weighted = (w[:, g, :, None] * scale)[..., None]  # [R, n, groups, 1]
        parts = [(weighted * plane).sum(1) for plane in planes]  # [R, groups, size/planes] each
        summed.append(torch.stack(parts, dim=-1).flatten(-2) + zeros[:, g, :, None])  # [R, groups, size]
    return torch.stack(summed, dim=1).flatten(-2)


def _values_by_index(
    weights: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, of_column: torch.Tensor,
    of_channel: torch.Tensor, bits: int,
) -> torch.Tensor:  # fmt: skip
    """``_values_in_one`` for 3-bit channel groups that end inside a packed byte: each plane's column takes its group's
    scale by index (``column_groups``: ``of_column [planes, columns]``, ``of_channel [C]``). ``[R, G, C]``."""
    group = weights.shape[1]
    w = weights.float()
    zeros = (w @ zero.float()).index_select(-1, of_channel)  # [R, G, C]
    planes = bit_planes(codes, bits)
    scales = [scale.index_select(-1, of_column[k]) for k in range(len(planes))]  # [R, n, columns] each
    summed = [torch.stack([(w[:, g, :, None] * scales[k] * plane).sum(1) for k, plane in enumerate(planes)],
                          dim=-1).flatten(-2) for g in range(group)]  # [R, C] each  # fmt: skip
    return torch.stack(summed, dim=1) + zeros


def token_values_sum(probs: torch.Tensor, held: tuple[torch.Tensor, ...], values: Any, batch: int,
                     dim: int) -> torch.Tensor:  # fmt: skip
    """``Σ p·v`` for probabilities ``[b·Hkv, G, n]`` over the first n tokens of values stored per token in KIVI's
    packing (``held``: codes, scales, zeros, a ``TokenStore``'s blocks or a ``StaticTokenStore``'s buffers), rotated
    back: ``[b·Hkv, G, d]`` float32; how the token layout reads ``--kv-value-bits`` values (``token_decode``)."""
    codes, scale, zero = (t[:, :, : probs.shape[-1]] for t in held)
    summed = folded_value_sum(probs.unflatten(0, (batch, -1)), codes, scale, zero, values.quant.bits, dim)
    return value_channels(summed.flatten(0, 1), value_rotation(values, dim, probs.device), dim)


def token_values_fit(values: Any, dim: int) -> bool:
    """``values`` (a ``TokenStore`` or ``StaticTokenStore`` of width ``dim``) are what ``token_values_sum`` reads:
    per token, at a width the torch reader folds (``kivi_folded_fits``)."""
    return not values.per_channel and kivi_folded_fits(values.quant.bits, values.quant.group)


def value_rotation(values: Any, dim: int, device: torch.device) -> torch.Tensor | None:
    """The ``[size, size]`` rotation ``values`` (a ``TokenStore`` or ``StaticTokenStore``) applied per channel group
    (``--kv-rotate`` where the weights could not take it), or None: undone on a codes reader's weighted sum."""
    if not values.rotate:
        return None
    return rotation(channel_groups(dim, values.quant.group)[1], device)


def _folded_values(weights: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bits: int,
                   starts: list[list[int]]) -> torch.Tensor:  # fmt: skip
    """``Σ (p·s_g)·code`` per channel group g over the tokens of ``codes [b, Hkv, n, P]`` (``scale [b, Hkv, n,
    groups]``, ``weights [b, Hkv, G, n]``): ``[b, Hkv, G, C]`` float32 (C: the packed row's codes), the zeros' part
    not added. Each plane meets each group's weights in that group's run of the plane's columns (``starts``:
    ``column_groups``), the planes' runs apart where a group ends inside a packed byte."""
    groups = scale.shape[-1]
    planes = bit_planes(codes, bits)  # channels planes·i + k in plane k
    # a half-precision scale meets float32 weights in the product itself (promoted, exactly): no float copy
    weighted = [weights * scale[..., g][:, :, None, :] for g in range(groups)]
    if groups == 1:  # one group: no slicing
        return torch.stack([weighted[0] @ plane for plane in planes], dim=-1).flatten(-2)
    sums = []
    for plane, at in zip(planes, starts, strict=True):
        sums.append(torch.cat([weighted[g] @ plane[..., at[g] : at[g + 1]] for g in range(groups)], dim=-1))
    return torch.stack(sums, dim=-1).flatten(-2)


def _pieces(codes: torch.Tensor, axis: int, bits: int) -> list[slice]:
    """Slices of ``codes``' ``axis`` whose widened planes hold about ``PLANE_BYTES`` (all of it in one under
    ``torch.compile``, whose generated code widens nothing in memory)."""
    length = codes.shape[axis]
    if torch.compiler.is_compiling():
        return [slice(0, length)]
    widened = 32 * codes.numel() // bits // max(length, 1)  # float32 bytes of one index along ``axis``
    step = max(1, PLANE_BYTES // max(widened, 1))
    return [slice(start, start + step) for start in range(0, length, step)]


def value_channels(acc: torch.Tensor, rotation: torch.Tensor | None, width: int) -> torch.Tensor:
    """A codes reader's weighted sum over a packed row's codes ``[..., C]`` (``folded_value_sum``) as the values'
    ``width`` channels: the store's rotation per channel group (or None) undone over whole groups, the padded last one
    too (as the codec rotated them; not the codes that fill the row's last byte past them), then cut to ``width``."""
    if rotation is not None:
        size = rotation.shape[0]
        acc = unrotated(acc[..., : -(-width // size) * size], rotation)
    return acc[..., :width]


def unrotated(acc: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """A weighted sum of values ``[..., d]`` stored rotated by ``rotation [size, size]`` per channel group, rotated
    back (the sum is linear in the values, so the rotation is undone on it, not on the cache)."""
    return (acc.view(*acc.shape[:-1], -1, rotation.shape[0]) @ rotation.T).flatten(-2)


def folded_scores(
    query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, traced: bool = False
) -> torch.Tensor:  # fmt: skip
    """``query [b, Hkv, G, d]`` times the keys of per-channel blocks (``codes [b, Hkv, nb, d, ·]``, ``scale/zero
    [b, Hkv, nb, d]``) without dequantizing them: ``q·k = Σ (q⊙s)·code + q·z`` per block, the query scaled per
    block against each bit plane (``bit_planes``). Returns ``[b, Hkv, G, nb·B]`` float32 (unscaled scores).
    ``traced``: inside ``kivi_decode_folded`` traced whole, the compiled reader's expression (``fused_call``)."""
    if traced or fuses(codes, bits):  # the query contiguous: fewer strides for the compiled reader to guard
        query = query.float().contiguous()
        fused = fused_call("folded_scores", _scores_in_one, query, codes, scale, zero, bits=bits, traced=traced)
        if fused is not None:
            return fused
    batch, kv_heads, _, _, _ = codes.shape
    q = query.float()
    parts = []
    for at in _pieces(codes, 2, bits):  # a few blocks at a time
        # [b, Hkv, nb, G, d] queries scaled per block, against each plane [b, Hkv, nb, d, B/planes]: tokens
        # planes·j + k of each block in plane k
        scaled = q[:, :, None] * scale[:, :, at, None, :]  # a half-precision scale promoted in the product, exactly
        part = torch.stack([scaled @ plane for plane in bit_planes(codes[:, :, at], bits)], dim=-1).flatten(-2)
        parts.append(part + (zero[:, :, at].float() @ q.transpose(-1, -2))[..., None])  # q·z per block
    scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return scores.transpose(2, 3).reshape(batch, kv_heads, query.shape[2], -1)


def _scores_in_one(
    query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int
) -> torch.Tensor:  # fmt: skip
    """``folded_scores`` over rows ``[R, ·]`` (``b·Hkv``) as one expression for Inductor: each plane's product is a sum
    over channels of broadcast products, which it generates as a loop reading the codes (a matrix product would
    make it write the planes out first). One sum per query row and plane, not one broadcast over the rows: Inductor
    then reads and widens each code once for all the rows of its KV head in one loop, where the broadcast made a loop
    per row (2 AMD EPYC cores, 4-bit, 8 rows × 4K of SmolLM2: 685 → 549 µs a layer; Llama's 4 rows a head 1.50 → 1.08
    ms; 2-bit 1.25 → 0.70 ms; one row a head unchanged).
    ``[R, G, nb·B]``."""
    rows, group, _ = query.shape
    scaled = query[:, None] * scale[:, :, None, :]  # [R, nb, G, d]
    planes = bit_planes(codes, bits)  # [R, nb, d, B/planes] each
    zeros = zero.float() @ query.transpose(-1, -2)  # [R, nb, G]: q·z per block
    scores = []
    for g in range(group):  # a graph per group size: a model has one
        row = scaled[:, :, g, :, None]  # [R, nb, d, 1]
        parts = [(row * plane).sum(-2) for plane in planes]  # [R, nb, B/planes] each
        scores.append(torch.stack(parts, dim=-1).flatten(-2) + zeros[:, :, g, None])  # [R, nb, B]
    return torch.stack(scores, dim=1).flatten(-2)


def folded_channel_mix(
    weights: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int
) -> torch.Tensor:  # fmt: skip
    """``weights [b, R, nb·B]`` times the tokens of per-channel blocks (``codes [b, nb, w, ·]``, ``scale/zero
    [b, nb, w]``: a store quantized per channel, as MiniCache's subspace latents are) without dequantizing them:
    ``Σᵢ pᵢ·xᵢ = Σ_blocks s ⊙ (Σᵢ pᵢ·codeᵢ) + z·Σᵢ pᵢ``, each bit plane meeting the weights of its tokens.
    Returns ``[b, R, w]`` float32."""
    batch, rows = weights.shape[:2]
    blocks, unit = codes.shape[1], plane_count(bits)
    # [b, nb, planes, R, B/planes], contiguous: the weights of plane k's tokens are one dense matrix per block (a
    # strided operand sends CPU bmm into a loop over its batch)
    p = weights.float().view(batch, rows, blocks, -1, unit).permute(0, 2, 4, 1, 3).contiguous()
    # plane k holds tokens planes·j + k of each block [b, nb, w, B/planes]
    summed = sum(p[:, :, k] @ plane.transpose(-1, -2) for k, plane in enumerate(bit_planes(codes, bits)))
    mixed = (summed * scale.float()[:, :, None]).sum(1)  # [b, R, w]
    return mixed + p.sum((2, 4)).transpose(1, 2) @ zero.float()


def kivi_folded_fits(bits: int, block: int) -> bool:
    """What ``kivi_decode_folded`` reads: 2-, 3-, 4- or 8-bit codes in blocks of whole packed bytes
    (``codes_per_unit``); value channel groups of any size (``folded_value_sum``). 8-bit codes are one plane, the bytes
    themselves: read so, 8-bit KIVI decodes at 1.51× the source at 8 rows × 4K of SmolLM2 where dequantize-then-SDPA
    took 0.67× (2 AMD EPYC cores, same process, ``bench/results/ab-q8-folded-2026-12-07.md``)."""
    unit = codes_per_unit(bits) if bits in (2, 3, 4, 8) else 0
    return unit > 0 and block % unit == 0


def folded_fits(keys: Any, values: Any) -> bool:
    """Both stores' widths and blocks are what ``kivi_decode_folded`` reads (``kivi_folded_fits``)."""
    return all(kivi_folded_fits(store.quant.bits, keys.quant.group) for store in (keys, values))


# 8-bit codes (one plane: the bytes themselves) are read by the torch reader only once a layer's quantized keys hold
# this many codes, where ``fuses`` compiles its reader; below it, widening the bytes costs a step more than
# dequantizing them once for SDPA. SmolLM2, 2 AMD EPYC cores, × the source in one process, read from the codes against
# dequantized: 1 × 1K (196K codes a layer) 0.80-0.81× against 0.88× (eager or compiled reader alike); 1 × 4K 0.99×
# against 0.79×, 8 × 1K 1.01× against 0.89×, 8 × 4K 1.51× against 0.67× (``bench/results/ab-q8-folded-*``).
BYTE_CODES_MIN = 2 * FUSE_MIN_CODES


def byte_codes_pay(keys: Any) -> bool:
    """A growing store's keys (``TokenStore``) are worth reading from their codes: any but 8-bit, or 8-bit ones from
    ``BYTE_CODES_MIN`` codes on."""
    return keys.quant.bits != 8 or keys.blocks is None or keys.blocks.codes.numel() >= BYTE_CODES_MIN


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Softmax attention over the union of disjoint token sets from their partials (``combine_partials``)."""
    acc, ml = combine_partials(torch.stack([a for a, _ in parts]), torch.stack([m for _, m in parts]))
    return acc / ml[..., 1:]


def exact_partial(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax partial (``merge_partials``) of query rows ``q [b, Hkv, G, d]`` over exact ``keys``/``values``
    ``[b, Hkv, t, d]`` with an additive ``bias`` broadcasting to ``[b, Hkv, G, t]`` (or None): the weighted sum
    ``[b, Hkv, G, d]`` and (max, sum of weights) ``[b, Hkv, G, 2]``, float32."""
    scores = torch.einsum("bhgd,bhnd->bhgn", q, keys.float()) * scaling
    if bias is not None:
        scores = scores + bias.float()
    top = scores.amax(-1)
    probs = torch.exp((scores - top[..., None]).clamp_(min=EXP_FLOOR))
    return torch.einsum("bhgn,bhnd->bhgd", probs, values.float()), torch.stack([top, probs.sum(-1)], dim=-1)
