"""Razor's preallocated cache with ``--kv-bits`` in KIVI's layout: ``StaticRazorLayer`` (16 bits) with its stores
quantized as the growing ``RazorLayer``'s are, so that ``torch.compile`` and CUDA graphs decode razor's smallest
caches too.

Retrieval heads keep every token in a ``StaticTokenStore`` (``max_cache_len`` tokens, as quant's static cache) and
a decode step reads them as quant's static layer does (``static_kivi_decode``: from the codes on a CPU, or through
the KIVI kernel at 4 bits where kernels are used; elsewhere dequantized).
The other heads keep the sink exact, then a window whose quantized blocks lie in a ring (``RingTokenStore``:
block i in slot i mod slots, enough slots for the widest window plus the block being written and the one the
window's front is leaving), the newest tokens exact in the store's own float ring, and the compensation sums.
Which tokens are quantized depends on the count alone, as in ``StaticTokenStore``: the growing window store
quantizes blocks aligned with its positions, and drops from its front only whole blocks (``TokenStore.whole_front``)
as long as the window holds at least ``residual + group`` tokens (``static_refusal`` refuses a shorter one: there the
growing store cuts its float tail and its blocks shift). A decode step reads every slot, masking by logical
position what is dropped, not written or held twice; longer steps go through a growing layer built from the
buffers and written back, as ``StaticRazorLayer`` does. Copied verbatim into every razor output directory.
"""

from __future__ import annotations

from typing import Any

import torch

from .kvconvert_codec import QuantizedBlock, QuantSpec, eager_on_cpu
from .kvconvert_common import softmax_rows
from .kvconvert_folded import kivi_decode_folded, value_rotation
from .kvconvert_kernels import use_kernels
from .kvconvert_quant import static_kivi_decode, static_reads_codes
from .kvconvert_razor import RazorLayer
from .kvconvert_razor_ops import compensated_attention, count_logit
from .kvconvert_razor_static import StaticRazorLayer
from .kvconvert_staticstore import StaticTokenStore, ring_positions
from .kvconvert_tokenlayout import StaticTokenLayoutStore, TokenLayoutStore
from .kvconvert_tokenstore import TokenStore


class RingTokenStore(StaticTokenStore):
    """A ``StaticTokenStore`` of ``slots`` blocks held in a ring: block i in slot i mod ``slots`` (a sliding window
    of a longer sequence, whose oldest blocks are overwritten once dropped)."""

    def __init__(self, quant: QuantSpec, per_channel: bool, slots: int):
        super().__init__(quant, per_channel, slots * quant.group)

    def block_slots(self, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.remainder(self.blocks)


def gather_blocks(static: StaticTokenStore, blocks: torch.Tensor) -> QuantizedBlock:
    """The codes of ``blocks`` (indices, in order) as the growing store concatenates them."""
    slots = static.block_slots(blocks)
    fields = {}
    for name, axis, per_token in static._fields():
        fields[name] = getattr(static, name).index_select(axis, static.field_rows(slots, per_token))
    return QuantizedBlock(fields["codes"], fields["scale"], fields["zero"], fields.get("center"))


def _dequantized(store: StaticTokenStore) -> torch.Tensor:
    """Every block slot of ``store`` dequantized ``[..., slots · group, w]``, in slot order."""
    assert store.ring is not None and store.codes is not None and store.scale is not None and store.zero is not None
    out = store.ring.new_empty(*store.ring.shape[:-2], store.blocks * store.quant.group, store.width)
    store._dequantize_into(QuantizedBlock(store.codes, store.scale, store.zero, store.center), out)
    return out


def load_store(static: StaticTokenStore, store: TokenStore, stored: int, start: int) -> None:
    """Fill the empty growing ``store`` with what it holds after ``stored`` tokens, the first ``start`` dropped from
    its front (only ever from whole blocks: see the module's docstring)."""
    if stored == 0:
        return
    assert static.ring is not None
    group, device = static.quant.group, static.ring.device
    quantized = static.quantized_count(stored)
    assert start <= quantized, "a window dropped tokens it had not quantized: no static layer holds that"
    first, count = start // group, quantized // group
    store.width = static.width
    if isinstance(static, StaticTokenLayoutStore) and isinstance(store, TokenLayoutStore):
        store.rows = static.codec.rows  # the packing its blocks were written in
    if first < count:  # blocks wholly dropped are freed, as ``TokenStore._free_dropped_blocks`` frees them
        store.blocks = gather_blocks(static, torch.arange(first, count, device=device))
        store.quantized_tokens, store.offset = (count - first) * group, start - first * group
    exact = torch.arange(quantized, stored, device=device).remainder(static.ring_len)
    store.tail = static.ring.index_select(-2, exact)
    if static.head is not None:
        held = min(static.quant.sink, stored)
        store.head = static.head[..., start:held, :].clone() if start < held else None
    store.front_dropped = start > 0


def save_store(store: TokenStore, static: StaticTokenStore, stored: int) -> None:
    """Write the growing ``store``'s state after ``stored`` tokens into ``static`` (its float tail into the ring, its
    blocks into their slots, what is left of its exact sink into the head)."""
    if store.tail is None:
        return
    assert static.ring is not None
    group, device = static.quant.group, static.ring.device
    quantized = stored - store.tail.shape[-2]
    if store.blocks is not None:
        first = (quantized - store.quantized_tokens) // group
        assert (quantized - store.quantized_tokens) % group == 0, "the store's blocks left its positions' grid"
        slots = static.block_slots(torch.arange(first, quantized // group, device=device))
        for name, axis, per_token in static._fields():
            getattr(static, name).index_copy_(axis, static.field_rows(slots, per_token), getattr(store.blocks, name))
    static.ring.index_copy_(-2, torch.arange(quantized, stored, device=device).remainder(static.ring_len),
                            store.tail)  # fmt: skip
    if static.head is not None and store.head is not None:
        start = stored - len(store)  # the oldest held token: the head's first
        static.head[..., start : start + store.head.shape[-2], :] = store.head


def window_static_refusal(quant: QuantSpec, layers: int, window: int) -> str | None:
    """Why windows of at least ``window`` tokens sliding over this storage have no preallocated layer (razor's
    ``RingTokenStore``), or None. Its blocks must follow the positions, which holds while a window drops only quantized
    tokens (at least ``residual + group`` wide: a narrower one cuts the float tail, shifting the blocks); KIVI's
    layout or the token layout, every layer's keys and values quantized (the token layout's windows leave by whole
    units from blocks that follow the positions too: ``StaticRazorTokenLayer``)."""
    if not all(quant.side(i, keys).quantized for i in range(layers) for keys in (True, False)):
        return "their static layer quantizes keys and values alike; this checkpoint keeps some at 16 bits"
    tail = quant.residual + quant.group
    return None if window >= tail else f"{window} tokens, shorter than residual + group ({tail}) as this layer needs"


class StaticRazorKiviLayer(StaticRazorLayer):
    """``StaticRazorLayer`` whose stores are quantized in KIVI's layout (keys per channel, values per token): the
    retrieval heads' ``full_keys/values`` (``StaticTokenStore``, ``[b, R, ·, d]``), the other heads' exact sink
    ``sink_k/v [b, N, sink, d]`` and window ``window_keys/values`` (``RingTokenStore``), the float32 compensation sums
    ``[b, N, 1, d]`` and counts ``[b]``."""

    buffers: tuple[str, ...] = ("sink_k", "sink_v", "comp_k_sum", "comp_v_sum", "comp_count")
    unit = 1  # tokens that leave the window together: the growing store's ``_front_unit`` (``_make_stores``)
    sink_k: Any
    sink_v: Any
    full_keys: StaticTokenStore
    full_values: StaticTokenStore
    window_keys: StaticTokenStore
    window_values: StaticTokenStore

    def __init__(self, retrieval: list[int], others: list[int], sink: int, window: int, window_frac: float,
                 max_cache_len: int, quant: QuantSpec, layer: int):  # fmt: skip
        super().__init__(retrieval, others, sink, window, window_frac, max_cache_len)
        self.quant, self.layer = quant, layer
        self._make_stores(quant.side(layer, keys=True), quant.side(layer, keys=False))

    def _make_stores(self, keys: QuantSpec, values: QuantSpec) -> None:
        """The retrieval heads' stores for ``max_cache_len`` tokens and the windows' rings, in KIVI's layout."""
        self.unit = TokenStore(keys, True)._front_unit()  # what the growing window drops at once (whole blocks)
        self.full_keys = StaticTokenStore(keys, True, self.max_cache_len)
        self.full_values = StaticTokenStore(values, False, self.max_cache_len)
        slots = self._ring_slots(keys.group)
        self.window_keys, self.window_values = RingTokenStore(keys, True, slots), RingTokenStore(values, False, slots)

    def _window_start(self, total: torch.Tensor) -> torch.Tensor:
        """The window's first logical position after ``total`` tokens: its front moves by whole units, as far as
        ``max(sink, total − L(total))`` allows (``TokenStore.whole_front``)."""
        budget = (total.double() * self.window_frac).floor().long().clamp(min=self.window)
        stored = (total - self.sink).clamp(min=0)
        return self.sink + (stored - budget).clamp(min=0) // self.unit * self.unit

    def _ring_slots(self, group: int) -> int:
        """Blocks a window's ring holds: the widest window before its step's drop with the ``unit`` − 1 tokens that
        wait to leave together, the block its newest tokens fill, the block its front leaves."""
        return -(-(self.capacity + self.unit - 1) // group) + 2

    def _stores(self) -> list[StaticTokenStore]:
        return [*((self.full_keys, self.full_values) if self.retrieval else ()),
                *((self.window_keys, self.window_values) if self.others else ())]  # fmt: skip

    def _held(self) -> list[torch.Tensor]:
        return [t for store in self._stores() for t in store.held()] + [
            t for t in (getattr(self, name) for name in self.buffers) if t is not None]  # fmt: skip

    def rows(self) -> int:
        held = self._held()
        return held[0].shape[0] if held else 0

    def apply(self, fn: Any) -> None:
        super().apply(fn)
        for store in self._stores():
            store.apply(fn)

    def _allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        batch, dim = key.shape[0], key.shape[-1]
        self.dtype, self.device = key.dtype, key.device
        r, o = len(self.retrieval), len(self.others)
        for store, heads, like in ((self.full_keys, r, key), (self.full_values, r, value),
                                   (self.window_keys, o, key), (self.window_values, o, value)):  # fmt: skip
            if heads:
                store._allocate(like.new_zeros(batch, heads, 1, dim))
        if o:
            self.sink_k = key.new_zeros(batch, o, self.sink, dim)
            self.sink_v = value.new_zeros(batch, o, self.sink, dim)
            self.comp_k_sum = key.new_zeros(batch, o, 1, dim, dtype=torch.float32)
            self.comp_v_sum = value.new_zeros(batch, o, 1, dim, dtype=torch.float32)
            self.comp_count = key.new_zeros(batch, dtype=torch.float32)
        self._initialized(key.device)

    # --- a decode step, in tensors only
    def _decode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                scale: float) -> torch.Tensor:  # fmt: skip
        """One token: the retrieval heads over every slot of their stores, the other heads over sink + window +
        compensation token, then the token stored and what left the window compensated. ``[b, H, 1, d]``."""
        batch, heads, _, dim = query.shape
        kv_heads = key.shape[1]
        group = heads // kv_heads
        bias = self._bias(attention_mask, query.dtype)
        rows = query.reshape(batch, kv_heads, group, dim)  # a KV group's query heads are adjacent
        out = query.new_empty(rows.shape)
        if self.retrieval:
            at, full_keys, full_values = self.at_r, self.full_keys, self.full_values
            mine = rows[:, at].reshape(batch, -1, 1, dim)  # the retrieval heads' query heads
            read = self._read_codes(mine, key[:, at], value[:, at], attention_mask, scale)
            if read is not None:
                out[:, at] = read.to(query.dtype).view(batch, -1, group, dim)
                full_keys.extend_only(key[:, at], self.filled)
                full_values.extend_only(value[:, at], self.filled)
            else:
                keys = full_keys.extend(key[:, at], self.filled)
                values = full_values.extend(value[:, at], self.filled)
                scores = rows[:, at] @ keys.transpose(-1, -2) * scale + bias
                out[:, at] = softmax_rows(scores, value.dtype) @ values
        if self.others:
            at = self.at_o
            out[:, at] = self._decode_window(rows[:, at], key[:, at], value[:, at], bias, scale)
        self._advance(1)
        return out.view(batch, heads, 1, dim)

    def _read_codes(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    scale: float) -> torch.Tensor | None:  # fmt: skip
        """The retrieval heads' step ``[b, R·G, 1, d]`` read from their codes where quant's static layer reads them (a
        CPU; a GPU's kernel at 4 bits), writing nothing; None: read them dequantized."""
        full_keys, full_values, dim = self.full_keys, self.full_values, query.shape[-1]
        kernel = static_reads_codes(full_keys, full_values, dim, kernel=True) and use_kernels(query, "graphs")
        if not (kernel or (query.device.type == "cpu" and static_reads_codes(full_keys, full_values, dim))):
            return None
        return static_kivi_decode(query, key, value, attention_mask, scale, full_keys, full_values, self.filled,
                                  self.max_cache_len, kernel)  # fmt: skip

    def _window_columns(self, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """What the other heads' step attends, by column: the razor sink, every block slot of the window store, its
        float ring, its exact sink (``head`` tokens), this step's token. Returns the window's first logical position
        before this step's drop, the columns' additive bias ``[b|1, 1, 1, columns]`` and ``head``."""
        seen, sink, device = self.filled, self.sink, bias.device
        keys = self.window_keys
        assert keys.ring is not None
        group, minimum = keys.quant.group, torch.finfo(bias.dtype).min
        stored = (seen - sink).clamp(min=0)  # the window store's tokens before this step
        quantized = keys.quantized_count(stored)
        start = self._window_start(seen)  # the window's first logical position before this step's drop
        head = keys.quant.sink if keys.head is not None else 0  # the store's exact sink, over its block's stand-ins
        # the store position each column holds: the ring's blocks (slot s: the newest block ≡ s below the count),
        # the float ring's slots (the newest position ≡ slot), the store's sink; then the column's validity
        count = quantized // group
        in_blocks = (ring_positions(count, keys.blocks, device)[:, None] * group
                     + torch.arange(group, device=device)).flatten()  # fmt: skip
        in_ring = ring_positions(stored, keys.ring_len, device)
        in_head = torch.arange(head, device=device)
        positions = torch.cat([in_blocks, in_ring, in_head])
        held = torch.cat([(in_blocks >= head) & (in_blocks < quantized), (in_ring >= quantized) & (in_ring >= head),
                          in_head < stored]) & (positions >= 0) & (positions + sink >= start)  # fmt: skip
        logical = torch.cat([torch.arange(sink, device=device), positions + sink, seen.view(1)])
        visible = torch.cat([torch.arange(sink, device=device) < seen, held, torch.ones(1, dtype=torch.bool,
                                                                                        device=device)])  # fmt: skip
        column_bias = torch.where(visible, bias.index_select(-1, logical.clamp(0, self.max_cache_len - 1)), minimum)
        return start, column_bias, head

    def _leaving(self, start: torch.Tensor, head: int, blocks: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """The tokens at the window's front that leave it together (``unit``: a block in KIVI's layout, a whole unit in
        the token layout) as the growing store hands them over: dequantized from
        their blocks (``blocks``: every slot dequantized already; else only theirs), exact from the store's sink where
        it holds them. ``(keys, values) [b, N, unit, d]`` and their logical positions ``[unit]`` (``_add_dropped``
        weighs each by whether it leaves); None where the count says nothing leaves (eagerly on a CPU, where it is
        free to read)."""
        unit, device = self.unit, start.device
        if eager_on_cpu(device) and not bool(self._window_start(self.filled + 1) > start):
            return None
        gone = start - self.sink  # the first one's position in the window store
        positions = gone + torch.arange(unit, device=device)
        states = []
        for store, every in zip((self.window_keys, self.window_values), blocks or (None, None), strict=True):
            assert store.ring is not None
            group = store.quant.group
            if every is not None:  # every slot's tokens, slot by slot
                out = every.index_select(2, (positions // group).remainder(store.blocks) * group + positions % group)
            else:  # the blocks they lie in: one (a token), or a unit's whole blocks
                first, count = gone // group, max(1, unit // group)
                out = store.ring.new_empty(*store.ring.shape[:-2], count * group, store.width)
                store._dequantize_into(gather_blocks(store, first + torch.arange(count, device=device)), out)
                out = out.index_select(2, positions - first * group)
            if head:  # tokens in the store's sink: exact (their block holds stand-ins)
                assert store.head is not None
                exact = store.head.index_select(2, positions.clamp(max=head - 1))
                out = torch.where((positions < head).view(-1, 1), exact, out)
            states.append(out)
        return states[0], states[1], positions + self.sink

    def _decode_window(self, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
                       scale: float) -> torch.Tensor:  # fmt: skip
        """The other heads' step ``[b, N, G, d]`` (``rows``: their query heads by KV head), then their writes: from the
        ring's codes where the CPU's reader reads them, else every slot dequantized."""
        start, column_bias, head = self._window_columns(bias)
        keys, values = self.window_keys, self.window_values
        assert keys.ring is not None and values.ring is not None
        if rows.device.type == "cpu" and self._window_reads_codes(rows.shape[-1]):
            out = self._window_from_codes(rows, key, value, column_bias, head, scale)
            self._window_writes(key, value, self._leaving(start, head), bias)
            return out
        # what the blocks hold, dequantized (the compensation's dropped token is read from it too)
        block_k, block_v = _dequantized(keys), _dequantized(values)
        parts_k = [self.sink_k, block_k, keys.ring, *([keys.head] if head else []), key]
        parts_v = [self.sink_v, block_v, values.ring, *([values.head] if head else []), value]
        # scored part by part, not concatenated: a compiled step copied the concatenated keys and values through
        # aten::cat at 0.9 ms a layer (SmolLM2's shapes at 4K, three window heads), more than all the rest
        scores = torch.cat([rows @ part.transpose(-1, -2) for part in parts_k], dim=-1) * scale + column_bias
        comp_k, comp_v = self._compensation_token(key.dtype, value.dtype)
        out = compensated_attention(rows, tuple(parts_k), tuple(parts_v), scores, comp_k, comp_v, self.comp_count,
                                    scale)  # fmt: skip
        self._window_writes(key, value, self._leaving(start, head, (block_k, block_v)), bias)
        return out

    def _window_reads_codes(self, dim: int) -> bool:
        """The CPU's reader reads the ring's codes (``kivi_decode_folded``, as quant's static layer reads its own)."""
        return static_reads_codes(self.window_keys, self.window_values, dim)

    def _window_from_codes(self, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, column_bias: torch.Tensor,
                           head: int, scale: float) -> torch.Tensor:  # fmt: skip
        """The other heads' step over every slot of the ring read from its codes in one pass (``_read_window``), the
        razor sink, the store's float ring and exact sink, this step's token and the compensation token (its logit
        ``ln N_d``) joining as exact columns. ``[b, N, G, d]``."""
        keys, values = self.window_keys, self.window_values
        assert keys.ring is not None and values.ring is not None
        batch, sink, length = rows.shape[0], self.sink, keys.blocks * keys.quant.group
        # the columns' bias: [razor sink, the ring's blocks, the float ring, the store's sink, this step's token]
        flat = column_bias.reshape(column_bias.shape[0], -1).float().expand(batch, -1)
        comp_k, comp_v = self._compensation_token(key.dtype, value.dtype)
        extra_k: list[Any] = [keys.head] if head else []  # the store's exact sink (its block holds stand-ins)
        extra_v: list[Any] = [values.head] if head else []
        exact_k = torch.cat([self.sink_k, keys.ring, *extra_k, key, comp_k], dim=2)
        exact_v = torch.cat([self.sink_v, values.ring, *extra_v, value, comp_v], dim=2)
        exact_bias = torch.cat([flat[:, :sink], flat[:, sink + length :], count_logit(self.comp_count)[:, None]], -1)
        exact = exact_k, exact_v, exact_bias[:, None, None]
        return self._read_window(rows, scale, flat[:, sink : sink + length], exact).to(rows.dtype)

    def _read_window(self, rows: torch.Tensor, scale: float, bias_q: torch.Tensor,
                     exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """``rows [b, N, G, d]`` over every block slot of the ring (``bias_q [b, slots·group]``) and the ``exact``
        columns: ``kivi_decode_folded``, the torch reader of KIVI's codes. ``[b, N, G, d]`` float32."""
        keys, values = self.window_keys, self.window_values
        codes = (keys.codes, keys.scale, keys.zero, values.codes, values.scale, values.zero)
        rotated = value_rotation(values, rows.shape[-1], rows.device)
        acc, ml = kivi_decode_folded(rows.float(), *codes, bias_q, scale, keys.quant.bits, values.quant.bits,  # type: ignore[arg-type]
                                     exact=exact, value_rotation=rotated)  # fmt: skip
        return acc / ml[..., 1:]

    def _window_writes(self, key: torch.Tensor, value: torch.Tensor, leaving: Any, bias: torch.Tensor) -> None:
        """This step's token written: the razor sink (a token past it rewrites a slot with what it held), then the
        window store, which a token inside the sink writes at position 0 too, to be overwritten by position 0's own
        token; then what left the window (``_leaving``'s tokens and positions; None: nothing did) into the sums."""
        seen, sink = self.filled, self.sink
        if sink:
            slot = seen.clamp(max=sink - 1).view(1)
            self.sink_k.index_copy_(2, slot, torch.where(seen < sink, key, self.sink_k.index_select(2, slot)))
            self.sink_v.index_copy_(2, slot, torch.where(seen < sink, value, self.sink_v.index_select(2, slot)))
        stored = (seen - sink).clamp(min=0)
        self.window_keys.extend_only(key, stored)
        self.window_values.extend_only(value, stored)
        if leaving is not None:
            gone_k, gone_v, positions = leaving
            self._add_dropped(gone_k, gone_v, positions, bias)

    # --- prefill and other multi-token steps, through the growing layer
    def _load(self, layer: RazorLayer, seen: int) -> None:
        layer.is_initialized, layer.dtype, layer.device = True, self.dtype, self.device
        if self.retrieval:
            load_store(self.full_keys, layer.full_k, seen, 0)
            load_store(self.full_values, layer.full_v, seen, 0)
        if self.others:
            held = min(self.sink, seen)
            layer.sink_k, layer.sink_v = self.sink_k[:, :, :held].clone(), self.sink_v[:, :, :held].clone()
            stored, start = max(0, seen - self.sink), int(self._window_start(torch.tensor(seen))) - self.sink
            load_store(self.window_keys, layer.recent_k, stored, start)
            load_store(self.window_values, layer.recent_v, stored, start)
            self._carry_compensation(layer, into_buffers=False)
        layer.seen = seen

    def _store(self, layer: RazorLayer) -> None:
        seen = layer.seen
        if self.retrieval:
            save_store(layer.full_k, self.full_keys, seen)
            save_store(layer.full_v, self.full_values, seen)
        if self.others:
            held = layer.sink_k.shape[2]
            self.sink_k[:, :, :held] = layer.sink_k
            self.sink_v[:, :, :held] = layer.sink_v
            stored = max(0, seen - self.sink)
            save_store(layer.recent_k, self.window_keys, stored)
            save_store(layer.recent_v, self.window_values, stored)
            self._carry_compensation(layer, into_buffers=True)
        self.filled.fill_(seen)
