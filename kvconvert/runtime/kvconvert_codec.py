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
  own scale, and rotating them measured no better. ``rotate_in_weights``: ``quant`` folded the rotation into
  W_V and W_O (QuaRot's offline form), so values arrive rotated, are stored and read as they are, and attention's
  output is rotated back by W_O: a decode step no longer rotates every cached value back.

``bits == 16`` means no quantization: the store is a plain growing tensor (today's behaviour).

``format == "fp8"`` is the serving engines' storage instead (vLLM, SGLang: compressed-tensors'
``kv_cache_scheme``): every token's keys and values as float8 e4m3 after dividing by a static scale
calibrated per layer (``tensor``) or per KV head (``head``), no groups, no exact tokens; ``fp8_store``
and ``fp8_read`` below are its numerics, the engines' and compressed-tensors' own.
Copied verbatim into every output directory; imports only torch and transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from .kvconvert_packing import pack, packed_width, unpack

BITS = (16, 8, 4, 3, 2)
LAYOUTS = ("kivi", "token")
FORMATS = ("int", "fp8")
SCALE_STRATEGIES = ("tensor", "head")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value: a calibrated amax maps onto it


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
    format: str = "int"  # "fp8": float8 e4m3 with static scales, the engines' format (module docstring)
    scale_strategy: str = "tensor"  # fp8: one scale per layer ("tensor") or per KV head ("head")
    # fp8, once calibrated: per layer (key scales, value scales), one per KV head or one for the layer
    scales: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...] | None = None
    rotate_in_weights: bool = False  # the values' rotation is folded into W_V / W_O (module docstring)
    # sliding-window layers' width when they are quantized too (``include_local``); None: ``bits``. Their caches hold
    # at most a window, so a wider width there costs little at long context, and on Gemma 3 270M the windows lost
    # the needles at 3 bits where the global layers did not (README, long-context tasks)
    local_bits: int | None = None
    # the values' width apart from the keys' ``bits`` (every layer but sliding-window ones with ``local_bits``); None:
    # ``bits``. Keys are stored per channel because of their outlier channels and are the side whose error the
    # softmax amplifies, so values often take fewer bits for the same loss (KIVI, KVQuant)
    value_bits: int | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS or self.scale_strategy not in SCALE_STRATEGIES:
            raise ValueError(f"kv format must be one of {FORMATS} and kv scale strategy one of {SCALE_STRATEGIES}, "
                             f"got {self.format!r}, {self.scale_strategy!r}")  # fmt: skip
        if self.format == "fp8":
            # fp8 stores every token alike at one width: the integer options have nothing to act on
            if (
                self.bits != 8
                or self.layers is not None
                or self.local_bits is not None
                or self.value_bits is not None
                or self.residual
                or self.sink
                or self.rotate
                or self.layout != "kivi"
            ):
                raise ValueError("fp8 storage holds every token and layer at 8 bits, as the engines do: it takes "
                                 "no --kv-bits but 8, no widths per layer, --kv-local-bits, --kv-value-bits, "
                                 "--kv-residual, --kv-sink, --kv-rotate or --kv-layout")  # fmt: skip
            return
        extra = tuple(b for b in (self.local_bits, self.value_bits) if b is not None)
        for bits in (self.bits, *extra, *(b for pair in self.layers or () for b in pair)):
            if bits not in BITS:
                raise ValueError(f"kv bits must be one of {BITS}, got {bits}")
        if self.local_bits is not None and not (self.include_local and self.layers is None):
            raise ValueError("kv local bits (the sliding-window layers' width) need --kv-include-local and one width "
                             "for the other layers")  # fmt: skip
        if self.value_bits is not None and (self.value_bits == 16 or self.layers is not None):
            raise ValueError("kv value bits (the values' width apart from the keys') are 8, 4, 3 or 2, with one width "
                             "per side for every layer")  # fmt: skip
        if self.local_bits == 3 and self.group % 8:
            raise ValueError(f"3-bit keys pack 8 tokens in 3 bytes: kv group must be a multiple of 8, got {self.group}")
        if self.group < 1 or self.residual < 0 or self.sink < 0:
            raise ValueError(f"kv group must be >= 1, residual and sink >= 0, got {self.group}, {self.residual}, "
                             f"{self.sink}")  # fmt: skip
        if self.sink >= self.group:
            raise ValueError(f"kv sink ({self.sink}) must be smaller than the kv group ({self.group})")
        if self.bits == 3 and self.group % 8 and self.layers is None:
            raise ValueError(f"3-bit keys pack 8 tokens in 3 bytes: kv group must be a multiple of 8, got {self.group}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"kv layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.rotate_in_weights and not (self.rotate and self.layout == "kivi"):
            raise ValueError("values rotated in the weights need --kv-rotate and KIVI's layout")
        if self.layout == "token" and (self.bits != 4 or self.layers is not None or self.group % 32):
            raise ValueError("the token layout is 4-bit storage (one width for every layer) with a kv group that is a "
                             f"multiple of 32; got {self.bits} bits, group {self.group}"
                             + (", widths per layer" if self.layers is not None else ""))  # fmt: skip

    @property
    def fp8(self) -> bool:
        return self.format == "fp8"

    @property
    def rotates_values(self) -> bool:
        """The stores rotate values themselves (``rotate``, not folded into the weights)."""
        return self.rotate and not self.rotate_in_weights

    @property
    def quantized(self) -> bool:
        extra = (b for b in (self.local_bits, self.value_bits) if b is not None)
        return self.bits < 16 or any(b < 16 for b in extra) or any(b < 16 for pair in self.layers or () for b in pair)

    def for_local(self) -> QuantSpec:
        """A sliding-window layer's storage if quantized (``include_local``): KIVI's layout (SDPA reads it whole)."""
        if self.local_bits is None:
            return self
        return dataclasses.replace(self, bits=self.local_bits, local_bits=None, value_bits=None, layout="kivi")

    def side(self, layer: int, keys: bool) -> QuantSpec:
        """The uniform storage of one layer's keys (or values)."""
        if self.layers is None:
            if self.value_bits is None:
                return self
            if self.layout == "token" and not keys:
                # token-layout keys beside values of their own width: the values per token as KIVI stores them,
                # rotated as the token layout's are (torch's int4 kernel reads 4 bits only)
                return dataclasses.replace(self, bits=self.value_bits, value_bits=None, layout="kivi", rotate=True)
            return dataclasses.replace(self, bits=self.bits if keys else self.value_bits, value_bits=None)
        return dataclasses.replace(self, bits=self.layers[layer][0 if keys else 1], layers=None)

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> QuantSpec:
        """The storage a checkpoint's runtime spec asks for (none written: 16 bits)."""
        entry = spec.get("kv_quant") or {}
        layers = entry.get("layers")
        residual = 0 if entry.get("format") == "fp8" else 128
        return cls(int(entry.get("bits", 16)), int(entry.get("group", 64)), int(entry.get("residual", residual)),
                   None if layers is None else tuple((int(k), int(v)) for k, v in layers),
                   int(entry.get("sink", 0)), bool(entry.get("rotate", False)),
                   bool(entry.get("include_local", False)), str(entry.get("layout", "kivi")),
                   str(entry.get("format", "int")), str(entry.get("scale_strategy", "tensor")),
                   None if entry.get("scales") is None else tuple(
                       (tuple(map(float, k)), tuple(map(float, v))) for k, v in entry["scales"]),
                   bool(entry.get("rotate_in_weights", False)),
                   None if entry.get("local_bits") is None else int(entry["local_bits"]),
                   None if entry.get("value_bits") is None else int(entry["value_bits"]))  # fmt: skip

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any]
        if self.fp8:
            spec = {"bits": 8, "format": "fp8", "scale_strategy": self.scale_strategy}
            if self.scales is not None:
                spec["scales"] = [[list(k), list(v)] for k, v in self.scales]
            return spec
        spec = {
            "bits": self.bits,
            "group": self.group,
            "residual": self.residual,
        }
        if self.layers is not None:
            spec["layers"] = [list(pair) for pair in self.layers]
        if self.sink:
            spec["sink"] = self.sink
        if self.rotate:
            spec["rotate"] = True
        if self.rotate_in_weights:
            spec["rotate_in_weights"] = True
        if self.include_local:
            spec["include_local"] = True
        if self.local_bits is not None:
            spec["local_bits"] = self.local_bits
        if self.value_bits is not None:
            spec["value_bits"] = self.value_bits
        if self.layout != "kivi":
            spec["layout"] = self.layout
        return spec

    def bytes_per_value(self, width: int, per_channel: bool) -> float:
        """Accounted bytes per stored value of a ``width``-wide state (codes + fp16 scale and zero)."""
        if not self.quantized:
            return 2.0
        if self.fp8:
            return 1.0  # the scales are per layer or head: nothing per token
        if self.layout == "token":  # per token in groups of ``size`` channels; keys add their block means
            size = token_group_size(width, self.group) or width
            return 0.5 + 4 / size + (2 / self.group if per_channel else 0.0)
        if per_channel:
            return (packed_width(self.group, self.bits) + 4) / self.group
        groups, size = channel_groups(width, self.group)
        return (packed_width(groups * size, self.bits) + 4 * groups) / width


# --------------------------------------------------------------------------- pure functions


def fp8_store(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [b, Hkv, n, d]`` as float8 e4m3 codes of ``x / scale`` (``scale [Hkv]`` or ``[1]``), saturating
    at ±448 as the engines do (a token past the calibrated range clamps instead of becoming NaN)."""
    scaled = x.float() / scale.float().view(1, -1, 1, 1)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def eager_on_cpu(device: torch.device) -> bool:
    """A step running eagerly on a CPU: a count is free to read there, and a Python branch on it costs nothing, where
    a compiled or captured step (or a GPU, which would wait for the read) keeps fixed shapes and tensor ops."""
    return device.type == "cpu" and not torch.compiler.is_compiling()


def fp8_read(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values ``fp8_store`` codes stand for, in ``dtype``: code × scale in float32, rounded once to ``dtype``. On a
    CPU the codes are widened by moving bits (``fp8_as_half``): torch converts float8 there one element at a time."""
    per_head = scale.float().view(1, -1, 1, 1)
    if eager_on_cpu(codes.device):  # Inductor emits its own conversion
        # (code / 256) · (scale · 256): powers of two, so the same float32 product as code · scale
        return fp8_as_half(codes).float().mul_(per_head * 256).to(dtype)
    return (codes.float() * per_head).to(dtype)


def fp8_as_half(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (float8 or their bytes) as float16 values 256 times smaller, exactly, by moving bits: e4m3's 4-bit
    exponent (bias 7) sits in float16's 5-bit one (bias 15) as exponent + 8 with room to spare, its 3 mantissa bits
    at the top of float16's 10, and its subnormals (m·2⁻⁹) land on float16's subnormals (m·2⁻¹⁷), so every finite
    code is exact (the NaN codes, which ``fp8_store`` never writes, read as 480). On 2 CPU cores 0.34 ms instead of
    torch's 1.6 ms float8 conversion for 3 heads × 4096 tokens × 64 channels (measured)."""
    # sign-extended to 16 bits, shifted by 7: the sign lands on bits 14 and 15, exponent and mantissa on 7..13;
    # clearing bit 14 (& 0xBFFF) leaves the float16 bit pattern
    bits = codes.view(torch.int8).to(torch.int16)
    return bits.bitwise_left_shift_(7).bitwise_and_(-16385).view(torch.float16)


def _round_down(x: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The largest ``dtype`` value ≤ x (x float32): the zero point must not exceed the group minimum. On float32's
    bits, as ``round_up`` rounds: a cast down compared with x cast back up is what Inductor keeps in float32, which
    gave a compiled step other zero points (and scales) than an eager one, a few per block."""
    info = torch.finfo(dtype)
    x = x.float().clamp(-info.max, info.max)
    drop = (1 << (23 - round(-math.log2(info.eps)))) - 1  # float32 mantissa bits that ``dtype`` lacks
    magnitude = x.abs().contiguous().view(torch.int32)
    # toward −∞: a positive value's magnitude truncated, a negative one's rounded up
    down = torch.where(x >= 0, magnitude & ~drop, (magnitude + drop) & ~drop).view(torch.float32)
    down = torch.where(x >= 0, down, -down)
    if info.tiny > torch.finfo(torch.float32).tiny:  # float16 below its smallest normal: steps of its least subnormal
        step = info.tiny * info.eps
        down = torch.where(x.abs() < info.tiny, torch.floor(x / step) * step, down)
    return down.to(dtype)  # exact


def round_up(x: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The smallest positive ``dtype`` value ≥ x (x ≥ 0 float32; ``dtype``'s largest above it): the scale must cover
    the group's range. Rounded on float32's bits, not by casting down and comparing: Inductor keeps a value it casts
    down and back up in float32 (no rounding), which left half the scales of a compiled step too small."""
    info = torch.finfo(dtype)
    x = x.float().clamp(max=info.max)
    drop = (1 << (23 - round(-math.log2(info.eps)))) - 1  # float32 mantissa bits that ``dtype`` lacks
    up = ((x.contiguous().view(torch.int32) + drop) & ~drop).view(torch.float32)
    if info.tiny > torch.finfo(torch.float32).tiny:  # float16 below its smallest normal: steps of its least subnormal
        step = info.tiny * info.eps
        up = torch.where(x < info.tiny, torch.ceil(x / step) * step, up)
    h = up.to(dtype)  # exact
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
    scale = round_up((high - zero.float()) / levels)
    codes = ((x - zero.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, levels)
    return codes.to(torch.uint8), scale, zero


def rotation(size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """An orthogonal ``[size, size]`` float32 matrix that spreads every channel over the group: a
    Hadamard matrix with random column signs (fixed seed) where ``size`` is a power of two, else the
    Q of a seeded Gaussian's QR. Only ever applied and undone inside one runtime, so nothing about
    it is stored. Built once per (size, device) (on a GPU each build was a blocking host copy per
    layer per step); callers must not modify it."""
    if torch.compiler.is_compiling():  # dynamo warns about functools caches; the table is traced as a constant
        return _rotation_table(size, device)
    return _rotation_cached(size, device)


def _rotation_table(size: int, device: torch.device | str) -> torch.Tensor:
    key = (size, str(torch.device(device)))
    if key not in _ROTATIONS:
        _ROTATIONS[key] = _build_rotation(size).to(device)
    return _ROTATIONS[key]


# eager callers (every layer, every step) skip building the key
_rotation_cached = functools.cache(_rotation_table)


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
    zero, scale = block.zero.float()[..., None], block.scale.float()[..., None]
    if torch.compiler.is_compiling():  # dynamo takes no strided out=; inductor fuses the copy into the product
        target.copy_(torch.addcmul(zero, codes, scale))
    else:
        torch.addcmul(zero, codes, scale, out=target)
    return out


def token_group_size(width: int, group: int) -> int | None:
    """Channels per group of the token layout: the largest multiple of 32 that divides ``width`` and is
    at most ``max(group, 32)``; None when ``width`` is not a multiple of 32 (the layout cannot hold it)."""
    sizes = [s for s in range(32, max(group, 32) + 1, 32) if width % s == 0]
    return sizes[-1] if sizes else None
