"""``StaticTokenStore``: ``TokenStore``'s storage preallocated for a static cache (fixed shapes and addresses, what
``torch.compile`` and CUDA graphs need). Copied verbatim into every output directory; imports only torch."""

from __future__ import annotations

from typing import Any

import torch

from .kvconvert_codec import QuantizedBlock, QuantSpec, dequantize_tokens, eager_on_cpu, quantize_tokens

# --------------------------------------------------------------------------- the static store


def ring_positions(count: Any, length: int, device: torch.device) -> torch.Tensor:
    """The position each slot of a ring of ``length`` holds once ``count`` (a 0-d tensor) items went in at slot
    position mod ``length``: the newest ≡ the slot (negative where none went yet)."""
    return count - 1 - (count - 1 - torch.arange(length, device=device)).remainder(length)


class StaticTokenStore:
    """``TokenStore``'s storage preallocated for ``max_len`` tokens (a static cache: fixed shapes and addresses,
    what ``torch.compile`` and CUDA graphs need), holding the same values: whole blocks quantized as soon as
    ``residual + group`` tokens wait, the newest in float, the sink exact.

    Buffers: ``codes``/``scale``/``zero`` for ``ceil(max_len / group)`` blocks (block i holds positions
    ``i·group …``), a float ``ring`` of the newest ``residual + group`` tokens (slot = position mod its length)
    and the exact ``head`` (sink). Which tokens are quantized is a function of the count alone,
    ``Q(n) = max(0, ⌊(n − residual) / group⌋·group)`` (what ``TokenStore.append`` reaches however the tokens
    arrive), so a decode step needs no data-dependent branch: ``extend`` reads, as ``TokenStore.extend`` does,
    positions below ``Q(p)`` from the codes and the rest exact, then stores the token and rewrites the one block
    that may just have filled (its old codes where it did not). A prefill (several tokens) runs eagerly and
    quantizes its whole blocks at once. Storage without quantization is a plain buffer. KIVI's layout; the token
    layout replaces the codec (``_quantize``, ``_fields``, ``_dequantize_into``: ``StaticTokenLayoutStore``)."""

    def __init__(self, quant: QuantSpec, per_channel: bool, max_len: int):
        self.quant, self.per_channel = quant, per_channel
        self.rotate = quant.rotates_values and not per_channel
        group = quant.group
        self.blocks = -(-max_len // group)
        self.max_len = max_len
        self.ring_len = quant.residual + group
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        self.center: torch.Tensor | None = None
        self.ring: torch.Tensor | None = None
        self.head: torch.Tensor | None = None
        self.width = 0

    TENSORS = ("codes", "scale", "zero", "center", "ring", "head")

    def held(self) -> list[torch.Tensor]:
        return [t for t in (getattr(self, name) for name in self.TENSORS) if t is not None]

    def apply(self, fn: Any) -> None:
        for name in self.TENSORS:
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))

    def _allocate(self, new: torch.Tensor) -> None:
        *lead, _, width = new.shape
        self.width, spec = width, self.quant
        if not spec.quantized:  # 16 bits: the ring is the whole buffer
            self.ring = new.new_zeros(*lead, self.max_len, width)
            return
        # the shapes of one block's codes, scales and zeros, from the codec itself, repeated for every block
        probe = self._quantize(new.new_zeros(*lead, spec.group, width))
        for name, dim, _ in self._fields():
            setattr(self, name, _repeated(getattr(probe, name), dim, self.blocks))
        self.ring = new.new_zeros(*lead, self.ring_len, width)
        if spec.sink:
            self.head = new.new_zeros(*lead, spec.sink, width)

    def quantized_count(self, count: Any) -> Any:
        """``Q(count)``: tokens in quantized blocks once ``count`` are stored (an int, or a 0-d tensor)."""
        group, residual = self.quant.group, self.quant.residual
        if isinstance(count, int):
            return max(0, (count - residual) // group * group)
        return ((count - residual).clamp(min=0) // group) * group

    # --- reading
    def extend(self, new: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
        """Store ``new [..., q, w]`` at positions ``filled …``; return every slot ``[..., max_len, w]`` as the
        step attends to them (slots past ``filled + q`` hold anything: the mask hides them)."""
        if self.ring is None:
            self._allocate(new)
        assert self.ring is not None
        if not self.quant.quantized:  # a plain buffer: written in place, returned whole
            self.ring.index_copy_(-2, torch.arange(new.shape[-2], device=new.device) + filled, new)
            return self.ring
        out = self._read(new, filled)
        self.extend_only(new, filled)
        return out

    def extend_only(self, new: torch.Tensor, filled: torch.Tensor) -> None:
        """``extend``'s writes without its read (a step that read the codes itself: ``StaticKiviLayer``). Eagerly on a
        CPU, where the count is free to read, with Python counts: a step that fills no block quantizes none."""
        if self.ring is None or not self.quant.quantized:
            self.extend(new, filled)  # allocates; at 16 bits only writes
        elif new.shape[-2] == 1 and not eager_on_cpu(new.device):
            self._write_one(new, filled)
        else:
            self._write_many(new, int(filled))

    def past(self, filled: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Every slot ``[..., max_len, w]`` as ``extend`` reads it before this step's tokens (``like``: ``[..., q, w]``
        states of the step, shapes and dtype; allocates the buffers if nothing is stored yet)."""
        if self.ring is None:
            self._allocate(like)
        assert self.ring is not None
        return self.ring if not self.quant.quantized else self._read(like[..., :0, :], filled)

    def _read(self, new: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
        assert self.ring is not None and self.codes is not None and self.scale is not None and self.zero is not None
        steps = torch.arange(new.shape[-2], device=new.device) + filled
        spec, lead = self.quant, self.ring.shape[:-2]
        length = self.blocks * spec.group
        # one slot past the last block: where the ring's stale slots are written, then cut off
        out = self.ring.new_empty(*lead, length + 1, self.width)
        self._dequantize_into(QuantizedBlock(self.codes, self.scale, self.zero, self.center), out[..., :length, :])
        # ring slot s holds the newest position ≡ s (mod ring_len) before this step; exact where not quantized
        positions = ring_positions(filled, self.ring_len, new.device)
        exact = (positions >= self.quantized_count(filled)) & (positions >= 0)
        out.index_copy_(-2, torch.where(exact, positions, length), self.ring)
        out.index_copy_(-2, steps, new)
        if self.head is not None:  # the sink, exact (its block holds stand-ins)
            sink = self.head.shape[-2]
            held = (torch.arange(sink, device=new.device) < filled).view(-1, 1)
            out[..., :sink, :] = torch.where(held, self.head, out[..., :sink, :])
        return out[..., : self.max_len, :]

    def block_slots(self, blocks: torch.Tensor) -> torch.Tensor:
        """Where blocks (by index) are held: block i in slot i (``RingTokenStore``: a ring of slots)."""
        return blocks

    def field_rows(self, slots: torch.Tensor, per_token: bool) -> torch.Tensor:
        """The rows of a buffer (``_fields``) that block ``slots`` occupy: each token's per token, else one a block."""
        if not per_token:
            return slots
        return (slots[:, None] * self.quant.group + torch.arange(self.quant.group, device=slots.device)).flatten()

    # --- the codec: what a subclass in another layout replaces (``StaticTokenLayoutStore``)
    def _quantize(self, tokens: torch.Tensor) -> QuantizedBlock:
        spec = self.quant
        return quantize_tokens(tokens, spec.bits, spec.group, self.per_channel, self.rotate)

    def _fields(self) -> tuple[tuple[str, int, bool], ...]:
        """``(name, axis, per token)`` of each buffer of the codes: the axis its blocks (or tokens) lie along."""
        return tuple((name, -3 if name == "codes" and self.per_channel else -2, not self.per_channel)
                     for name in ("codes", "scale", "zero"))  # fmt: skip

    def _dequantize_into(self, blocks: QuantizedBlock, out: torch.Tensor) -> None:
        spec = self.quant
        dequantize_tokens(blocks, spec.bits, spec.group, self.width, self.per_channel, out.dtype, self.rotate, out)

    # --- writing
    def _quantize_into(self, tokens: torch.Tensor, first_block: Any, keep: Any = None) -> None:
        """Quantize ``tokens [..., k·group, w]`` (whole blocks) into blocks ``first_block …``; with ``keep`` (a 0-d
        bool tensor, one block) the old codes stay where it is True."""
        spec = self.quant
        block = self._quantize(tokens)
        index = self.block_slots(torch.arange(tokens.shape[-2] // spec.group, device=tokens.device) + first_block)
        for name, axis, per_token in self._fields():
            held, new = getattr(self, name), getattr(block, name)
            rows = self.field_rows(index, per_token)
            if keep is not None:
                new = torch.where(keep, held.index_select(axis, rows), new)
            held.index_copy_(axis, rows, new)

    def _with_stand_ins(self, tokens: torch.Tensor, first: Any) -> torch.Tensor:
        """``tokens`` (starting at block ``first``) with the sink replaced by the token after it in block 0, so
        its outliers widen no channel's range (as ``TokenStore.append`` does)."""
        sink = self.quant.sink
        if not sink:
            return tokens
        stand_in = tokens[..., sink : sink + 1, :].expand(*tokens.shape[:-2], sink, tokens.shape[-1])
        replaced = torch.cat([stand_in, tokens[..., sink:, :]], dim=-2)
        if isinstance(first, int):
            return replaced if first == 0 else tokens
        return torch.where(first == 0, replaced, tokens)

    def _write_one(self, new: torch.Tensor, filled: torch.Tensor) -> None:
        """One token at position ``filled``, with tensor ops only (a compiled decode step)."""
        assert self.ring is not None
        spec = self.quant
        self.ring.index_copy_(-2, filled.view(1).remainder(self.ring_len), new)
        if self.head is not None:
            slot = filled.clamp(max=spec.sink - 1).view(1)
            self.head.index_copy_(-2, slot, torch.where(filled < spec.sink, new, self.head.index_select(-2, slot)))
        total = filled + 1
        filled_up = (total - spec.residual >= spec.group) & ((total - spec.residual) % spec.group == 0)
        block = ((total - spec.residual) // spec.group - 1).clamp(min=0)
        positions = block * spec.group + torch.arange(spec.group, device=new.device)
        tokens = self._with_stand_ins(self.ring.index_select(-2, positions.remainder(self.ring_len)), block)
        self._quantize_into(tokens, block, keep=~filled_up)

    def _write_many(self, new: torch.Tensor, filled: int) -> None:
        """A prefill's ``q`` tokens at ``filled …`` (eager: Python counts)."""
        assert self.ring is not None
        spec, count = self.quant, new.shape[-2]
        total = filled + count
        before, after = self.quantized_count(filled), self.quantized_count(total)
        if after > before:  # the tokens of the blocks that fill: from the ring, then from ``new``
            old = torch.arange(before, filled, device=new.device).remainder(self.ring_len)
            exact = torch.cat([self.ring.index_select(-2, old), new], dim=-2)[..., : after - before, :]
            self._quantize_into(self._with_stand_ins(exact, before // spec.group), before // spec.group)
        start = max(filled, total - self.ring_len)
        slots = torch.arange(start, total, device=new.device).remainder(self.ring_len)
        self.ring.index_copy_(-2, slots, new[..., start - filled :, :])
        if self.head is not None and filled < spec.sink:
            end = min(spec.sink, total)
            self.head[..., filled:end, :] = new[..., : end - filled, :]


def _repeated(block: torch.Tensor, dim: int, times: int) -> torch.Tensor:
    """Zeros shaped like ``block`` with ``dim`` ``times`` as long."""
    shape = list(block.shape)
    shape[dim] *= times
    return block.new_zeros(shape)
