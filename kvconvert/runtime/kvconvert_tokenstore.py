"""``TokenStore``: a growing sequence of token states ``[..., n, w]`` in quantized storage (see
``kvconvert_codec`` for the format), exact sink and recent tokens, row selection, cropping and
dropping from the front. Copied verbatim into every output directory; imports only torch."""

from __future__ import annotations

from typing import Any

import torch

from .kvconvert_codec import QuantizedBlock, QuantSpec, dequantize_tokens, eager_on_cpu, quantize_tokens

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

    _tail: torch.Tensor | None
    _room: torch.Tensor | None  # the buffer ``tail`` is the front of, while it is (``_grown``)

    def __init__(self, quant: QuantSpec, per_channel: bool):
        self.quant, self.per_channel = quant, per_channel
        self.rotate = quant.rotates_values and not per_channel  # keys keep per-channel scales instead
        self._clear()

    def _clear(self) -> None:
        self.head: torch.Tensor | None = None  # exact copies of the first ``sink`` tokens still held
        self.front_dropped = False  # take_front removed the sequence's first tokens: later ones are no sink
        self.blocks = None
        self.quantized_tokens = 0  # tokens in ``blocks``, the dropped ``offset`` included
        self.offset = 0
        self.tail = None
        self.width = 0

    @property
    def tail(self) -> torch.Tensor | None:
        """The newest tokens, in float ``[..., n, w]``."""
        return self._tail

    @tail.setter
    def tail(self, tokens: torch.Tensor | None) -> None:
        # a tail set here is no buffer's front: the room ``_grown`` kept is let go, not held beside it
        self._tail, self._room = tokens, None

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

    def states_at(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The stored tokens at ``(rows[i], positions[i])`` of a store of ``[b, H, n, w]`` (none dropped from the
        front): ``[N, H, w]`` in the cache dtype, as ``read`` gives them, dequantizing only the blocks they lie in
        (a few tokens a step reads exactly beside codes it reads folded: MiniCache's retained tokens)."""
        assert self.tail is not None and not self.offset, "states_at reads a store with tokens and none dropped"
        out = self.tail.new_empty(rows.shape[0], self.tail.shape[1], self.tail.shape[-1])
        quantized, sink = self.quantized_tokens, self._head_len()
        in_blocks = (positions < quantized) & (positions >= sink)
        if self.blocks is not None and bool(in_blocks.any()):
            r, at = rows[in_blocks], positions[in_blocks]
            b, group = self.blocks, self.quant.group
            if self.per_channel:  # the token's whole block [N, H, 1, w, ·] dequantized, the token taken from it
                block = at // group
                one = QuantizedBlock(*(t[r, :, block].unsqueeze(2) for t in (b.codes, b.scale, b.zero)))
                states = self._dequantize(one, out.dtype)[torch.arange(r.shape[0]), :, at % group]
            else:  # per token: the token's own codes [N, H, 1, ·]
                one = QuantizedBlock(*(t[r, :, at].unsqueeze(2) for t in (b.codes, b.scale, b.zero)))
                states = self._dequantize(one, out.dtype)[:, :, 0]
            out[in_blocks] = states
        in_tail = positions >= quantized
        if bool(in_tail.any()):
            out[in_tail] = self.tail[rows[in_tail], :, positions[in_tail] - quantized]
        in_head = positions < sink
        if self.head is not None and bool(in_head.any()):
            out[in_head] = self.head[rows[in_head], :, positions[in_head]]
        return out

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
            if self.tail is None:
                self.tail = new
                return new
            grown = self._tail = self._grown(self.tail, new)  # not the setter: the room stays
            return grown
        tokens = new if self.tail is None else self.read(then=new)
        self.append(new)
        return tokens

    def _grown(self, tail: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``tail`` followed by ``new``, as a view of a buffer with room to grow: a decode step's token goes into
        the room, where ``torch.cat`` would copy every held token once per step (at 4K tokens a tenth of a LoRC
        decode step on a CPU, in ``torch.profiler``). Only single-token appends get room (at most a sixty-fourth
        more tokens: the bytes the cache holds, which budgets measure, grow by at most that); a longer append (a
        prefill chunk) makes an exact buffer. ``tail``'s setter lets the room go, so a room held is always the
        buffer ``tail`` is the front of."""
        held, count = tail.shape[-2], new.shape[-2]
        room, dtype = self._room, torch.promote_types(tail.dtype, new.dtype)  # what ``torch.cat`` would make
        if room is None or room.shape[-2] < held + count or room.dtype != dtype:
            spare = (held + count) // 64 if count == 1 else 0  # a copy every n/64 steps: 64 tokens a step
            room = tail.new_empty(*tail.shape[:-2], held + count + spare, tail.shape[-1], dtype=dtype)
            room[..., :held, :] = tail
        self._room = room
        room[..., held : held + count, :] = new
        return room[..., : held + count, :]

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
        centers = None if old.center is None or new.center is None else torch.cat([old.center, new.center], dim=-2)
        return QuantizedBlock(torch.cat([old.codes, new.codes], dim=code_dim),
                              torch.cat([old.scale, new.scale], dim=scale_dim),
                              torch.cat([old.zero, new.zero], dim=scale_dim), centers)  # fmt: skip

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
            return QuantizedBlock(b.codes[..., start:stop, :, :], b.scale[..., start:stop, :],
                                  b.zero[..., start:stop, :])  # fmt: skip
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
