"""How kvconvert's caches pack integer codes into bytes: 2, 4 and 8 bits lowest first in each byte, 3 bits as a
2-bit and a 1-bit part (``_pack3``); the planes the readers split them into. Copied verbatim into every output
directory; imports only torch.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def codes_per_unit(bits: int) -> int:
    """Codes that ``pack`` makes whole bytes of: one byte at 2, 4 and 8 bits, three at 3. At 2, 4 and 8 bits a
    range of whole units is a byte range of the packed codes; at 3 bits only a whole packed row is (``_pack3``)."""
    return 8 if bits == 3 else 8 // bits


def plane_count(bits: int) -> int:
    """How many planes ``bit_planes`` splits packed codes into: plane k holds codes ``plane_count·j + k``."""
    return 4 if bits == 3 else 8 // bits


def packed_width(width: int, bits: int) -> int:
    """Bytes that ``pack`` makes of ``width`` codes."""
    return 3 * math.ceil(width / 8) if bits == 3 else math.ceil(width / (8 // bits))


def _pack3(codes: torch.Tensor) -> torch.Tensor:
    """3-bit codes ``[..., w]`` -> ``[..., 3·w'/8]`` (w' = w rounded up to 8): their low 2 bits as ``pack`` packs
    2-bit codes (w'/4 bytes, codes 4j…4j+3 in byte j), then their high bits (w'/8 bytes) as a stream of bits, lowest
    first, in the order of the low part's planes: the high bit of code 4j + k is bit k·w'/4 + j. Each of the 4 planes
    (``three_bit_planes``) then reads its low bits from one byte and its high bits from contiguous bytes, which a
    compiled loop reads as vectors of w'/4 codes: keys' scores at 8 rows × 4K of SmolLM2 2.6 → 0.8 ms a layer (4-bit:
    0.5), where 24-bit words of 8 codes (three bytes 3 apart) read as 8 planes of 8 codes each (2 AMD EPYC cores).
    Bytes as before: 3 per 8 codes."""
    width = codes.shape[-1]
    padded = math.ceil(width / 8) * 8
    if padded != width:
        codes = torch.nn.functional.pad(codes, (0, padded - width))
    high = (codes >> 2).view(*codes.shape[:-1], padded // 4, 4).transpose(-1, -2)  # [..., plane k, j]
    return torch.cat([pack(codes & 3, 2), pack(high.flatten(-2), 1)], dim=-1)


def _unpack3(packed: torch.Tensor, width: int) -> torch.Tensor:
    planes = three_bit_planes(packed)  # code 4j + k at [..., j, k]
    return torch.stack(planes, dim=-1).flatten(-2)[..., :width]


_HIGH_BITS: dict[torch.device, torch.Tensor] = {}  # per device: ``_high_bits``' table


def _high_bits(device: torch.device) -> torch.Tensor:
    """``[256]`` int64: for a byte x, the 8 bytes whose byte b is 4 × bit b of x (a high bit as its code's 4)."""
    table = _HIGH_BITS.get(device)
    if table is None:
        x = torch.arange(256, dtype=torch.int64, device=device)
        table = _HIGH_BITS[device] = sum((((x >> b) & 1) << (8 * b + 2) for b in range(8)), torch.zeros_like(x))
    return table


def three_bit_planes(packed: torch.Tensor) -> list[torch.Tensor]:
    """``_pack3``'s codes ``[..., 3·w/8]`` as 4 planes of uint8 codes ``[..., w/4]``, plane k holding codes 4j + k.
    Eager torch: each high byte looked up as the 8 bytes it spreads to, then each plane in one pass (stacked); the
    lookup took 0.6-0.75× the time of spreading by shifts or an int64 multiply (2 AMD EPYC cores). CPU decode steps
    read 3-bit codes through ``torch.compile``'s loop instead (``_traced_three_bit_planes``)."""
    width = packed.shape[-1] * 8 // 3
    low, high = packed[..., : width // 4], packed[..., width // 4 :]
    his = _high_bits(packed.device)[high.long()].view(torch.uint8).view(*high.shape[:-1], 4, width // 4)
    return list((torch.stack(low_bit_pairs(low), dim=-2) | his).unbind(-2))


def low_bit_pairs(low: torch.Tensor) -> list[torch.Tensor]:
    """The 4 two-bit fields of each byte, lowest first (2-bit codes, or 3-bit codes' low bits)."""
    return [low & 3, (low >> 2) & 3, (low >> 4) & 3, low >> 6]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [..., w]`` uint8 < 2^bits -> ``[..., ceil(w·bits/8)]`` uint8, element i in bits i·b… of its byte
    (3-bit: ``_pack3``)."""
    if bits == 3:
        return _pack3(codes)
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    width = codes.shape[-1]
    padded = math.ceil(width / per_byte) * per_byte
    if padded != width:
        codes = torch.nn.functional.pad(codes, (0, padded - width))
    codes = codes.view(*codes.shape[:-1], padded // per_byte, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (codes << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """Inverse of ``pack``: ``[..., ceil(w·bits/8)]`` -> ``[..., w]`` uint8."""
    if bits == 3:
        return _unpack3(packed, width)
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    # one scalar shift per position in the byte, then one stack: a shift broadcast against a tensor
    # of shifts takes torch's slow (unvectorised) path on CPU, 1.7× the time of this (16K tokens)
    mask = 2**bits - 1
    parts = [packed >> shift if shift + bits == 8 else (packed >> shift) & mask for shift in range(0, 8, bits)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)[..., :width]


_COLUMN_GROUPS: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, list[list[int]]]] = {}


def column_groups(planes: int, columns: int, groups: int, size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:  # fmt: skip
    """The channel group of every column of every bit plane ``[planes, columns]`` (channel ``planes·j + k`` in column
    j of plane k), of every channel ``[planes·columns]``, and per plane the column each group starts at (``groups +
    1`` of them, the last ``columns``: a group's columns are a run in every plane), groups of ``size`` channels (a
    packed row's codes past the last group's end take the last group's; they are cut off). Kept per shape and
    device: a step asks once a layer; a compiled step traces them (plain arithmetic, no tensor read back)."""
    key, traced = (planes, columns, groups, size, device), torch.compiler.is_compiling()
    if key in _COLUMN_GROUPS and not traced:
        return _COLUMN_GROUPS[key]
    of_channel = (torch.arange(planes * columns, device=device) // size).clamp_(max=groups - 1)
    of_column = of_channel.view(columns, planes).T.contiguous()
    # plane k's first column of group g: the first j with planes·j + k >= g·size
    starts = [[min(columns, max(0, -(-(g * size - k) // planes))) for g in range(groups)] + [columns]
              for k in range(planes)]  # fmt: skip
    if not traced:
        _COLUMN_GROUPS[key] = of_column, of_channel, starts
    return of_column, of_channel, starts


def bit_planes(codes: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """Codes ``planes·j + k`` of each packed row, for each k, widened to float32 (``plane_count``; the codec packs
    consecutive codes lowest first: ``pack``, at 3 bits ``_pack3``)."""
    if bits == 3:  # while ``torch.compile`` traces (a compiled reader, or a compiled step): its own formula
        return _traced_three_bit_planes(codes) if torch.compiler.is_compiling() else [
            plane.float() for plane in three_bit_planes(codes)]  # fmt: skip
    mask = 2**bits - 1
    # the lowest code needs no shift and the highest no mask: a pass over the codes fewer each
    return [(codes & mask if not shift else codes >> shift if shift + bits == 8 else (codes >> shift) & mask).float()
            for shift in range(0, 8, bits)]  # fmt: skip


def _traced_three_bit_planes(codes: torch.Tensor) -> list[torch.Tensor]:
    """``bit_planes`` of 3-bit codes as ``torch.compile`` traces them. Each plane's high bits are a run of w/32 bytes
    (``_pack3``), read as one word per row of up to 32 bits and shifted by each code's place: Inductor loads the word
    once and shifts a vector of places (unpacking them to a byte each first, by eight shifts or a table, makes it
    index bytes by j // 8, which it gathers a byte at a time: 5× slower). Rows whose codes are not a multiple of 32
    take the eight shifts (``unpack`` at 1 bit)."""
    # a model has one width a side: specialised (``int``), so that the loop indexes bytes by constants
    width = int(codes.shape[-1]) * 8 // 3
    low, high = codes[..., : width // 4], codes[..., width // 4 :]
    lows = low_bit_pairs(low)
    if width % 32:
        bits = unpack(high, 1, width).view(*high.shape[:-1], 4, width // 4)
        return [(lo | (bits[..., k, :] << 2)).float() for k, lo in enumerate(lows)]
    per_plane = width // 32  # bytes of high bits per plane, read as words of up to 4 bytes (int32 shifts)
    planes = []
    for k, lo in enumerate(lows):
        his = []
        for start in range(k * per_plane, (k + 1) * per_plane, 4):
            size = min(4, (k + 1) * per_plane - start)
            word = high[..., start].to(torch.int32)
            for b in range(1, size):
                word = word | (high[..., start + b].to(torch.int32) << (8 * b))
            places = torch.arange(8 * size, device=codes.device, dtype=torch.int32)
            his.append((word[..., None] >> places) & 1)
        hi = his[0] if len(his) == 1 else torch.cat(his, dim=-1)  # [..., w/4]
        planes.append((lo.to(torch.int32) | (hi << 2)).float())
    return planes
