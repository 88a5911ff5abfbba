"""Quantized storage for every kvconvert cache (KIVI's layout: Liu et al. 2024).

Whatever a method caches — stock K/V, slim's pre-RoPE keys, LoRC latents, ZACK's packed columns,
razor's kept tokens, MiniCache's shared directions — is a sequence of token states ``[..., n, w]``
(tokens on dim -2). ``TokenStore`` holds such a sequence:

- tensors that feed attention scores (keys, key latents) are quantized **per channel** over blocks
  of ``group`` tokens (key outlier channels get their own scale); values **per token** over groups of
  at most ``group`` channels;
- asymmetric integers: ``x ≈ zero + code·scale`` with ``code ∈ [0, 2^bits − 1]``, fp16 scale and zero
  per group; 4-bit codes packed two per byte, 2-bit four per byte and 3-bit eight per three bytes into
  real ``uint8`` tensors;
- the newest ``residual`` tokens (and the partial block behind them) stay in the cache dtype and are
  quantized one block at a time as they age, so recent tokens are exact.

Two kvconvert extensions (not in KIVI), off unless asked for; together they halve the KL of 4-bit
storage on SmolLM2 (docs/quant.md, the project repository):

- ``sink``: the first tokens of every sequence stay exact. The first token is an attention sink
  whose keys and values are outliers (Xiao et al. 2023; Sun et al. 2024, "massive activations");
  quantized with the block it starts, it widens every channel's range there;
- ``rotate``: values are quantized after an orthogonal rotation of each channel group (a randomized
  Hadamard matrix where the group size is a power of two, QuaRot's trick), which spreads outlier
  channels over the group; the rotation is undone on reading, so attention sees the same values up
  to rounding. Keys are not rotated: per-channel quantization already gives outlier channels their
  own scale, and rotating them measured no better.

``bits == 16`` means no quantization: the store is a plain growing tensor (today's behaviour).
Copied verbatim into every output directory; imports only torch and transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

BITS = (16, 8, 4, 3, 2)
LAYOUTS = ("kivi", "token")


@dataclass(frozen=True)
class QuantSpec:
    """``config.kvconvert["kv_quant"]``: bits per stored value, group size, unquantized recent tokens,
    and optionally per layer (key bits, value bits) — mixed precision allocated by measured loss —
    which then overrides ``bits``; ``sink`` first tokens kept exact and ``rotate`` (values rotated
    before quantization) are the extensions described above."""

    bits: int = 16
    group: int = 64
    residual: int = 128
    layers: tuple[tuple[int, int], ...] | None = None
    sink: int = 0
    rotate: bool = False
    include_local: bool = False  # also quantize sliding-window layers (kept stock, at 16 bits, otherwise)
    layout: str = "kivi"  # "token": keys and values per token, rotated, in torch's int4 matmul layout (below)

    def __post_init__(self) -> None:
        for bits in (self.bits, *(b for pair in self.layers or () for b in pair)):
            if bits not in BITS:
                raise ValueError(f"kv bits must be one of {BITS}, got {bits}")
        if self.group < 1 or self.residual < 0 or self.sink < 0:
            raise ValueError(f"kv group must be >= 1, residual and sink >= 0, got {self.group}, {self.residual}, "
                             f"{self.sink}")  # fmt: skip
        if self.sink >= self.group:
            raise ValueError(f"kv sink ({self.sink}) must be smaller than the kv group ({self.group})")
        if self.bits == 3 and self.group % 8 and self.layers is None:
            raise ValueError(f"3-bit keys pack 8 tokens in 3 bytes: kv group must be a multiple of 8, got {self.group}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"kv layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "token" and (self.bits != 4 or self.layers is not None or self.group % 32):
            raise ValueError("the token layout is 4-bit storage (one width for every layer) with a kv group that is a "
                             f"multiple of 32; got {self.bits} bits, group {self.group}"
                             + (", widths per layer" if self.layers is not None else ""))  # fmt: skip

    @property
    def quantized(self) -> bool:
        return self.bits < 16 or any(b < 16 for pair in self.layers or () for b in pair)

    def side(self, layer: int, keys: bool) -> QuantSpec:
        """The uniform storage of one layer's keys (or values)."""
        if self.layers is None:
            return self
        return dataclasses.replace(self, bits=self.layers[layer][0 if keys else 1], layers=None)

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> QuantSpec:
        """The storage a checkpoint's runtime spec asks for (none written: 16 bits)."""
        entry = spec.get("kv_quant") or {}
        layers = entry.get("layers")
        return cls(int(entry.get("bits", 16)), int(entry.get("group", 64)), int(entry.get("residual", 128)),
                   None if layers is None else tuple((int(k), int(v)) for k, v in layers),
                   int(entry.get("sink", 0)), bool(entry.get("rotate", False)),
                   bool(entry.get("include_local", False)), str(entry.get("layout", "kivi")))  # fmt: skip

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"bits": self.bits, "group": self.group, "residual": self.residual}
        if self.layers is not None:
            spec["layers"] = [list(pair) for pair in self.layers]
        if self.sink:
            spec["sink"] = self.sink
        if self.rotate:
            spec["rotate"] = True
        if self.include_local:
            spec["include_local"] = True
        if self.layout != "kivi":
            spec["layout"] = self.layout
        return spec

    def bytes_per_value(self, width: int, per_channel: bool) -> float:
        """Accounted bytes per stored value of a ``width``-wide state (codes + fp16 scale and zero)."""
        if not self.quantized:
            return 2.0
        if self.layout == "token":  # per token in groups of ``size`` channels; keys add their block means
            size = token_group_size(width, self.group) or width
            return 0.5 + 4 / size + (2 / self.group if per_channel else 0.0)
        if per_channel:
            return (packed_width(self.group, self.bits) + 4) / self.group
        groups, size = channel_groups(width, self.group)
        return (packed_width(groups * size, self.bits) + 4 * groups) / width


# --------------------------------------------------------------------------- pure functions


def _round_down(x: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The largest ``dtype`` value ≤ x (x float32): the zero point must not exceed the group minimum."""
    finite = torch.finfo(dtype).max
    h = x.clamp(-finite, finite).to(dtype)
    too_big = h.float() > x
    return torch.where(too_big, torch.nextafter(h, h.new_full((), -math.inf)), h)


def _round_up(x: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The smallest positive ``dtype`` value ≥ x (x ≥ 0 float32): the scale must cover the group's range."""
    h = x.clamp(max=torch.finfo(dtype).max).to(dtype)
    too_small = h.float() < x
    h = torch.where(too_small, torch.nextafter(h, h.new_full((), math.inf)), h)
    return torch.where(h > 0, h, torch.ones_like(h))  # constant group: any scale, codes are 0


def quantize_groups(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization of each row of ``x [..., g]`` (one group per row).

    Returns (codes ``[..., g]`` uint8 in [0, 2^bits − 1], scale ``[...]`` fp16, zero ``[...]`` fp16)
    with ``|zero + code·scale − x| ≤ scale/2`` for every element (zero is rounded down and the scale
    up to fp16, so the fp16 grid still covers the group's range)."""
    x = x.float()
    levels = 2**bits - 1
    low, high = x.amin(-1), x.amax(-1)
    zero = _round_down(low)
    scale = _round_up((high - zero.float()) / levels)
    codes = ((x - zero.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, levels)
    return codes.to(torch.uint8), scale, zero


def packed_width(width: int, bits: int) -> int:
    """Bytes that ``pack`` makes of ``width`` codes."""
    return 3 * math.ceil(width / 8) if bits == 3 else math.ceil(width / (8 // bits))


@functools.cache
def rotation(size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """An orthogonal ``[size, size]`` float32 matrix that spreads every channel over the group: a
    Hadamard matrix with random column signs (fixed seed) where ``size`` is a power of two, else the
    Q of a seeded Gaussian's QR. Only ever applied and undone inside one runtime, so nothing about
    it is stored. Built once per (size, device) (on a GPU each build was a blocking host copy per
    layer per step); callers must not modify it."""
    key = (size, str(torch.device(device)))
    if key not in _ROTATIONS:
        _ROTATIONS[key] = _build_rotation(size).to(device)
    return _ROTATIONS[key]


_ROTATIONS: dict[tuple[int, str], torch.Tensor] = {}


def _build_rotation(size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if size & (size - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < size:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (size,), generator=generator) * 2.0 - 1.0
        matrix = h * signs / math.sqrt(size)
    else:
        matrix, _ = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
    return matrix.float()


def _pack3(codes: torch.Tensor) -> torch.Tensor:
    """3-bit codes ``[..., w]`` -> ``[..., 3·ceil(w/8)]``: each 8 codes as one 24-bit little-endian word."""
    width = codes.shape[-1]
    padded = math.ceil(width / 8) * 8
    if padded != width:
        codes = torch.nn.functional.pad(codes, (0, padded - width))
    codes = codes.view(*codes.shape[:-1], padded // 8, 8).to(torch.int32)
    word = (codes << torch.arange(0, 24, 3, dtype=torch.int32, device=codes.device)).sum(-1, keepdim=True)
    octets = (word >> torch.tensor([0, 8, 16], dtype=torch.int32, device=codes.device)) & 255
    return octets.to(torch.uint8).flatten(-2)


def _unpack3(packed: torch.Tensor, width: int) -> torch.Tensor:
    octets = packed.view(*packed.shape[:-1], -1, 3).to(torch.int32)
    word = (octets << torch.tensor([0, 8, 16], dtype=torch.int32, device=packed.device)).sum(-1, keepdim=True)
    codes = (word >> torch.arange(0, 24, 3, dtype=torch.int32, device=packed.device)) & 7
    return codes.to(torch.uint8).flatten(-2)[..., :width]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [..., w]`` uint8 < 2^bits -> ``[..., ceil(w·bits/8)]`` uint8, element i in bits i·b… of its byte
    (3-bit: of its 3-byte word)."""
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


def channel_groups(width: int, group: int) -> tuple[int, int]:
    """(groups, group size) for per-token groups over ``width`` channels: equal groups of at most
    ``group`` channels, so a width that ``group`` does not divide pads fewer than ``groups`` channels."""
    groups = math.ceil(width / group)
    return groups, math.ceil(width / groups)


@dataclass
class QuantizedBlock:
    """Quantized tokens ``[..., n, w]``. Per channel: ``codes [..., n/B, w, B·bits/8]``, scale/zero
    ``[..., n/B, w]``. Per token: ``codes [..., n, ceil(P·bits/8)]`` (P = padded width), scale/zero
    ``[..., n, groups]``. ``center``: the token layout's per-block key means (``TokenLayoutStore``)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    center: torch.Tensor | None = None

    def map(self, fn: Any) -> QuantizedBlock:
        return QuantizedBlock(fn(self.codes), fn(self.scale), fn(self.zero),
                              None if self.center is None else fn(self.center))  # fmt: skip


def quantize_tokens(x: torch.Tensor, bits: int, group: int, per_channel: bool, rotate: bool = False) -> QuantizedBlock:
    """``x [..., n, w]`` -> ``QuantizedBlock``; per channel needs n to be a multiple of ``group``.
    ``rotate`` (per token only): each channel group is multiplied by ``rotation(size)`` first."""
    *lead, n, width = x.shape
    if per_channel:
        blocks = x.reshape(*lead, n // group, group, width).transpose(-1, -2)  # [..., n/B, w, B]
        codes, scale, zero = quantize_groups(blocks, bits)
        return QuantizedBlock(pack(codes, bits), scale, zero)
    groups, size = channel_groups(width, group)
    if groups * size != width:  # replicate the last channel: the padding changes no group's range
        x = torch.cat([x, x[..., -1:].expand(*lead, n, groups * size - width)], dim=-1)
    x = x.reshape(*lead, n, groups, size)
    if rotate:
        x = x.float() @ rotation(size, x.device)
    codes, scale, zero = quantize_groups(x, bits)
    return QuantizedBlock(pack(codes.reshape(*lead, n, groups * size), bits), scale, zero)


def dequantize_tokens(
    block: QuantizedBlock, bits: int, group: int, width: int, per_channel: bool, dtype: torch.dtype,
    rotate: bool = False, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Inverse of ``quantize_tokens`` up to rounding: ``[..., n, w]`` in ``dtype``, written into ``out``
    when given (``[..., n, w]``, contiguous in its last two dims: a token range of a larger tensor).
    ``code·scale + zero`` is one fused pass from the uint8 codes into the result (no float copy of the
    codes, no transposed copy of per-channel keys): a decode step runs it over the whole cache."""
    if per_channel:
        codes = unpack(block.codes, bits, group)  # [..., n/B, w, B] uint8
        *lead, blocks, _, size = codes.shape
        if out is None:
            out = torch.empty(*lead, blocks * size, width, dtype=dtype, device=codes.device)
        target = out.view(*lead, blocks, size, width).transpose(-1, -2)  # [..., n/B, w, B], a view
        return _fused_dequantize(codes, block, target, out)
    groups, size = channel_groups(width, group)
    codes = unpack(block.codes, bits, groups * size)
    codes = codes.view(*codes.shape[:-1], groups, size)  # [..., n, G, size]
    if out is None:
        out = torch.empty(*codes.shape[:-2], width, dtype=dtype, device=codes.device)
    if not rotate and groups * size == width:
        return _fused_dequantize(codes, block, out.view(*codes.shape), out)
    x = torch.addcmul(block.zero.float()[..., None], codes, block.scale.float()[..., None])
    if rotate:
        x = x @ rotation(size, x.device).T  # the rotation is orthogonal: its transpose undoes it
    out.copy_(x.flatten(-2)[..., :width])
    return out


def _fused_dequantize(
    codes: torch.Tensor, block: QuantizedBlock, target: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``target = codes·scale + zero`` (one pass, float32 arithmetic, stored in ``target``'s dtype);
    ``target`` is a view of ``out``, which is returned."""
    torch.addcmul(block.zero.float()[..., None], codes, block.scale.float()[..., None], out=target)
    return out


# --------------------------------------------------------------------------- the store


class TokenStore:
    """A growing sequence of token states ``[..., n, w]``: quantized whole blocks, then a float tail.

    With ``sink``, the sequence's first tokens are also kept exact in ``head`` and put back over their
    dequantized copies on every read; inside the first block they are replaced by the token after them
    before quantizing, so their outlier values widen no channel's range. Blocks stay aligned with
    positions (a sink costs its own bytes, nothing more). The tail holds the newest tokens:
    between ``residual`` and ``residual + group − 1`` of them once the sequence is long enough;
    whenever it holds ``residual + group``, its oldest ``group`` tokens become one quantized block.
    ``offset`` counts tokens dropped from the front of the quantized part (razor's sliding window); a
    block is freed once all its tokens are dropped.
    """

    def __init__(self, quant: QuantSpec, per_channel: bool):
        self.quant, self.per_channel = quant, per_channel
        self.rotate = quant.rotate and not per_channel  # keys keep per-channel scales instead
        self._clear()

    def _clear(self) -> None:
        self.head: torch.Tensor | None = None  # exact copies of the first ``sink`` tokens still held
        self.front_dropped = False  # take_front removed the sequence's first tokens: later ones are no sink
        self.blocks = None
        self.quantized_tokens = 0  # tokens in ``blocks``, the dropped ``offset`` included
        self.offset = 0
        self.tail: torch.Tensor | None = None
        self.width = 0

    @property
    def blocks(self) -> QuantizedBlock | None:
        """The quantized tokens (None until a whole block is)."""
        return self._held

    @blocks.setter
    def blocks(self, held: QuantizedBlock | None) -> None:
        self._held = held
        self._blocks_changed()

    def _blocks_changed(self) -> None:
        """Called whenever ``blocks`` is replaced: what a subclass derived from the old ones is stale."""

    # --- reading
    def __len__(self) -> int:
        return self.quantized_tokens - self.offset + (0 if self.tail is None else self.tail.shape[-2])

    def _head_len(self) -> int:
        return 0 if self.head is None else self.head.shape[-2]

    def _dequantize(self, blocks: QuantizedBlock, dtype: torch.dtype) -> torch.Tensor:
        spec = self.quant
        return dequantize_tokens(blocks, spec.bits, spec.group, self.width, self.per_channel, dtype, self.rotate)

    def _dequantize_into(self, blocks: QuantizedBlock, out: torch.Tensor) -> None:
        spec = self.quant
        dequantize_tokens(blocks, spec.bits, spec.group, self.width, self.per_channel, out.dtype, self.rotate, out)

    def read(self, then: torch.Tensor | None = None) -> torch.Tensor:
        """All stored tokens ``[..., n, w]`` in the cache dtype (quantized ones dequantized), followed by
        ``then [..., q, w]`` if given, written once into one new tensor (a decode step reads the whole
        cache this way: no concatenated copies)."""
        assert self.tail is not None, "TokenStore read before its first append"
        if self.blocks is None:
            return self.tail if then is None else torch.cat([self.tail, then], dim=-2)
        quantized, held = self.quantized_tokens, self.tail.shape[-2]
        extra = 0 if then is None else then.shape[-2]
        out = self.tail.new_empty(*self.tail.shape[:-2], quantized + held + extra, self.tail.shape[-1])
        self._dequantize_into(self.blocks, out[..., :quantized, :])
        out[..., quantized : quantized + held, :] = self.tail
        if then is not None:
            out[..., quantized + held :, :] = then
        return self._with_head(out[..., self.offset :, :])  # dropped tokens (< one block) stay unread

    def _with_head(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` (a fresh tensor starting at the oldest held token) with the exact sink put back."""
        if self.head is not None:
            count = min(self.head.shape[-2], tokens.shape[-2])
            tokens[..., :count, :] = self.head[..., :count, :]
        return tokens

    # --- writing
    def extend(self, new: torch.Tensor) -> torch.Tensor:
        """Store ``new [..., q, w]``; return every token, the new ones exact (attention in this step
        reads them before they are quantized)."""
        if not self.quant.quantized:
            self.tail = new if self.tail is None else torch.cat([self.tail, new], dim=-2)
            return self.tail
        tokens = new if self.tail is None else self.read(then=new)
        self.append(new)
        return tokens

    def append(self, new: torch.Tensor) -> None:
        self.width = new.shape[-1]
        take = self.quant.sink - self._head_len() if self.quant.quantized and not self.front_dropped else 0
        if take > 0:
            front = new[..., :take, :].clone()  # a view would keep all of ``new`` alive
            self.head = front if self.head is None else torch.cat([self.head, front], dim=-2)
        self.tail = new if self.tail is None else torch.cat([self.tail, new], dim=-2)
        if not self.quant.quantized:
            return
        group = self.quant.group
        ready = (self.tail.shape[-2] - self.quant.residual) // group * group
        if ready <= 0:
            return
        spec = self.quant
        aged = self.tail[..., :ready, :]
        if self.head is not None and self.quantized_tokens == 0 and not self.front_dropped:
            aged = aged.clone()  # the first block: the sink's stand-in is its successor (sink < group)
            aged[..., : spec.sink, :] = aged[..., spec.sink : spec.sink + 1, :]
        block = self._quantize(aged)
        self.tail = self.tail[..., ready:, :].clone()  # a slice would keep the float tokens alive
        self.blocks = block if self.blocks is None else self._concat(self.blocks, block)
        self.quantized_tokens += ready

    def _concat(self, old: QuantizedBlock, new: QuantizedBlock) -> QuantizedBlock:
        """``old`` followed by ``new`` (later tokens)."""
        code_dim, scale_dim = self._token_dims()
        return QuantizedBlock(
            torch.cat([old.codes, new.codes], dim=code_dim),
            torch.cat([old.scale, new.scale], dim=scale_dim),
            torch.cat([old.zero, new.zero], dim=scale_dim),
            None if old.center is None or new.center is None else torch.cat([old.center, new.center], dim=-2),
        )

    def _quantize(self, tokens: torch.Tensor) -> QuantizedBlock:
        spec = self.quant
        return quantize_tokens(tokens, spec.bits, spec.group, self.per_channel, self.rotate)

    def _token_dims(self) -> tuple[int, int]:
        """The token (per token) or block (per channel) axis of codes and of scale/zero:
        codes [..., n|n/B, ·(, ·)], scales [..., n|n/B, ·]."""
        return (-3 if self.per_channel else -2), -2

    def _blocks(self, start: int, stop: int | None) -> QuantizedBlock:
        """Quantized blocks ``start:stop`` (block indices): codes [..., n/B, w, ·] and scale/zero
        [..., n/B, w] per channel; per token, the tokens of those blocks along ``_token_dims`` (a block is
        ``group`` tokens) and the token layout's block means ``center [..., n/B, d]``."""
        assert self.blocks is not None
        b, group = self.blocks, self.quant.group
        if self.per_channel:
            return QuantizedBlock(
                b.codes[..., start:stop, :, :], b.scale[..., start:stop, :], b.zero[..., start:stop, :]
            )
        code_dim, scale_dim = self._token_dims()  # the token layout's scales are token-last
        first = start * group
        end = self.quantized_tokens if stop is None else min(stop * group, self.quantized_tokens)
        count = end - first
        return QuantizedBlock(b.codes.narrow(code_dim, first, count), b.scale.narrow(scale_dim, first, count),
                              b.zero.narrow(scale_dim, first, count),
                              None if b.center is None else b.center[..., start:stop, :])  # fmt: skip

    def take_front(self, count: int) -> torch.Tensor:
        """Remove and return the oldest ``count`` tokens ``[..., count, w]`` (as stored: dequantized).
        Only the blocks they lie in are dequantized (razor drops a token or two per decode step)."""
        assert self.tail is not None
        if count <= 0:
            return self.tail[..., :0, :]
        self.front_dropped = True
        front = []
        quantized_left = self.quantized_tokens - self.offset
        from_blocks = min(count, quantized_left)
        if from_blocks:
            unit = self._front_unit()  # whole units only: a token-layout key block may pair rows across groups
            blocks = -(-(self.offset + from_blocks) // unit) * (unit // self.quant.group)
            past = self._dequantize(self._blocks(0, blocks), self.tail.dtype)
            front.append(past[..., self.offset : self.offset + from_blocks, :])
            self.offset += from_blocks
        if count > from_blocks:
            cut = count - from_blocks
            front.append(self.tail[..., :cut, :])
            # a view keeps the dropped tokens' storage until the next append copies the tail; worth it
            # for the token or two a sliding window drops per step, not for a prefill's many
            rest = self.tail[..., cut:, :]
            self.tail = rest if cut <= rest.shape[-2] // 16 else rest.clone()
        self._free_dropped_blocks()
        taken = self._with_head(torch.cat(front, dim=-2))  # cat copies: the patch touches no stored tensor
        if self.head is not None:
            self.head = self.head[..., count:, :].clone() if count < self.head.shape[-2] else None
        return taken

    def _front_unit(self) -> int:
        """Tokens freed (and dequantized from the front) at a time: whole blocks."""
        return self.quant.group

    def _free_dropped_blocks(self) -> None:
        if self.blocks is None:
            return
        unit = self._front_unit()
        tokens = self.offset // unit * unit  # in blocks whose every token was dropped
        if tokens == 0:
            return
        if self.quantized_tokens == tokens:
            self.blocks, self.quantized_tokens, self.offset = None, 0, 0
            return
        kept = self._blocks(tokens // self.quant.group, None)
        self.blocks = kept.map(torch.clone)  # copies: slices would keep the dropped blocks' storage alive
        self.quantized_tokens -= tokens
        self.offset -= tokens

    # --- cache protocol
    def apply(self, fn: Any) -> None:
        """Apply ``fn`` (row selection, device move) to every tensor; dim 0 is the batch row."""
        if self.head is not None:
            self.head = fn(self.head)
        if self.tail is not None:
            self.tail = fn(self.tail)
        if self.blocks is not None:
            self.blocks = self.blocks.map(fn)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (re-stored: quantized tokens are re-quantized, which a
        quantizer's own grid reproduces up to fp16 rounding)."""
        if len(self) <= length or self.tail is None:
            return
        kept = self.read()[..., :length, :]
        front_dropped = self.front_dropped
        self._clear()
        self.front_dropped = front_dropped
        self.append(kept)


# --------------------------------------------------------------------------- the token layout
#
# KIVI quantizes keys per channel because a few key channels carry large offsets. Here each block of
# ``group`` tokens keeps its per-channel key mean (float16: 2 bytes per channel per block) and only
# the remainder is quantized per token, after every channel group is rotated by a randomized Hadamard
# matrix that spreads what is left of the outliers over the group (QuaRot, Ashkboos et al. 2024).
# Measured on SmolLM2 (KL to the source through the cache): rotated per-token keys without the means
# lose 1.6× KIVI's, with them 0.7×. Then both sides are in the layout
# torch's own int4 matrix-vector kernel reads (``aten._weight_int4pack_mm_for_cpu``: 4-bit codes,
# a scale and zero per group along the reduced axis): decode scores ``q·Kᵀ`` and outputs ``p·V`` are
# computed from the codes without dequantizing the cache (``kvconvert_quant.token_decode``).
#
# torch's CPU int4 layout of a matrix ``W [N, K]`` (N a multiple of 32) depends on the kernel the CPU
# runs (ATen's ``weight_to_int4pack_kernel``, chosen by the CPU capability: AVX2, AVX-512, or the plain
# loop): ``Int4Rows`` below. Keys are ``W = K [n, d]`` (rows are tokens); values ``W = Vᵀ [size, n]`` per
# channel group (rows are channels), stored as ``[..., d/r, n, r/2]`` so that tokens stay on dim -2 and
# appending a block is one ``cat``. The layout is found once per process by packing a probe with torch's
# own packer (``cpu_int4_rows``); a machine whose layout matches none decodes by dequantizing.


def token_group_size(width: int, group: int) -> int | None:
    """Channels per group of the token layout: the largest multiple of 32 that divides ``width`` and is
    at most ``max(group, 32)``; None when ``width`` is not a multiple of 32 (the layout cannot hold it)."""
    sizes = [s for s in range(32, max(group, 32) + 1, 32) if width % s == 0]
    return sizes[-1] if sizes else None


@dataclass(frozen=True)
class Int4Rows:
    """One of torch's CPU int4 layouts of ``W [N, K]``: rows in blocks of ``block``, each block stored as
    ``K × block/2`` bytes; byte j of a block's column k holds rows (j, j + block/2) when ``halves`` (AVX2:
    32, AVX-512: 64), rows (2j, 2j + 1) otherwise (the plain loop), the first in the low nibble. A last
    block shorter than ``block`` rows is always stored pairwise (what torch's packer does)."""

    block: int
    halves: bool

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [..., N, K]`` (uint8 < 16, N and K even) -> ``[..., N, K/2]``."""
        return self._by_blocks(codes, _pack_blocks)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Inverse of ``pack``."""
        return self._by_blocks(packed, _unpack_blocks)

    def _by_blocks(self, rows: torch.Tensor, fn: Any) -> torch.Tensor:
        """``fn(rows, block, halves)`` over the whole blocks, then pairwise over a shorter last block."""
        full = rows.shape[-2] // self.block * self.block
        parts = [fn(rows[..., :full, :], self.block, self.halves)] if full else []
        if full < rows.shape[-2]:
            parts.append(fn(rows[..., full:, :], rows.shape[-2] - full, False))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


def _pack_blocks(codes: torch.Tensor, block: int, halves: bool) -> torch.Tensor:
    *lead, n, k = codes.shape
    x = codes.reshape(*lead, n // block, block, k)
    low, high = (x[..., : block // 2, :], x[..., block // 2 :, :]) if halves else (x[..., 0::2, :], x[..., 1::2, :])
    packed = low | (high << 4)  # [..., N/block, block/2, K]
    return packed.transpose(-1, -2).reshape(*lead, n, k // 2)


def _unpack_blocks(packed: torch.Tensor, block: int, halves: bool) -> torch.Tensor:
    *lead, n, half = packed.shape
    b = packed.reshape(*lead, n // block, 2 * half, block // 2).transpose(-1, -2)  # [..., N/block, block/2, K]
    low, high = b & 15, b >> 4
    rows = torch.cat([low, high], dim=-2) if halves else torch.stack([low, high], dim=-2)
    return rows.reshape(*lead, n, 2 * half)


# Every layout torch's packer is known to produce (AVX2, AVX-512, the plain loop at two vector widths);
# the first is the one stores use where the machine's kernel cannot read them (dequantized anyway).
INT4_ROW_LAYOUTS = (Int4Rows(32, True), Int4Rows(64, True), Int4Rows(32, False), Int4Rows(16, False),
                    Int4Rows(64, False))  # fmt: skip


@functools.cache
def cpu_int4_rows() -> Int4Rows | None:
    """The layout this process's CPU int4 kernel reads, or None (no kernel, or an unknown layout).

    Found, not assumed: a probe of 96 × 64 codes (a 64-row block and a short one) is packed by torch's
    own ``_convert_weight_to_int4pack_for_cpu`` and compared with each known layout, and the matching
    layout must then give ``_weight_int4pack_mm_for_cpu`` the product of the dequantized probe. So a
    CPU whose packing differs decodes by dequantizing instead of misreading the codes."""
    aten = torch.ops.aten
    if not (hasattr(aten, "_convert_weight_to_int4pack_for_cpu") and hasattr(aten, "_weight_int4pack_mm_for_cpu")):
        return None
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (96, 64), dtype=torch.uint8, generator=generator)
    x = torch.randn(2, 64, generator=generator).to(torch.bfloat16)
    pairs = torch.rand(2, 96, 2, generator=generator).to(torch.bfloat16)  # (scale, zero) per row and group of 32
    try:
        packed = aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
        got = aten._weight_int4pack_mm_for_cpu(x, packed, 32, pairs).float()
    except RuntimeError:
        return None
    layout = next((rows for rows in INT4_ROW_LAYOUTS if torch.equal(rows.pack(codes), packed)), None)
    scale, zero = pairs.float().unbind(-1)  # [2, 96] each
    weight = (codes.float() - 8).view(96, 2, 32) * scale.T[..., None] + zero.T[..., None]
    expected = x.float() @ weight.view(96, 64).T
    return layout if torch.allclose(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item()) else None


def _token_layout_groups(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x [..., n, w]`` -> rotated channel groups ``[..., n, w/size, size]`` float32."""
    return x.float().reshape(*x.shape[:-1], -1, size) @ rotation(size, x.device)


def _kernel_groups(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit codes of each row of ``x [..., g]`` (float32) in the int4 kernel's convention
    ``x ≈ (code − 8)·scale + zero``: codes ``[..., g]`` uint8, ``scale`` rounded up to ``dtype`` (the grid
    covers the row's range) and ``zero`` the value of code 8, both ``[...]`` in ``dtype``."""
    low, high = x.amin(-1), x.amax(-1)
    scale = _round_up((high - low) / 15, dtype)
    zero = (low + 8 * scale.float()).to(dtype)
    codes = ((x - zero.float()[..., None]) / scale.float()[..., None] + 8).round_().clamp_(0, 15)
    return codes.to(torch.uint8), scale, zero


class TokenLayoutStore(TokenStore):
    """``TokenStore`` in the token layout (see above), 4-bit.

    Keys: ``center [..., n/B, d]`` float16 (each block's per-channel mean), codes ``[..., n, d/2]``
    (int4 rows) and bfloat16 scales and zeros in the kernel's convention
    ``x − center ≈ (code − 8)·scale + zero``, held as the kernel reads them: ``scale`` is the
    ``(scale, zero)`` pairs ``[..., G, n, 2]`` and ``zero`` an empty ``[..., G, n, 0]`` (a decode step
    would otherwise stack the pairs anew in every layer). Values: codes ``[..., d/r, n, r/2]``
    (``Vᵀ``'s int4 rows per channel group, r rows per block), ``scale``/``zero [..., G, n]`` float16
    in the same convention (the scale multiplies attention probabilities, not the codes, so it stays
    float16; ``zero`` is the value of code 8, which a decode step adds as is). Both rotated per group
    of ``size`` channels. ``rows``: the int4 layout, the machine's kernel's where it can hold this store
    (``kernel_reads``). Sinks, residual tokens, cropping, row selection and dropping from the front as in
    ``TokenStore``: dropped tokens stay in their block, masked by ``token_decode``, until the whole unit
    (``_front_unit``) is dropped; razor's windows drop whole units only (``whole_front``)."""

    def __init__(self, quant: QuantSpec, keys: bool):
        super().__init__(quant, per_channel=False)
        self.keys, self.rotate = keys, True
        self.rows: Int4Rows | None = None  # chosen at the first block, when the width is known

    def _blocks_changed(self) -> None:
        self._operands: list[tuple[torch.Tensor, ...]] | None = None

    def kernel_operands(self) -> list[tuple[torch.Tensor, ...]]:
        """The int4 kernel's operands, views of ``blocks``: keys ``(codes [n, d/2], pairs [G, n, 2])`` per
        (row, KV head); values ``(Vᵀ codes [size, n/2],)`` per (row, KV head, channel group). Split once
        per change of the blocks (every ``group`` tokens), not by every layer's decode step."""
        if self._operands is None:
            held = self.blocks
            assert held is not None
            # contiguous: the AVX-512 kernel refuses strided codes (AVX2's reads them); a no-op when they are
            if self.keys:
                pairs = held.scale.flatten(0, 1).unbind(0)
                key_codes = [c.contiguous() for c in held.codes.flatten(0, 1).unbind(0)]
                self._operands = list(zip(key_codes, pairs, strict=True))
            else:
                codes = held.codes.reshape(-1, self.group_size(), held.codes.shape[-2] // 2)  # [b·Hkv·G, size, n/2]
                self._operands = [(matrix.contiguous(),) for matrix in codes.unbind(0)]
        return self._operands

    def group_size(self) -> int:
        size = token_group_size(self.width, self.quant.group)
        if size is None:
            raise ValueError(f"the token layout needs a head width that is a multiple of 32, got {self.width}")
        return size

    def kernel_reads(self) -> bool:
        """The codes are in the layout this machine's int4 kernel reads."""
        return self.rows is not None and self.rows == cpu_int4_rows()

    def _layout(self) -> Int4Rows:
        if self.rows is None:
            machine, size = cpu_int4_rows(), self.group_size()
            # a value group's rows are one matrix per group: whole blocks, or one short (pairwise) block
            fits = machine is not None and (self.keys or size % machine.block == 0 or size < machine.block)
            self.rows = machine if machine is not None and fits else INT4_ROW_LAYOUTS[0]
        return self.rows

    def _value_block(self, size: int) -> int:
        """Rows per stored block of a value group: the layout's block, or the whole group if shorter."""
        return min(self._layout().block, size)

    def _quantize(self, tokens: torch.Tensor) -> QuantizedBlock:
        size, rows = self.group_size(), self._layout()
        if not self.keys:
            codes, scale, zero = _kernel_groups(_token_layout_groups(tokens, size), torch.float16)  # [..., n, G, size]
            packed = rows.pack(codes.permute(*range(codes.dim() - 3), -2, -1, -3))  # Vᵀ per group: [..., G, size, n/2]
            r = self._value_block(size)
            codes = packed.reshape(*packed.shape[:-3], -1, tokens.shape[-2], r // 2)
            # scales token-last, as the keys': a decode step multiplies them into [.., G, n] probabilities
            return QuantizedBlock(codes, scale.transpose(-1, -2).contiguous(), zero.transpose(-1, -2).contiguous())
        *lead, n, width = tokens.shape
        blocks = tokens.float().reshape(*lead, n // self.quant.group, self.quant.group, width)
        center = blocks.mean(-2).half()  # [..., n/B, d]
        x = _token_layout_groups((blocks - center.float()[..., None, :]).reshape(*lead, n, width), size)
        codes, scale, zero = _kernel_groups(x, torch.bfloat16)
        pairs = torch.stack([scale.transpose(-1, -2), zero.transpose(-1, -2)], dim=-1)  # [..., G, n, 2]
        return QuantizedBlock(rows.pack(codes.flatten(-2)), pairs, pairs[..., :0], center)

    def _concat(self, old: QuantizedBlock, new: QuantizedBlock) -> QuantizedBlock:
        rows = self._layout()
        start = old.codes.shape[-2] // rows.block * rows.block
        if self.keys and start < old.codes.shape[-2]:  # the last key block was short (pairwise): pack it anew
            merged = torch.cat([rows.unpack(old.codes[..., start:, :]), rows.unpack(new.codes)], dim=-2)
            old = dataclasses.replace(old, codes=old.codes[..., :start, :])
            new = dataclasses.replace(new, codes=rows.pack(merged))
        return super()._concat(old, new)

    def _token_dims(self) -> tuple[int, int]:
        return -2, (-2 if self.keys else -1)

    def _dequantize(self, blocks: QuantizedBlock, dtype: torch.dtype) -> torch.Tensor:
        size, rows = self.group_size(), self._layout()
        if self.keys:
            codes = rows.unpack(blocks.codes).float()  # [..., n, d]
            scale, zero = blocks.scale.transpose(-2, -3).float().unbind(-1)  # the pairs: [..., n, G] each
            x = (codes.reshape(*codes.shape[:-1], -1, size) - 8) * scale[..., None] + zero[..., None]
            assert blocks.center is not None
            centers = blocks.center.float().repeat_interleave(self.quant.group, dim=-2)  # [..., n, d]
            return ((x @ rotation(size, x.device).T).flatten(-2) + centers).to(dtype)
        *lead, stored, n, _ = blocks.codes.shape
        groups = stored * self._value_block(size) // size
        codes = rows.unpack(blocks.codes.reshape(*lead, groups, size, n // 2))  # [..., G, size, n]
        codes = codes.permute(*range(len(lead)), -1, -3, -2).float()  # [..., n, G, size]
        scale, zero = blocks.scale.transpose(-1, -2).float(), blocks.zero.transpose(-1, -2).float()
        x = (codes - 8) * scale[..., None] + zero[..., None]
        return (x @ rotation(size, x.device).T).flatten(-2).to(dtype)

    def _dequantize_into(self, blocks: QuantizedBlock, out: torch.Tensor) -> None:
        out.copy_(self._dequantize(blocks, out.dtype))

    def _front_unit(self) -> int:
        # key rows are packed in blocks of up to 64 tokens (AVX-512 pairs rows j and j + 32): a cut falls on
        # both a block mean's and any packing block's boundary, the same for keys and values (one token count)
        return math.lcm(self.quant.group, max(rows.block for rows in INT4_ROW_LAYOUTS))

    def whole_front(self, count: int) -> int:
        """How many of the oldest ``count`` tokens to drop so that only whole units leave the quantized part."""
        # Razor's windows in this layout slide by whole units: a token leaving one by one would be
        # dequantized from its block at every step (~25 small ops per store: 15 ms of a 4K decode step
        # of SmolLM2 on 2 cores), or its unit kept dequantized in float (more bytes than the window's
        # codes at 1.5K tokens). So up to a unit − 1 tokens stay attended past the window's length L,
        # as stored, and a unit is dequantized once, into the compensation token, when it leaves.
        quantized_left = self.quantized_tokens - self.offset
        if count >= quantized_left:  # everything quantized goes (and some of the float tail): blocks freed
            return count
        unit = self._front_unit()
        return max(0, (self.offset + count) // unit * unit - self.offset)


def select_rows_fn(index: torch.Tensor) -> Any:
    """``fn`` for ``TokenStore.apply`` and friends: new row i is old row ``index[i]``."""
    return lambda t: t.index_select(0, index.to(t.device))


class KVLayer(DynamicLayer):
    """Base of every kvconvert cache layer: the batch edits that generate() makes (beam reordering,
    batch selection and repetition) are all ``select_rows``; ``crop_to``, ``apply`` and
    ``get_seq_length`` complete the protocol. Subclasses hold their state however they like."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep / repeat / reorder batch rows: new row i is old row ``index[i]``. By default every state
        tensor has the batch on dim 0; a layer whose state is indexed otherwise overrides this."""
        self.apply(select_rows_fn(index))

    def rows(self) -> int:
        """Batch rows held (0 before the first update)."""
        raise NotImplementedError

    def crop_to(self, length: int) -> None:
        """Keep the first ``length`` tokens."""
        raise NotImplementedError

    def apply(self, fn: Any) -> None:
        """Apply ``fn`` to every state tensor (device moves)."""
        raise NotImplementedError

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.rows():
            self.select_rows(torch.as_tensor(indices).reshape(-1))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.rows():
            self.select_rows(torch.arange(self.rows()).repeat_interleave(repeats))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.rows():
            self.select_rows(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop() takes a negative number of tokens to remove")
        if tokens_to_remove:
            self.crop_to(max(0, self.get_seq_length() + tokens_to_remove))

    def offload(self) -> None:
        if self.is_initialized:
            self.apply(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized:
            self.apply(lambda t: t.to(self.device, non_blocking=True))


class QuantizedLayer(KVLayer):
    """A stock attention layer's ``[b, Hkv, n, d]`` keys and values in quantized storage: keys per
    channel, values per token. ``update`` returns the past (dequantized) with this step's exact states."""

    def __init__(self, quant: QuantSpec, layer: int = 0):
        super().__init__()
        self.quant, self.layer = quant, layer
        self.reset()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
        return self.key_store.extend(key_states), self.value_store.extend(value_states)

    def get_seq_length(self) -> int:
        return len(self.key_store)

    def rows(self) -> int:
        return 0 if self.key_store.tail is None else self.key_store.tail.shape[0]

    def crop_to(self, length: int) -> None:
        self.key_store.crop(length)
        self.value_store.crop(length)

    def apply(self, fn: Any) -> None:
        self.key_store.apply(fn)
        self.value_store.apply(fn)

    def reset(self) -> None:
        self.key_store = TokenStore(self.quant.side(self.layer, keys=True), per_channel=True)
        self.value_store = TokenStore(self.quant.side(self.layer, keys=False), per_channel=False)
        self.keys = self.values = None
        self.is_initialized = False


def stock_layer(quant: QuantSpec, layer: int) -> DynamicLayer:
    """The cache layer of a layer a method leaves untouched: transformers' own, or quantized."""
    quantized = quant.side(layer, keys=True).quantized or quant.side(layer, keys=False).quantized
    return QuantizedLayer(quant, layer) if quantized else DynamicLayer()


class QuantizedSlidingLayer(QuantizedLayer):
    """``QuantizedLayer`` for a sliding-window layer: like transformers' ``DynamicSlidingWindowLayer``
    it keeps the newest ``window − 1`` tokens after each step (older blocks are freed as they leave)
    and gives the masks the same sizes."""

    is_sliding = True

    def __init__(self, quant: QuantSpec, layer: int, window: int):
        self.sliding_window = window
        super().__init__(quant, layer)

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        keys, values = super().update(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        excess = len(self.key_store) - (self.sliding_window - 1)
        if excess > 0:
            self.key_store.take_front(excess)
            self.value_store.take_front(excess)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv length, kv offset) of the attention mask, as ``DynamicSlidingWindowLayer`` gives them."""
        offset = max(self.cumulative_length - self.sliding_window + 1, 0)
        held = min(self.cumulative_length, self.sliding_window - 1)
        return held + query_length, offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def crop_to(self, length: int) -> None:
        if length < self.cumulative_length:
            raise ValueError("a sliding-window cache cannot be cropped: the tokens it dropped are gone")


def sliding_layer(spec: dict[str, Any], layer: int) -> DynamicLayer | None:
    """The cache layer of a sliding-window layer between global ones (Gemma 2/3): transformers' own,
    which already holds at most the window, or a quantized one when the storage includes local
    layers. None for a global layer."""
    if layer not in (spec.get("local_layers") or ()):
        return None
    quant, window = QuantSpec.from_spec(spec), int(spec["sliding_window"])
    if quant.include_local and quant.quantized:
        return QuantizedSlidingLayer(quant, layer, window)
    return DynamicSlidingWindowLayer(window)
