"""The token layout: 4-bit codes that torch's CPU int4 kernel reads (``TokenLayoutStore``).

Copied verbatim into every output directory; imports only torch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .kvconvert_codec import (
    QuantizedBlock,
    QuantSpec,
    channel_groups,
    quantize_tokens,
    rotation,
    round_up,
    token_group_size,
)
from .kvconvert_kernels import kernels_by_default_on, kernels_requested
from .kvconvert_packing import unpack
from .kvconvert_staticstore import StaticTokenStore
from .kvconvert_tokenstore import TokenStore

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


@functools.cache
def _warn_off_cpu(device: str) -> None:
    """Once per device type: neither a CPU's int4 kernel nor the GPU kernel reads the codes, every decode step
    dequantizes the whole cache."""
    warnings.warn(
        f"kvconvert: on {device} without the Triton kernel (not installed, or KVCONVERT_KERNELS=torch) every decode "
        "step of the 4-bit token layout dequantizes the whole cache (0.01x the original measured on an H200); "
        "pip install triton, or leave KVCONVERT_KERNELS unset",
        stacklevel=2,
    )


# Every layout torch's packer is known to produce (AVX2, AVX-512, the plain loop at two vector widths);
# the first is the one stores use where the machine's kernel cannot read them (dequantized anyway).
INT4_ROW_LAYOUTS = (Int4Rows(32, True), Int4Rows(64, True), Int4Rows(32, False), Int4Rows(16, False),
                    Int4Rows(64, False))  # fmt: skip


# The rows the GPU decode kernel reads (``kvconvert_token_kernel``): AVX2's, blocks of 32 tokens. A store packs in them
# wherever that kernel may read it (``kernel_rows_wanted``); elsewhere it keeps the rows its CPU's int4 kernel reads.
KERNEL_ROWS = INT4_ROW_LAYOUTS[0]


def kernel_rows_wanted(quant: QuantSpec, device: torch.device) -> bool:
    """A store of tokens on ``device`` packs in ``KERNEL_ROWS``: the GPU kernel may read it (an NVIDIA GPU from Ampere
    on with Triton, ``KVCONVERT_KERNELS`` not ``torch``, as ``use_kernels`` decides; or the kernels asked for: tests
    under the interpreter) and its blocks hold whole packing blocks."""
    choice = kernels_requested()
    wanted = choice == "triton" or (choice == "auto" and kernels_by_default_on(device))
    return wanted and quant.group % KERNEL_ROWS.block == 0


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
    layout = next(
        (rows for rows in INT4_ROW_LAYOUTS if torch.equal(rows.pack(codes), packed)),
        None,
    )
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
    scale = round_up((high - low) / 15, dtype)
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
        if self.rows is None and kernel_rows_wanted(self.quant, tokens.device):
            self.rows = KERNEL_ROWS
        if tokens.device.type != "cpu" and self.rows != KERNEL_ROWS and not torch.compiler.is_compiling():
            _warn_off_cpu(tokens.device.type)
        size, rows = self.group_size(), self._layout()
        if not self.keys:
            codes, scale, zero = _kernel_groups(_token_layout_groups(tokens, size), torch.float16)  # [..., n, G, size]
            packed = rows.pack(codes.permute(*range(codes.dim() - 3), -2, -1, -3))  # Vᵀ per group: [..., G, size, n/2]
            r = self._value_block(size)
            codes = packed.reshape(*packed.shape[:-3], -1, tokens.shape[-2], r // 2)
            # scales token-last, as the keys': a decode step multiplies them into [.., G, n] probabilities
            return QuantizedBlock(
                codes,
                scale.transpose(-1, -2).contiguous(),
                zero.transpose(-1, -2).contiguous(),
            )
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
        # Where no int4 kernel reads the codes (a GPU, a CPU of another layout) every decode step comes here for the
        # whole cache: so one float32 copy worked on in place and one 2-D product with the rotation. A broadcast
        # ``x @ rot.T`` over [..., n, G, size] ran as a batched product of tiny matrices: 3-4x slower on a CPU.
        size, rows = self.group_size(), self._layout()
        rot_t = rotation(size, blocks.codes.device).T
        if self.keys:
            codes = rows.unpack(blocks.codes)  # [..., n, d]
            *lead, n, d = codes.shape
            scale, zero = (side.transpose(-1, -2)[..., None] for side in blocks.scale.float().unbind(-1))  # [..n, G, 1]
            x = codes.reshape(*lead, n, d // size, size).to(torch.float32, memory_format=torch.contiguous_format)
            x.sub_(8).mul_(scale).add_(zero)
            out = torch.mm(x.view(-1, size), rot_t).view(*lead, n // self.quant.group, self.quant.group, d)
            assert blocks.center is not None
            return out.add_(blocks.center.float()[..., None, :]).view(*lead, n, d).to(dtype)
        *lead, stored, n, _ = blocks.codes.shape
        groups = stored * self._value_block(size) // size
        codes = rows.unpack(blocks.codes.reshape(*lead, groups, size, n // 2))  # [..., G, size, n]
        # token-major in the one float32 copy, so that the product comes out as [..., n, d] with no copy after it
        x = codes.permute(*range(len(lead)), -1, -3, -2).to(torch.float32, memory_format=torch.contiguous_format)
        scale, zero = (side.float().transpose(-1, -2)[..., None] for side in (blocks.scale, blocks.zero))  # [..n, G, 1]
        x.sub_(8).mul_(scale).add_(zero)
        return torch.mm(x.view(-1, size), rot_t).view(*lead, n, groups * size).to(dtype)

    def _dequantize_into(self, blocks: QuantizedBlock, out: torch.Tensor) -> None:
        out.copy_(self._dequantize(blocks, out.dtype))

    def _front_quantized(self, count: int) -> torch.Tensor:
        return self._front_blocks(count)  # its rows pair across tokens; it drops whole units anyway (``whole_front``)

    def _front_unit(self) -> int:
        # key rows are packed in blocks of up to 64 tokens (AVX-512 pairs rows j and j + 32): a cut falls on
        # both a block mean's and any packing block's boundary, the same for keys and values (one token count)
        return math.lcm(self.quant.group, max(rows.block for rows in INT4_ROW_LAYOUTS))


class KiviInt4Values(TokenLayoutStore):
    """Values quantized as KIVI's layout quantizes them (``quantize_tokens``: 4-bit, per token in groups of at most
    ``group`` channels, rotated with ``--kv-rotate``), the codes kept where the token layout keeps its values': Vᵀ's
    int4 rows per channel group, scales and zeros token-last. The numbers are ``TokenStore``'s to the bit; a CPU decode
    step then weighs them with torch's int4 kernel (``kivi_int4_values``) instead of widening every code to float32
    (measured on 2 AMD EPYC cores, a layer's values at 8 rows × 4K tokens of SmolLM2: 0.37 ms against 1.8 ms).
    ``kivi_int4_fits`` says which widths it holds; elsewhere, reads dequantize."""

    def __init__(self, quant: QuantSpec):
        super().__init__(quant, keys=False)
        self.rotate = quant.rotates_values

    def group_size(self) -> int:
        return channel_groups(self.width, self.quant.group)[1]

    def _quantize(self, tokens: torch.Tensor) -> QuantizedBlock:
        size, rows = self.group_size(), self._layout()
        held = quantize_tokens(tokens, 4, self.quant.group, False, self.rotate)
        codes = unpack(held.codes, 4, tokens.shape[-1]).unflatten(-1, (-1, size))  # [..., n, G, size]
        packed = rows.pack(codes.permute(*range(codes.dim() - 3), -2, -1, -3))  # Vᵀ per group: [..., G, size, n/2]
        codes = packed.reshape(*packed.shape[:-3], -1, tokens.shape[-2], self._value_block(size) // 2)
        scale, zero = (side.transpose(-1, -2).contiguous() for side in (held.scale, held.zero))  # token-last
        return QuantizedBlock(codes, scale, zero)

    def _dequantize(self, blocks: QuantizedBlock, dtype: torch.dtype) -> torch.Tensor:
        # each token's bytes are its own (a byte pairs two channels of one token): any run of tokens unpacks alone
        rows, r = self._layout(), self._value_block(self.group_size())
        low, high = blocks.codes & 15, blocks.codes >> 4  # [..., d/r, n, r/2]
        halves = rows.halves and r == rows.block  # byte j: rows (j, j + r/2); a short block pairs (2j, 2j + 1)
        codes = torch.cat([low, high], dim=-1) if halves else torch.stack([low, high], dim=-1).flatten(-2)
        # dequantize_tokens' arithmetic on these codes, not packed into KIVI's bytes to be unpacked again (razor's
        # windows dequantize a token or two of values a layer at every decode step: ~10 small ops less)
        codes = codes.transpose(-2, -3).flatten(-2).unflatten(-1, (-1, self.group_size()))  # [..., n, G, size]
        scale, zero = (side.transpose(-1, -2).float()[..., None] for side in (blocks.scale, blocks.zero))
        x = torch.addcmul(zero, codes, scale)  # a rotation is orthogonal: its transpose undoes it
        return (x @ rotation(x.shape[-1], x.device).T if self.rotate else x).flatten(-2).to(dtype)

    def _front_quantized(self, count: int) -> torch.Tensor:
        return TokenStore._front_quantized(self, count)  # per token: only the tokens leaving are read

    def _front_unit(self) -> int:
        return TokenStore._front_unit(self)  # whole blocks, as the keys beside it (KIVI's layout) free theirs


def kivi_int4_fits(quant: QuantSpec, width: int) -> bool:
    """``KiviInt4Values`` holds values of this width: 4-bit, channel groups of whole 32-row int4 matrices, none
    padded, blocks of a multiple of 32 tokens (the kernel reduces over the tokens in groups of 32), and this machine's
    int4 kernel reads them (``cpu_int4_rows``): a group of whole row blocks of its layout, or one short block (else
    ``_layout`` would pick a packing the kernel does not read)."""
    groups, size = channel_groups(width, quant.group)
    whole = size % 32 == 0 and groups * size == width and quant.group % 32 == 0
    machine = cpu_int4_rows()
    return quant.bits == 4 and whole and machine is not None and (size % machine.block == 0 or size < machine.block)


def kivi_int4_values(values: KiviInt4Values, weights: torch.Tensor) -> torch.Tensor:
    """``Σ p·v`` over the quantized values of ``values`` (still rotated, as stored) for ``weights [b, Hkv, G, n]``:
    ``(p⊙s)·(code − 8)`` per channel group through the int4 kernel (``code_outputs``), plus ``p·(z + 8s)`` (KIVI's
    codes stand for ``code·s + z``). ``[b, Hkv, G, groups·size]`` float32."""
    held = values.blocks
    assert held is not None and values.kernel_reads()
    zero = held.zero.float().add_(held.scale.float(), alpha=8)
    out = code_outputs(weights.flatten(0, 1), held.scale, zero, values.kernel_operands(), values.group_size())
    return out.view(*weights.shape[:-1], -1)


class StaticTokenLayoutStore(StaticTokenStore):
    """``StaticTokenStore`` in the token layout: the same ring, sink and block schedule, its blocks quantized and
    read by a ``TokenLayoutStore`` (``codec``) into buffers for every block the cache has room for (keys: codes
    ``[..., max_len, d/2]``, pairs ``[..., G, max_len, 2]``, centers ``[..., blocks, d]``; values: codes
    ``[..., d/r, max_len, r/2]``, scales and zeros ``[..., G, max_len]``, ``max_len`` rounded up to whole blocks).
    A block written at its place must be the rows torch's packer gives the whole buffer, so key rows are packed in
    units that divide the kv group: the machine's, or (a 32-token group under a 64-row AVX-512 layout) a pairwise
    layout the kernel does not read, so that cache is decoded by dequantizing it."""

    def __init__(self, quant: QuantSpec, keys: bool, max_len: int):
        super().__init__(quant, False, max_len)
        self.codec, self.keys = TokenLayoutStore(quant, keys), keys
        self.reads_codes = False  # the machine's int4 kernel reads the buffers (known at the first block)
        self._operands: list[tuple[torch.Tensor, ...]] | None = None

    def _quantize(self, tokens: torch.Tensor) -> QuantizedBlock:
        codec = self.codec
        if codec.rows is None:
            codec.width = tokens.shape[-1]
            if kernel_rows_wanted(self.quant, tokens.device):
                codec.rows = KERNEL_ROWS
            elif self.quant.group % codec._layout().block and self.keys:
                codec.rows = Int4Rows(32, False)
            self.reads_codes = codec.kernel_reads()
        return codec._quantize(tokens)

    def _fields(self) -> tuple[tuple[str, int, bool], ...]:
        if self.keys:  # pairs [..., G, n, 2] (and an empty zero beside them), centers one per block
            return ("codes", -2, True), ("scale", -2, True), ("zero", -2, True), ("center", -2, False)
        return ("codes", -2, True), ("scale", -1, True), ("zero", -1, True)

    def _dequantize_into(self, blocks: QuantizedBlock, out: torch.Tensor) -> None:
        out.copy_(self.codec._dequantize(blocks, out.dtype))

    def apply(self, fn: Any) -> None:
        super().apply(fn)
        self._operands = None

    def kernel_operands(self, tokens: int | None = None) -> list[tuple[torch.Tensor, ...]]:
        """``TokenLayoutStore.kernel_operands`` over every block's room (views of the buffers, made once), or over
        the first ``tokens`` (a whole number of blocks; copies where a prefix is no matrix of its own)."""
        if tokens is None and self._operands is not None:
            return self._operands
        assert self.codes is not None and self.scale is not None
        codes = self.codes if tokens is None else self.codes[..., :tokens, :]  # tokens on dim -2 (both sides)
        operands: list[tuple[torch.Tensor, ...]]
        if self.keys:  # each row's codes [n, d/2] are a prefix of its [max_len, d/2]: a view; pairs [G, n, 2]
            pairs = self.scale if tokens is None else self.scale[..., :tokens, :].contiguous()
            operands = list(zip(codes.flatten(0, 1).unbind(0), pairs.flatten(0, 1).unbind(0), strict=True))
        else:  # Vᵀ's rows [d/r, n, r/2] per group: one [size, n/2] matrix each
            size = self.codec.group_size()
            operands = [(m,) for m in codes.contiguous().reshape(-1, size, codes.shape[-2] // 2).unbind(0)]
        if tokens is None:
            self._operands = operands
        return operands


# --------------------------------------------------------------------------- decoding from the codes
# The two halves of a decode step over int4 codes (``kvconvert_quant.token_decode``, ``StaticTokenLayoutLayer``).

_UNIT_SCALES: dict[tuple[int, torch.device], torch.Tensor] = {}


def unit_scales(tokens: int, channels: int, device: torch.device) -> torch.Tensor:
    """Kernel scales ``[tokens/32, channels, 2]`` of (1, 0): the kernel computes ``Σ (p⊙s)·(code − 8)``
    (value scales multiply the probabilities instead). Centred codes keep that bfloat16 sum small:
    with raw codes it is ≈ 7.5·Σ p·s and cancels against ``p·z`` afterwards, losing its rounding error
    (measured on random 4K–16K caches: 6 % of the output's scale at worst, 1–2 % centred). Grown as the cache grows; a
    prefix of a contiguous tensor along dim 0 is contiguous."""
    table = _UNIT_SCALES.get((channels, device))
    if table is None or table.shape[0] < tokens // 32:
        rows = max(tokens // 32, 2 * (0 if table is None else table.shape[0]), 64)
        table = torch.tensor([1.0, 0.0], dtype=torch.bfloat16, device=device).expand(rows, channels, 2).contiguous()
        _UNIT_SCALES[(channels, device)] = table
    return table[: tokens // 32]


def code_scores(q: torch.Tensor, q_rot: torch.Tensor, operands: list[tuple[torch.Tensor, ...]],
                center: torch.Tensor, size: int, out: torch.Tensor) -> None:  # fmt: skip
    """Scores of the quantized keys into ``out [b·Hkv, G, n]``: ``(q·R)·((codes − 8)·s + z)`` per channel group in one
    kernel call per (row, KV head), plus ``q·center`` of each token's block. ``q [b·Hkv, G, d]`` float32 (scaled),
    ``q_rot`` the same rotated per group, bfloat16; ``operands`` the keys' (``kernel_operands``), ``center
    [b, Hkv, n/B, d]``."""
    rows, group, _ = q.shape
    int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    # one kernel call per (row, KV head); unbind makes the per-head views in one op
    scores = torch.stack([int4_mm(x, codes, size, pairs)
                          for x, (codes, pairs) in zip(q_rot.unbind(0), operands, strict=True)])  # fmt: skip
    offsets = torch.bmm(q, center.flatten(0, 1).float().transpose(1, 2))  # [b·Hkv, G, n/B]
    blocks = offsets.shape[-1]
    summed = scores.view(rows, group, blocks, -1), offsets[..., None]
    if torch.compiler.is_compiling():  # Dynamo takes no strided ``out=`` (``out`` is a slice of the step's scores)
        out.view(rows, group, blocks, -1).copy_(torch.add(*summed))
    else:  # eagerly: written in place, no copy
        torch.add(*summed, out=out.view(rows, group, blocks, -1))


def code_outputs(probs: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 operands: list[tuple[torch.Tensor, ...]], size: int) -> torch.Tensor:  # fmt: skip
    """``probs [b·Hkv, G, n]`` (of the quantized tokens) times their values, per channel group
    ``p·((code − 8)·s + z) = (p⊙s)·(code − 8) + p·z``, still rotated: ``[b·Hkv, G, d]`` float32. ``scale`` and
    ``zero [b, Hkv, G', n]``, ``operands`` the values' (``kernel_operands``)."""
    rows, group, n = probs.shape
    groups = scale.shape[-2]
    int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    weighted = torch.empty(rows, groups, group, n, dtype=torch.bfloat16, device=probs.device)
    torch.mul(probs[:, None], scale.flatten(0, 1)[:, :, None], out=weighted)  # [b·Hkv, G', G, n], the kernel's input
    offsets = torch.bmm(probs, zero.flatten(0, 1).float().transpose(1, 2))  # [b·Hkv, G, G']
    unit = unit_scales(n, size, probs.device)
    # Vᵀ's int4 rows, one [size, n/2] matrix per (row, KV head, channel group)
    out = torch.stack([int4_mm(x, codes, 32, unit) for x, (codes,) in
                       zip(weighted.flatten(0, 1).unbind(0), operands, strict=True)])  # fmt: skip
    out = out.view(rows, groups, group, size) + offsets.transpose(1, 2)[..., None]
    return out.transpose(1, 2).reshape(rows, group, groups * size) if groups > 1 else out.view(rows, group, size)
