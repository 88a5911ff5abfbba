"""Quantized storage for every kvconvert cache (KIVI's layout: Liu et al. 2024).

Whatever a method caches — stock K/V, slim's pre-RoPE keys, LoRC latents, ZACK's packed columns,
razor's kept tokens, MiniCache's shared directions — is a sequence of token states ``[..., n, w]``
(tokens on dim -2). ``TokenStore`` holds such a sequence:

- tensors that feed attention scores (keys, key latents) are quantized **per channel** over blocks
  of ``group`` tokens (key outlier channels get their own scale); values **per token** over groups of
  at most ``group`` channels;
- asymmetric integers: ``x ≈ zero + code·scale`` with ``code ∈ [0, 2^bits − 1]``, fp16 scale and zero
  per group; 4-bit codes packed two per byte and 2-bit four per byte into real ``uint8`` tensors;
- the newest ``residual`` tokens (and the partial block behind them) stay in the cache dtype and are
  quantized one block at a time as they age, so recent tokens are exact.

``bits == 16`` means no quantization: the store is a plain growing tensor (today's behaviour).
Copied verbatim into every output directory; imports only torch and transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

BITS = (16, 8, 4, 2)


@dataclass(frozen=True)
class QuantSpec:
    """``config.kvconvert["kv_quant"]``: bits per stored value, group size, unquantized recent tokens,
    and optionally per layer (key bits, value bits) — mixed precision allocated by measured loss —
    which then overrides ``bits``."""

    bits: int = 16
    group: int = 64
    residual: int = 128
    layers: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        for bits in (self.bits, *(b for pair in self.layers or () for b in pair)):
            if bits not in BITS:
                raise ValueError(f"kv bits must be one of {BITS}, got {bits}")
        if self.group < 1 or self.residual < 0:
            raise ValueError(f"kv group must be >= 1 and residual >= 0, got {self.group}, {self.residual}")

    @property
    def quantized(self) -> bool:
        return self.bits < 16 or any(b < 16 for pair in self.layers or () for b in pair)

    def side(self, layer: int, keys: bool) -> QuantSpec:
        """The uniform storage of one layer's keys (or values)."""
        if self.layers is None:
            return self
        return QuantSpec(self.layers[layer][0 if keys else 1], self.group, self.residual)

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> QuantSpec:
        """The storage a checkpoint's runtime spec asks for (none written: 16 bits)."""
        entry = spec.get("kv_quant") or {}
        layers = entry.get("layers")
        return cls(int(entry.get("bits", 16)), int(entry.get("group", 64)), int(entry.get("residual", 128)),
                   None if layers is None else tuple((int(k), int(v)) for k, v in layers))  # fmt: skip

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"bits": self.bits, "group": self.group, "residual": self.residual}
        if self.layers is not None:
            spec["layers"] = [list(pair) for pair in self.layers]
        return spec

    def bytes_per_value(self, width: int, per_channel: bool) -> float:
        """Accounted bytes per stored value of a ``width``-wide state (codes + fp16 scale and zero)."""
        if not self.quantized:
            return 2.0
        if per_channel:
            return self.bits / 8 + 4 / self.group
        groups = math.ceil(width / self.group)
        padded = groups * math.ceil(width / groups)
        per_byte = 8 // self.bits
        return (math.ceil(padded / per_byte) + 4 * groups) / width


# --------------------------------------------------------------------------- pure functions


def _round_down_fp16(x: torch.Tensor) -> torch.Tensor:
    """The largest fp16 value ≤ x (x float32): the zero point must not exceed the group minimum."""
    h = x.clamp(-65504, 65504).half()
    too_big = h.float() > x
    return torch.where(too_big, torch.nextafter(h, h.new_full((), -math.inf)), h)


def _round_up_fp16(x: torch.Tensor) -> torch.Tensor:
    """The smallest positive fp16 value ≥ x (x ≥ 0 float32): the scale must cover the group's range."""
    h = x.clamp(max=65504).half()
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
    zero = _round_down_fp16(low)
    scale = _round_up_fp16((high - zero.float()) / levels)
    codes = ((x - zero.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, levels)
    return codes.to(torch.uint8), scale, zero


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [..., w]`` uint8 < 2^bits -> ``[..., ceil(w·bits/8)]`` uint8, element i in bits i·b… of its byte."""
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
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed[..., None] >> shifts) & (2**bits - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :width]


def channel_groups(width: int, group: int) -> tuple[int, int]:
    """(groups, group size) for per-token groups over ``width`` channels: equal groups of at most
    ``group`` channels, so a width that ``group`` does not divide pads fewer than ``groups`` channels."""
    groups = math.ceil(width / group)
    return groups, math.ceil(width / groups)


@dataclass
class QuantizedBlock:
    """Quantized tokens ``[..., n, w]``. Per channel: ``codes [..., n/B, w, B·bits/8]``, scale/zero
    ``[..., n/B, w]``. Per token: ``codes [..., n, ceil(P·bits/8)]`` (P = padded width), scale/zero
    ``[..., n, groups]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


def quantize_tokens(x: torch.Tensor, bits: int, group: int, per_channel: bool) -> QuantizedBlock:
    """``x [..., n, w]`` -> ``QuantizedBlock``; per channel needs n to be a multiple of ``group``."""
    *lead, n, width = x.shape
    if per_channel:
        blocks = x.reshape(*lead, n // group, group, width).transpose(-1, -2)  # [..., n/B, w, B]
        codes, scale, zero = quantize_groups(blocks, bits)
        return QuantizedBlock(pack(codes, bits), scale, zero)
    groups, size = channel_groups(width, group)
    if groups * size != width:  # replicate the last channel: the padding changes no group's range
        x = torch.cat([x, x[..., -1:].expand(*lead, n, groups * size - width)], dim=-1)
    codes, scale, zero = quantize_groups(x.reshape(*lead, n, groups, size), bits)
    return QuantizedBlock(pack(codes.reshape(*lead, n, groups * size), bits), scale, zero)


def dequantize_tokens(
    block: QuantizedBlock, bits: int, group: int, width: int, per_channel: bool, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of ``quantize_tokens`` up to rounding: ``[..., n, w]`` in ``dtype``."""
    if per_channel:
        codes = unpack(block.codes, bits, group).float()  # [..., n/B, w, B]
        x = codes * block.scale.float()[..., None] + block.zero.float()[..., None]
        x = x.transpose(-1, -2)
        return x.reshape(*x.shape[:-3], -1, width).to(dtype)
    groups, size = channel_groups(width, group)
    codes = unpack(block.codes, bits, groups * size).float()
    codes = codes.view(*codes.shape[:-1], groups, size)
    x = codes * block.scale.float()[..., None] + block.zero.float()[..., None]
    return x.flatten(-2)[..., :width].to(dtype)


# --------------------------------------------------------------------------- the store


class TokenStore:
    """A growing sequence of token states ``[..., n, w]``: quantized whole blocks, then a float tail.

    The tail holds the newest tokens: between ``residual`` and ``residual + group − 1`` of them once
    the sequence is long enough; whenever it holds ``residual + group``, its oldest ``group`` tokens
    become one quantized block. ``offset`` counts tokens dropped from the front of the quantized part
    (razor's sliding window); a block is freed once all its tokens are dropped.
    """

    def __init__(self, quant: QuantSpec, per_channel: bool):
        self.quant, self.per_channel = quant, per_channel
        self.blocks: QuantizedBlock | None = None
        self.quantized_tokens = 0  # tokens in ``blocks``, the dropped ``offset`` included
        self.offset = 0
        self.tail: torch.Tensor | None = None
        self.width = 0

    # --- reading
    def __len__(self) -> int:
        return self.quantized_tokens - self.offset + (0 if self.tail is None else self.tail.shape[-2])

    def read(self) -> torch.Tensor:
        """All stored tokens ``[..., n, w]`` in the cache dtype (quantized ones dequantized)."""
        assert self.tail is not None, "TokenStore read before its first append"
        if self.blocks is None:
            return self.tail
        spec = self.quant
        past = dequantize_tokens(self.blocks, spec.bits, spec.group, self.width, self.per_channel, self.tail.dtype)
        return torch.cat([past[..., self.offset :, :], self.tail], dim=-2)

    # --- writing
    def extend(self, new: torch.Tensor) -> torch.Tensor:
        """Store ``new [..., q, w]``; return every token, the new ones exact (attention in this step
        reads them before they are quantized)."""
        if not self.quant.quantized:
            self.tail = new if self.tail is None else torch.cat([self.tail, new], dim=-2)
            return self.tail
        past = None if self.tail is None else self.read()
        self.append(new)
        return new if past is None else torch.cat([past, new], dim=-2)

    def append(self, new: torch.Tensor) -> None:
        self.width = new.shape[-1]
        self.tail = new if self.tail is None else torch.cat([self.tail, new], dim=-2)
        if not self.quant.quantized:
            return
        group = self.quant.group
        ready = (self.tail.shape[-2] - self.quant.residual) // group * group
        if ready <= 0:
            return
        spec = self.quant
        block = quantize_tokens(self.tail[..., :ready, :], spec.bits, group, self.per_channel)
        self.tail = self.tail[..., ready:, :].clone()  # a slice would keep the float tokens alive
        if self.blocks is None:
            self.blocks = block
        else:
            # the token (per token) or block (per channel) axis: codes [..., n|n/B, ·(, ·)], scales [..., n|n/B, ·]
            code_dim = -3 if self.per_channel else -2
            self.blocks = QuantizedBlock(
                torch.cat([self.blocks.codes, block.codes], dim=code_dim),
                torch.cat([self.blocks.scale, block.scale], dim=-2),
                torch.cat([self.blocks.zero, block.zero], dim=-2),
            )
        self.quantized_tokens += ready

    def _blocks(self, start: int, stop: int | None) -> QuantizedBlock:
        """Quantized blocks ``start:stop`` (block indices): codes [..., n/B, w, ·] and scale/zero
        [..., n/B, w] per channel; codes, scale, zero [..., n, ·] per token (a block is ``group`` rows)."""
        assert self.blocks is not None
        b, group = self.blocks, self.quant.group
        if self.per_channel:
            return QuantizedBlock(
                b.codes[..., start:stop, :, :], b.scale[..., start:stop, :], b.zero[..., start:stop, :]
            )
        rows = slice(start * group, None if stop is None else stop * group)
        return QuantizedBlock(b.codes[..., rows, :], b.scale[..., rows, :], b.zero[..., rows, :])

    def _dequantize_first(self, blocks: int) -> torch.Tensor:
        """The first ``blocks`` quantized blocks, dequantized: ``[..., blocks·group, w]`` (dropped tokens included)."""
        assert self.tail is not None
        spec = self.quant
        return dequantize_tokens(self._blocks(0, blocks), spec.bits, spec.group, self.width, self.per_channel,
                                 self.tail.dtype)  # fmt: skip

    def take_front(self, count: int) -> torch.Tensor:
        """Remove and return the oldest ``count`` tokens ``[..., count, w]`` (as stored: dequantized).
        Only the blocks they lie in are dequantized (razor drops a token or two per decode step)."""
        quantized_left = self.quantized_tokens - self.offset
        if self.blocks is not None and count <= quantized_left:
            blocks = -(-(self.offset + count) // self.quant.group)
            front = self._dequantize_first(blocks)[..., self.offset : self.offset + count, :]
        else:
            front = self.read()[..., :count, :]
        from_blocks = min(count, quantized_left)
        self.offset += from_blocks
        if count > from_blocks:
            assert self.tail is not None
            self.tail = self.tail[..., count - from_blocks :, :].clone()
        self._free_dropped_blocks()
        return front

    def _free_dropped_blocks(self) -> None:
        if self.blocks is None:
            return
        group = self.quant.group
        whole = self.offset // group  # blocks whose every token was dropped
        if whole == 0:
            return
        if self.quantized_tokens - whole * group == 0:
            self.blocks, self.quantized_tokens, self.offset = None, 0, 0
            return
        tokens = whole * group
        kept = self._blocks(whole, None)  # copies: slices would keep the dropped blocks' storage alive
        self.blocks = QuantizedBlock(kept.codes.clone(), kept.scale.clone(), kept.zero.clone())
        self.quantized_tokens -= tokens
        self.offset -= tokens

    # --- cache protocol
    def apply(self, fn: Any) -> None:
        """Apply ``fn`` (row selection, device move) to every tensor; dim 0 is the batch row."""
        if self.tail is not None:
            self.tail = fn(self.tail)
        if self.blocks is not None:
            self.blocks = QuantizedBlock(fn(self.blocks.codes), fn(self.blocks.scale), fn(self.blocks.zero))

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (re-stored: quantized tokens are re-quantized, which a
        quantizer's own grid reproduces up to fp16 rounding)."""
        if len(self) <= length or self.tail is None:
            return
        kept = self.read()[..., :length, :]
        self.blocks, self.quantized_tokens, self.offset, self.tail = None, 0, 0, None
        self.append(kept)


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
