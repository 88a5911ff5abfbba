"""Razor's preallocated cache (``generate(cache_implementation="static")``, ``torch.compile``, CUDA graphs).

``RazorLayer`` keeps exactly what the paper keeps, in tensors that grow and shrink: a decode step changes their
shapes, so a compiled step would recompile at every token. This layer holds the same state in buffers of fixed
shapes, written in place: retrieval heads' keys and values for ``max_cache_len`` tokens; the other heads' sink
and, after it in the same buffer, a ring of ``L_max + 1`` slots for their window (``L_max`` the window at
``max_cache_len`` tokens; one more slot holds this step's token while the oldest one still waits to be
compensated), the compensation sums and counts. A slot's logical position (``window_pos``) decides whether it is
inside the window, so a step masks instead of slicing, and sink and window are read as one tensor (by torch, or by
the head-wise Triton kernel when ``KVCONVERT_KERNELS=triton``). A decode step (one token) is written in tensors
only; longer steps (prefill, chunks) rebuild a growing ``RazorLayer`` from the buffers, let it attend and evict,
and write its state back: the two paths compute what the growing cache computes. 16-bit stores; with ``--kv-bits``
in KIVI's layout, ``StaticRazorKiviLayer`` (``kvconvert_razor_kivi``), in the token layout ``StaticRazorTokenLayer``
(``kvconvert_razor_token``).
"""

from __future__ import annotations

from typing import Any

import torch

from .kvconvert_codec import QuantSpec
from .kvconvert_common import softmax_rows
from .kvconvert_kernels import razor_decode_triton, use_kernels
from .kvconvert_prefill import additive_mask
from .kvconvert_razor import RazorLayer, attend_state
from .kvconvert_razor_ops import compensated_attention, count_logit, head_span, head_tables, window_budget
from .kvconvert_storage import StaticKVLayer


class StaticRazorLayer(StaticKVLayer):
    """``RazorLayer``'s state preallocated (``StaticKVLayer``): ``full_k/v [b, R, max_cache_len, d]``;
    ``window_k/v [b, N, sink + capacity, d]``, the sink's slots then the ring's, with ``window_pos [sink +
    capacity]`` (the logical position each slot holds, -1 for none: the same for every row, as positions are cache
    slots); the float32 compensation sums ``[b, N, 1, d]`` and counts ``[b]``."""

    buffers: tuple[str, ...] = ("full_k", "full_v", "window_k", "window_v", "comp_k_sum", "comp_v_sum", "comp_count")
    _keep_in_fp32 = ("comp_k_sum", "comp_v_sum", "comp_count")  # sums of many tokens: float32 in any model dtype
    # tensors once allocated (None before, or for a kind of head the layer lacks); Any keeps the state terse
    full_k: Any
    full_v: Any
    window_k: Any
    window_v: Any
    comp_k_sum: Any
    comp_v_sum: Any
    comp_count: Any

    def __init__(self, retrieval: list[int], others: list[int], sink: int, window: int, window_frac: float,
                 max_cache_len: int):  # fmt: skip
        super().__init__(max_cache_len)
        self.retrieval, self.others = retrieval, others
        self.sink, self.window, self.window_frac = sink, window, window_frac
        # the window before a step's eviction: at most L(n) tokens held, plus the step's own
        self.capacity = window_budget(max_cache_len, window, window_frac) + 1
        self.window_pos: Any = None
        self.at_r: Any = None  # set with the buffers (``_index_heads``)
        self.at_o: Any = None
        self.kernel_tables: Any = None
        self.quant, self.layer = QuantSpec(), 0  # 16 bits (``StaticRazorKiviLayer``: its stores' storage)

    def _window_start(self, total: torch.Tensor) -> torch.Tensor:
        """First logical position of the window after ``total`` tokens: max(sink, total − L(total)); float64, as
        ``window_budget``'s ``int(total * window_frac)`` rounds."""
        budget = (total.double() * self.window_frac).floor().long().clamp(min=self.window)
        return (total - budget).clamp(min=self.sink)

    def _slot(self, position: torch.Tensor) -> torch.Tensor:
        """The window buffer's slot of a logical position: its own below the sink, else the ring's."""
        ring = self.sink + (position - self.sink).clamp(min=0) % self.capacity
        return torch.where(position < self.sink, position, ring)

    def _held(self) -> list[torch.Tensor]:
        return super()._held() + ([self.window_pos] if self.window_pos is not None else [])

    def rows(self) -> int:
        held = super()._held()
        return held[0].shape[0] if held else 0

    def reset(self) -> None:
        super().reset()
        if self.window_pos is not None:
            self.window_pos.fill_(-1)

    def crop_to(self, length: int) -> None:
        if length < int(self.filled):
            raise ValueError("a razor cache cannot be cropped: the tokens it dropped are gone")

    def _allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        batch = key.shape[0]
        self.dtype, self.device = key.dtype, key.device

        def zeros(heads: list[int], length: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> Any:
            return like.new_zeros(batch, len(heads), length, like.shape[-1], dtype=dtype) if heads else None

        r, o, slots = self.retrieval, self.others, self.sink + self.capacity
        self.full_k, self.full_v = zeros(r, self.max_cache_len, key), zeros(r, self.max_cache_len, value)
        self.window_k, self.window_v = zeros(o, slots, key), zeros(o, slots, value)
        self.comp_k_sum, self.comp_v_sum = zeros(o, 1, key, torch.float32), zeros(o, 1, value, torch.float32)
        self.comp_count = key.new_zeros(batch, dtype=torch.float32) if o else None
        self.window_pos = torch.full((slots,), -1, dtype=torch.long, device=key.device) if o else None
        self.filled = self.filled.to(key.device)
        self._initialized(key.device)

    def _index_heads(self, heads: int, device: torch.device) -> None:
        """Each kind of KV head as an index on ``device`` (a slice where consecutive: views), and the head-wise
        kernel's tables, made once: a step that built them from Python lists would copy them to the GPU each time,
        which a CUDA-graph capture refuses (measured on an H200)."""

        def index(kind: list[int]) -> Any:
            if not kind:  # the layer has no head of this kind: never indexed
                return None
            span = head_span(kind)
            return span if isinstance(span, slice) else torch.tensor(span, device=device)

        self.at_r, self.at_o = index(self.retrieval), index(self.others)
        group = heads // (len(self.retrieval) + len(self.others))
        self.kernel_tables = head_tables(self.retrieval, self.others, heads, group, device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Called by the stock attention module; ``attend`` stores and reads."""
        return key_states, value_states

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float | None) -> tuple[torch.Tensor, None]:  # fmt: skip
        if not self.is_initialized:
            self._allocate(key, value)
            self._index_heads(query.shape[1], key.device)
        count = key.shape[2]
        self._check_room(count)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        if count > 1:
            return self._attend_growing(query, key, value, attention_mask, scale)
        out = self._decode(query, key, value, attention_mask, scale)
        return out.transpose(1, 2).contiguous(), None

    # --- a decode step, in tensors only
    def _bias(self, attention_mask: Any, dtype: torch.dtype) -> torch.Tensor:
        """The step's additive bias over every logical position ``[b|1, 1, 1, max_cache_len]``; None (no padding,
        a mask transformers skipped): every written slot visible."""
        bias = additive_mask(attention_mask, 1, self.max_cache_len, dtype, self.filled.device)
        if bias is None:
            positions = torch.arange(self.max_cache_len, device=self.filled.device)
            return torch.where(positions <= self.filled, 0.0, torch.finfo(dtype).min).to(dtype)[None, None, None]
        return bias

    def _decode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                scale: float) -> torch.Tensor:  # fmt: skip
        """One token: write it, attend (retrieval heads over every slot, the others over sink + window +
        compensation token), then compensate what left the window. ``[b, H, 1, d]``."""
        batch, heads, _, dim = query.shape
        group = heads // key.shape[1]
        bias = self._bias(attention_mask, query.dtype)
        seen = self.filled
        r, o = self.retrieval, self.others
        at_r, at_o = self.at_r, self.at_o
        if r:
            self.full_k.index_copy_(2, seen.view(1), key[:, at_r])
            self.full_v.index_copy_(2, seen.view(1), value[:, at_r])
        window_bias = start = None
        if o:
            at = self._slot(seen).view(1)
            self.window_k.index_copy_(2, at, key[:, at_o])
            self.window_v.index_copy_(2, at, value[:, at_o])
            self.window_pos.index_copy_(0, at, seen.view(1))
            start = self._window_start(seen)  # the window before this step's eviction, then its new token
            pos = self.window_pos
            inside = (pos >= 0) & ((pos < self.sink) | (pos >= start))
            window_bias = torch.where(inside, bias.index_select(-1, pos.clamp(min=0)), torch.finfo(bias.dtype).min)
        count = self.comp_count
        if o:
            comp_k, comp_v = self._compensation_token(key.dtype, value.dtype)
        if use_kernels(query):
            out = self._decode_with_kernel(query, bias, window_bias, comp_k if o else None, comp_v if o else None,
                                           group, scale)  # fmt: skip
        else:
            rows = query.reshape(batch, heads // group, group, dim)  # a KV group's query heads are adjacent
            out = query.new_empty(rows.shape)
            if r:
                scores = rows[:, at_r] @ self.full_k.transpose(-1, -2) * scale + bias
                out[:, at_r] = softmax_rows(scores, value.dtype) @ self.full_v
            if o:
                scores = rows[:, at_o] @ self.window_k.transpose(-1, -2) * scale + window_bias
                out[:, at_o] = compensated_attention(rows[:, at_o], self.window_k, self.window_v, scores, comp_k,
                                                     comp_v, count, scale)  # fmt: skip
            out = out.view(batch, heads, 1, dim)
        if o:
            assert start is not None
            self._compensate(start, bias)
        self._advance(1)
        return out

    def _compensation_token(self, key_dtype: torch.dtype, value_dtype: torch.dtype) -> tuple[Any, Any]:
        """The dropped tokens' mean key and value ``[b, N, 1, d]`` (zeros before any)."""
        denominator = self.comp_count.clamp(min=1).view(-1, 1, 1, 1)
        return (self.comp_k_sum / denominator).to(key_dtype), (self.comp_v_sum / denominator).to(value_dtype)

    def _compensate(self, start: torch.Tensor, bias: torch.Tensor) -> None:
        """What left the window this step (0 or 1 token: L grows by at most one a step) goes into the sums."""
        gone = self._slot(start).view(1)
        self._add_dropped(self.window_k.index_select(2, gone), self.window_v.index_select(2, gone), start.view(1), bias)

    def _add_dropped(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor) -> None:
        """Add the tokens at logical ``positions [u]`` (``key/value [b, N, u, d]``) that leave the window after this
        step to the sums, summed as the growing layer sums what it drops; padding never counts."""
        leaves = self._window_start(self.filled + 1) > positions
        real = bias.index_select(-1, positions.clamp(max=self.max_cache_len - 1)) == 0  # [b|1, 1, 1, u]
        weight = torch.where(leaves, real.float(), 0.0)
        weight = weight.reshape(weight.shape[0], 1, -1, 1)  # [b|1, 1, u, 1]
        self.comp_k_sum.add_((key.float() * weight).sum(2, keepdim=True))
        self.comp_v_sum.add_((value.float() * weight).sum(2, keepdim=True))
        self.comp_count.add_(weight.sum((1, 2, 3)).expand_as(self.comp_count))

    def _decode_with_kernel(self, query: torch.Tensor, bias: torch.Tensor, window_bias: Any, comp_k: Any,
                            comp_v: Any, group: int, scale: float) -> torch.Tensor:  # fmt: skip
        """The step of every head in one launch of the head-wise kernel, over the buffers as they are."""
        batch, heads, _, dim = query.shape
        r, o = self.retrieval, self.others
        empty = query.new_zeros(batch, 1, 1, dim)  # stands in for a kind of head this layer does not have
        row_bias = bias[:, 0, 0].expand(batch, -1).float()
        full_k, full_v = (self.full_k, self.full_v) if r else (empty, empty)
        full_bias = row_bias if r else row_bias[:, :1]
        if o:
            short_k, short_v, short_bias = self.window_k, self.window_v, window_bias[:, 0, 0].expand(batch, -1)
            comp_logit = count_logit(self.comp_count)
        else:
            short_k, short_v, short_bias = empty, empty, row_bias[:, :1]
            comp_k = comp_v = query.new_zeros(batch, 1, 1, dim)
            comp_logit = query.new_zeros(batch, dtype=torch.float32)
        kind, slot = self.kernel_tables
        out = razor_decode_triton(query[:, :, 0], full_k, full_v, full_bias, short_k, short_v, short_bias,
                                  comp_k[:, :, 0], comp_v[:, :, 0], comp_logit, kind, slot, scale)  # fmt: skip
        return out.to(query.dtype)[:, :, None]

    # --- prefill and other multi-token steps, through the growing layer
    def _attend_growing(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                        scale: float) -> tuple[torch.Tensor, None]:  # fmt: skip
        seen = int(self.filled)
        layer = RazorLayer(self.retrieval, self.others, self.sink, self.window, self.window_frac, self.quant,
                           self.layer)  # fmt: skip
        if seen:
            self._load(layer, seen)
        out = attend_state(query, key, value, attention_mask, scale, layer)
        self._store(layer)
        return out

    def _load(self, layer: RazorLayer, seen: int) -> None:
        """``layer`` holding this layer's state after ``seen`` tokens."""
        layer.is_initialized, layer.dtype, layer.device = True, self.dtype, self.device
        if self.retrieval:
            layer.full_k.append(self.full_k[:, :, :seen])
            layer.full_v.append(self.full_v[:, :, :seen])
        if self.others:
            sink = min(self.sink, seen)
            layer.sink_k, layer.sink_v = self.window_k[:, :, :sink].clone(), self.window_v[:, :, :sink].clone()
            start = min(seen, int(self._window_start(torch.tensor(seen))))  # the sink may not be full yet
            slots = self._slot(torch.arange(start, seen, device=self.device))
            layer.recent_k.append(self.window_k.index_select(2, slots))
            layer.recent_v.append(self.window_v.index_select(2, slots))
            self._carry_compensation(layer, into_buffers=False)
        layer.seen = seen

    def _carry_compensation(self, layer: RazorLayer, into_buffers: bool) -> None:
        """The compensation sums and counts copied into the buffers from ``layer`` (in place: fixed addresses), or
        into ``layer`` from the buffers (copies: the growing layer replaces its own)."""
        for name in self._keep_in_fp32:
            if into_buffers:
                getattr(self, name).copy_(getattr(layer, name))
            else:
                setattr(layer, name, getattr(self, name).clone())

    def _store(self, layer: RazorLayer) -> None:
        """Write ``layer``'s state (after its step) into the buffers."""
        seen = layer.seen
        if self.retrieval:
            self.full_k[:, :, :seen] = layer.full_k.read()
            self.full_v[:, :, :seen] = layer.full_v.read()
        if self.others:
            held = len(layer.recent_k)
            keys, values = [layer.sink_k], [layer.sink_v]
            if held:
                keys.append(layer.recent_k.read())
                values.append(layer.recent_v.read())
            positions = torch.cat([torch.arange(layer.sink_k.shape[2]), torch.arange(seen - held, seen)])
            positions = positions.to(self.device)
            slots = self._slot(positions)
            self.window_k.index_copy_(2, slots, torch.cat(keys, dim=2))
            self.window_v.index_copy_(2, slots, torch.cat(values, dim=2))
            self.window_pos.index_copy_(0, slots, positions)
            self._carry_compensation(layer, into_buffers=True)
        self.filled.fill_(seen)
