"""``TokenStore``: a growing sequence of token states ``[..., n, w]`` in quantized storage (see
``kvconvert_codec`` for the format), exact sink and recent tokens, row selection, cropping and
dropping from the front. Copied verbatim into every output directory; imports only torch."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .kvconvert_codec import (
    QuantizedBlock,
    QuantSpec,
    dequantize_tokens,
    quantize_tokens,
)
from .kvconvert_packing import codes_per_unit, unpack

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
    _room: torch.Tensor | None  # the buffer ``tail`` is a window of, while it is (``_grown``)
    _room_start: int  # where in ``_room`` (along the token axis) ``tail`` starts

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
        # a tail set here is no buffer's window: the room ``_grown`` kept is let go, not held beside it
        self._tail, self._room, self._room_start = tokens, None, 0

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
            else:  # per token: the token's own codes, its token axis kept (1 long) where the store keeps it
                code_dim, scale_dim = self._token_dims()
                one = QuantizedBlock(*(t.movedim(dim, 2)[r, :, at].unsqueeze(dim) for t, dim in
                                       ((b.codes, code_dim), (b.scale, scale_dim), (b.zero, scale_dim))))  # fmt: skip
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
        buffer ``tail`` is a window of (``drop_front`` moves the window's start: a sliding window then copies
        itself once every n/64 steps, not at every step)."""
        held, count = tail.shape[-2], new.shape[-2]
        room, start = self._room, self._room_start
        dtype = torch.promote_types(tail.dtype, new.dtype)  # what ``torch.cat`` would make
        if room is None or room.shape[-2] < start + held + count or room.dtype != dtype:
            spare = (held + count) // 64 if count == 1 else 0  # a copy every n/64 steps: 64 tokens a step
            room = tail.new_empty(*tail.shape[:-2], held + count + spare, tail.shape[-1], dtype=dtype)
            room[..., :held, :] = tail
            start = 0
        self._room, self._room_start = room, start
        room[..., start + held : start + held + count, :] = new
        return room[..., start : start + held + count, :]

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
        """Remove and return the oldest ``count`` tokens ``[..., count, w]`` (as stored: dequantized)."""
        assert self.tail is not None
        if count <= 0:
            return self.tail[..., :0, :]
        from_blocks = min(count, self.quantized_tokens - self.offset)
        front = [self._front_quantized(from_blocks)] if from_blocks else []
        if count > from_blocks:
            front.append(self.tail[..., : count - from_blocks, :])
        taken = self._with_head(torch.cat(front, dim=-2))  # cat copies: the patch touches no stored tensor
        self.drop_front(count)
        return taken

    def drop_front(self, count: int) -> None:
        """Remove the oldest ``count`` tokens, reading none of them (a sliding-window layer's past)."""
        assert self.tail is not None
        if count <= 0:
            return
        self.front_dropped = True
        from_blocks = min(count, self.quantized_tokens - self.offset)
        self.offset += from_blocks
        if count > from_blocks:
            cut = count - from_blocks
            # a view keeps the dropped tokens' storage until the next append copies the tail; worth it
            # for the token or two a sliding window drops per step, not for a prefill's many
            rest = self.tail[..., cut:, :]
            few = cut <= rest.shape[-2] // 16
            if few and self._room is not None:  # the window moves along its room
                self._tail, self._room_start = rest, self._room_start + cut
            else:
                self.tail = rest if few else rest.clone()
        self._free_dropped_blocks()
        if self.head is not None:
            self.head = self.head[..., count:, :].clone() if count < self.head.shape[-2] else None

    def _front_quantized(self, count: int) -> torch.Tensor:
        """The oldest ``count`` quantized tokens held, dequantized ``[..., count, w]``. Razor's window drops a token
        or two per decode step: per token only their codes are read, per channel the packing units holding them
        within the first block (a whole block dequantized per store and step cost 5 ms of a 60 ms step of SmolLM2
        at 1K on 2 cores); across a block's edge, the blocks they lie in."""
        assert self.blocks is not None and self.tail is not None
        spec, start, held = self.quant, self.offset, self.blocks
        if not self.per_channel:
            code_dim, scale_dim = self._token_dims()
            part = QuantizedBlock(held.codes.narrow(code_dim, start, count), held.scale.narrow(scale_dim, start, count),
                                  held.zero.narrow(scale_dim, start, count))  # fmt: skip
            return self._dequantize(part, self.tail.dtype)
        if start + count > spec.group:
            return self._front_blocks(count)
        # the packing units holding them, each a byte range (3 bits: the block's whole row, ``_pack3``)
        unit = codes_per_unit(spec.bits) if spec.bits != 3 else spec.group
        first, stop = start // unit, -(-(start + count) // unit)
        width = unit * spec.bits // 8 if spec.bits != 3 else held.codes.shape[-1]
        if count == 1 and width == 1 and spec.bits < 8:  # one code of one byte (2 or 4 bits): a shift and a mask
            shift, byte = (start % unit) * spec.bits, held.codes[..., 0, :, first : first + 1]
            codes = byte >> shift if shift + spec.bits == 8 else (byte >> shift) & (2**spec.bits - 1)
        else:
            codes = unpack(held.codes[..., 0, :, first * width : stop * width], spec.bits, (stop - first) * unit)
            codes = codes[..., start - first * unit :][..., :count]  # [..., w, count]
        tokens = torch.addcmul(held.zero[..., 0, :, None].float(), codes, held.scale[..., 0, :, None].float())
        return tokens.transpose(-1, -2).to(self.tail.dtype)

    def _front_blocks(self, count: int) -> torch.Tensor:
        """``_front_quantized`` from the whole blocks the tokens lie in."""
        assert self.tail is not None
        unit = self._front_unit()  # whole units only: a token-layout key block may pair rows across groups
        blocks = -(-(self.offset + count) // unit) * (unit // self.quant.group)
        past = self._dequantize(self._blocks(0, blocks), self.tail.dtype)
        return past[..., self.offset : self.offset + count, :]

    def _front_unit(self) -> int:
        """Tokens freed (and dequantized from the front) at a time: whole blocks."""
        return self.quant.group

    def whole_front(self, count: int) -> int:
        """How many of the oldest ``count`` tokens to drop so that only whole units leave the quantized part."""
        # Razor's quantized windows slide by whole units: a token leaving one by one is dequantized from its
        # block at every step, then summed into the compensation token, which is rebuilt (~25 small ops per
        # store: 15 ms of a 4K decode step of SmolLM2 on 2 cores in the token layout; in KIVI's layout the
        # cheapest per-token read still cost 4-5 ms of a 1K step). So up to a unit − 1 tokens stay attended
        # past the window's length L, as stored, and a unit is dequantized once, into the compensation
        # token, when it leaves. An unquantized store has no unit: its tokens leave one by one.
        quantized_left = self.quantized_tokens - self.offset
        if count >= quantized_left:  # everything quantized goes (and some of the float tail): blocks freed
            return count
        unit = self._front_unit()
        return max(0, (self.offset + count) // unit * unit - self.offset)

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


def decode_columns(
    bias: torch.Tensor | None, keys: Any, values: Any, key: torch.Tensor, value: torch.Tensor,
    extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, skip: int = 0,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """What a decode step from the codes of growing stores (``TokenStore``s: KIVI's layout or the token layout)
    attends beside them, for ``bias [b|1, 1, 1, n]`` additive or None over the held tokens and this step's
    ``key``/``value [b, Hkv, 1, d]``: the bias ``[b, n_q − skip]`` of the quantized tokens read (the sink's stand-ins,
    whose exact copies are attended instead, and the tokens a window dropped from the front of its first block
    masked; the first ``skip`` dropped tokens not read at all), or None; the exact keys and values ``[b, Hkv, t, d]``
    (``extra``'s, the sink's, the float tail's, this step's) and their bias ``[b|1, 1|Hkv, 1, t]`` or None
    (``extra``: more exact tokens and their logits ``[b, Hkv, 1, ·]``, razor's sink and compensation token)."""
    batch = key.shape[0]
    n_q, sink, dropped = keys.quantized_tokens, (0 if keys.head is None else keys.head.shape[-2]), keys.offset
    held = n_q - dropped  # quantized tokens still in the window
    bias_q = None if bias is None else bias[:, 0, 0, :held].float().expand(batch, held)
    if sink or dropped > skip:
        pad = dropped - skip
        bias_q = torch.zeros(batch, n_q - skip, device=key.device) if bias_q is None else F.pad(bias_q, (pad, 0))
        bias_q[:, : pad + sink] = torch.finfo(torch.float32).min
    exact_k = torch.cat([t for t in (extra and extra[0], keys.head, keys.tail, key) if t is not None], dim=-2)
    exact_v = torch.cat([t for t in (extra and extra[1], values.head, values.tail, value) if t is not None], dim=-2)
    exact_bias = None if bias is None else torch.cat([bias[..., :sink], bias[..., held:]], dim=-1)  # [b|1, 1, 1, ·]
    if extra is not None:  # [b, Hkv, 1, t + ·]: the extra tokens' logits before the others' mask
        rest, logits = exact_k.shape[-2] - extra[0].shape[-2], extra[2].float()
        others = logits.new_zeros(1, 1, 1, rest) if exact_bias is None else exact_bias.float()
        exact_bias = torch.cat([logits, others.expand(*logits.shape[:-1], rest)], dim=-1)
    return bias_q, exact_k, exact_v, exact_bias
