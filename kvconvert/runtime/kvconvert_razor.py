"""RazorAttention runtime (Tang et al., "RazorAttention: efficient KV cache compression through retrieval heads").

Weights and attention modules stay stock. A registered attention function does the work, with a
head-wise cache: retrieval KV heads keep every token; the other KV heads keep the first ``sink``
tokens, the most recent L = max(window, N·window_frac) tokens and one compensation token per head
holding the mean of all dropped keys and values with their count N_d (paper eq. 4), attended as in
eq. 5. Prefill attends over everything and the cache is compressed afterwards (Algorithm 1); decode
attends over the compressed cache. Copied verbatim into every razor output directory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kvconvert_codec import QuantSpec
from .kvconvert_common import LayerStateCache, cache_layer_of, static_refusal
from .kvconvert_kernels import razor_decode_triton, use_kernels
from .kvconvert_prefill import additive_mask, last_row_valid, prefill_attention
from .kvconvert_products import keys_first
from .kvconvert_quant import int4_values_or, kivi_decode, kivi_kernel_reads, token_reader, token_values_store
from .kvconvert_razor_ops import (
    attend_chunk,
    compensated_attention,
    count_logit,
    extra_logits,
    grouped_bias,
    head_span,
    head_tables,
    query_heads,
    window_budget,
)
from .kvconvert_storage import KVLayer, sliding_layer, static_sliding_layer
from .kvconvert_tokenlayout import TokenLayoutStore
from .kvconvert_tokenstore import TokenStore

IMPLEMENTATION = "kvconvert_razor"


class RazorLayer(KVLayer):
    """One layer's head-wise state. Retrieval KV heads: ``full_k/full_v`` stores of ``[b, R, n, d]``.
    Other KV heads: ``sink_k/v [b, N, ≤sink, d]`` (float), ``recent_k/v`` stores of ``[b, N, ≤L, d]``,
    ``comp_k/v_sum [b, N, 1, d]`` (float32 running sums of dropped tokens) and ``comp_count [b]``
    (dropped non-padding tokens). Stores are quantized when the checkpoint asks for it (keys per
    channel, values per token). ``seen`` is the logical sequence length the masks are built for."""

    _keep_in_fp32 = ("comp_k_sum", "comp_v_sum", "comp_count")  # sums of many tokens: float32 in any model dtype

    def __init__(self, retrieval: list[int], others: list[int], sink: int, window: int, window_frac: float,
                 quant: QuantSpec | None = None, layer: int = 0):  # fmt: skip
        super().__init__()
        self.retrieval, self.others = retrieval, others
        self.sink, self.window, self.window_frac = sink, window, window_frac
        self.quant, self.layer = quant or QuantSpec(), layer
        self._head_index: dict[tuple[bool, torch.device], torch.Tensor] = {}  # ``_heads``' index per kind and device
        self.reset()

    def _heads(self, states: torch.Tensor, retrieval: bool) -> torch.Tensor:
        """``states[:, heads]`` (the retrieval or the other KV heads) as a copy for a store, in one op: indexing with
        the list costs four (the index built from it each time), a few hundred a decode step over a model's layers."""
        key = (retrieval, states.device)
        index = self._head_index.get(key)
        if index is None:
            heads = self.retrieval if retrieval else self.others
            index = self._head_index[key] = torch.tensor(heads, dtype=torch.long, device=states.device)
        return states.index_select(1, index)

    def reset(self) -> None:
        self.seen = 0
        keys, values = self.quant.side(self.layer, keys=True), self.quant.side(self.layer, keys=False)
        if self.quant.layout == "token":  # decoded from the codes (``token_decode``), windows included
            self.full_k: TokenStore = TokenLayoutStore(keys, keys=True)
            self.recent_k: TokenStore = TokenLayoutStore(keys, keys=True)
            # values of their own width (``--kv-value-bits``): per token in KIVI's packing, quantized in the same
            # blocks as the keys (same group and residual), so both sides' windows drop the same whole blocks
            self.full_v: TokenStore = token_values_store(self.quant, self.layer)
            self.recent_v: TokenStore = token_values_store(self.quant, self.layer)
        else:
            self.full_k, self.full_v = TokenStore(keys, True), TokenStore(values, False)
            self.recent_k, self.recent_v = TokenStore(keys, True), TokenStore(values, False)
        # tensors once the layer has seen its first tokens (None before); Any keeps the state terse
        self.sink_k: Any = None
        self.sink_v: Any = None
        self.comp_k_sum: Any = None
        self.comp_v_sum: Any = None
        self.comp_count: Any = None
        self._derived: Any = None  # ``derived``'s and ``extra_tokens``' tensors until the next drop or sink token
        self._extra: Any = None
        self.is_initialized = False

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Called by the stock attention module; the attention function reads the cache itself."""
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            self.full_v, self.recent_v = (int4_values_or(store, value_states) for store in (self.full_v, self.recent_v))
        return key_states, value_states

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float | None) -> tuple[torch.Tensor, None]:  # fmt: skip
        return attend_state(query, key, value, attention_mask, scaling, self)

    def recent_budget(self, total: int) -> int:
        return window_budget(total, self.window, self.window_frac)

    def past_full(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Retrieval heads' stored keys and values ``[b, R, n, d]`` (None before the first commit)."""
        return (self.full_k.read(), self.full_v.read()) if len(self.full_k) else None

    def past_short(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Other heads' stored sink and recent keys / values, in order (empty lists before the first commit)."""
        if self.sink_k is None:
            return [], []
        keys, values = [self.sink_k], [self.sink_v]
        if len(self.recent_k):
            keys.append(self.recent_k.read())
            values.append(self.recent_v.read())
        return keys, values

    def token_reader(self, query: torch.Tensor, full: bool = True) -> Callable[..., torch.Tensor] | None:
        """How a decode step attends over the retrieval heads' past (``full``; else the other heads' windows) from
        its 4-bit codes in the token layout (``token_reader``: the GPU kernel or torch's CPU int4 kernel), or None."""
        keys, values = (self.full_k, self.full_v) if full else (self.recent_k, self.recent_v)
        return token_reader(keys, values, query)

    def extend(self, new_k: torch.Tensor, new_v: torch.Tensor, read_full: bool = True,
               read_short: bool = True) -> tuple[Any, Any]:  # fmt: skip
        """Store this step's keys/values ``[b, Hkv, q, d]``; nothing is dropped yet (``evict`` does that
        once the step has attended). Returns what the step attends to, the new tokens exact: the
        retrieval heads' ``(keys, values) [b, R, n, d]`` and the other heads' ``(sink, recent)`` key and
        value pairs ``[b, N, ·, d]`` (None for a kind of head the layer lacks). Unquantized stores hand
        out their own tensors: no copy of the cache beyond the append. ``read_full=False`` (``read_short``):
        the retrieval heads' (other heads') tokens are only stored (their step was attended from the
        codes), and None is returned for them."""
        q_len = new_k.shape[2]
        r, o = self.retrieval, self.others
        full = short = None
        if r and read_full:
            full = self.full_k.extend(self._heads(new_k, True)), self.full_v.extend(self._heads(new_v, True))
        elif r:
            self.full_k.append(self._heads(new_k, True))
            self.full_v.append(self._heads(new_v, True))
        if o:
            k, v = self._heads(new_k, False), self._heads(new_v, False)
            if self.sink_k is None:
                # empty copies: an empty view would keep this step's whole tensor alive with no sink to hold
                self.sink_k, self.sink_v = k[:, :, :0].clone(), v[:, :, :0].clone()
                self.comp_k_sum = torch.zeros_like(k[:, :, :1], dtype=torch.float32)
                self.comp_v_sum = torch.zeros_like(v[:, :, :1], dtype=torch.float32)
                self.comp_count = torch.zeros(k.shape[0], dtype=torch.float32, device=k.device)
            take = max(0, min(self.sink - self.sink_k.shape[2], q_len))
            if take:
                self._stale()
                self.sink_k = torch.cat([self.sink_k, k[:, :, :take]], dim=2)
                self.sink_v = torch.cat([self.sink_v, v[:, :, :take]], dim=2)
            if not read_short:
                self.recent_k.append(k[:, :, take:])
                self.recent_v.append(v[:, :, take:])
            else:
                if take < q_len:
                    recent = self.recent_k.extend(k[:, :, take:]), self.recent_v.extend(v[:, :, take:])
                elif len(self.recent_k):
                    recent = self.recent_k.read(), self.recent_v.read()
                else:
                    recent = k[:, :, :0], v[:, :, :0]
                short = (self.sink_k, recent[0]), (self.sink_v, recent[1])
        self.seen += q_len
        return full, short

    def evict(self, valid: torch.Tensor | None) -> None:
        """Move what fell out of the window into the compensation sums. ``valid [b, seen]``: False for
        padding tokens (never compensated); None: no padding."""
        drop = max(0, len(self.recent_k) - self.recent_budget(self.seen)) if self.others else 0
        drop = self.recent_k.whole_front(drop)  # a quantized window slides by whole blocks
        if drop:
            first = self.seen - len(self.recent_k)  # logical index of the oldest recent token
            dropped_k, dropped_v = self.recent_k.take_front(drop), self.recent_v.take_front(drop)
            keys, values = dropped_k.float(), dropped_v.float()
            if valid is None:  # no padding: every dropped token counts, nothing to weigh (ops are a step's cost)
                count: Any = drop
            else:
                weight = valid[:, first : first + drop].to(torch.float32)[:, None, :, None]  # [b, 1, drop, 1]
                keys, values, count = keys * weight, values * weight, weight.sum((1, 2, 3))
            self.comp_k_sum = self.comp_k_sum + keys.sum(2, keepdim=True)
            self.comp_v_sum = self.comp_v_sum + values.sum(2, keepdim=True)
            self.comp_count = self.comp_count + count
            self._stale()

    def derived(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The other heads' compensation token before this step: mean key and value ``[b, N, 1, d]`` of the
        dropped tokens (zeros before any) and their count ``[b]``. Kept until the next drop or sink token:
        in the token layout a window drops a whole block every 64 steps, and the other steps would
        recompute the same means. ``key``/``value``: this step's ``[b, Hkv, q, d]``, for dtype and shape."""
        if self.comp_count is None:  # nothing stored yet
            zeros = torch.zeros_like(key[:, self.others, :1])
            return zeros, zeros, torch.zeros(key.shape[0], device=key.device)
        if self._derived is None:
            count = self.comp_count
            denominator = count.clamp(min=1).view(-1, 1, 1, 1)
            comp_k = (self.comp_k_sum / denominator).to(key.dtype)
            comp_v = (self.comp_v_sum / denominator).to(value.dtype)
            self._derived = comp_k, comp_v, count
        return self._derived

    def extra_tokens(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The extra tokens of windows read from their codes (``token_decode``, ``kivi_decode``): the sink and the
        compensation token as one ``[b, N, sink + 1, d]`` pair, the token's logit ``ln N_d`` ``[b]`` and the pair's
        logits ``[b, N, 1, sink + 1]`` where nothing is masked. Kept with ``derived``'s tensors until the next drop (the
        quantized windows drop a block every 64 steps: ``whole_front``; 16-bit windows a token at every step)."""
        if self._extra is None:
            comp_k, comp_v, count = self.derived(key, value)
            log_count = count_logit(count)
            logits = extra_logits(None, log_count, len(self.others), self.sink_k.shape[2])
            self._extra = (torch.cat([self.sink_k, comp_k], dim=2), torch.cat([self.sink_v, comp_v], dim=2),
                           log_count, logits)  # fmt: skip
        return self._extra

    def _stale(self) -> None:
        """The compensation token or the sink changed: forget what ``derived`` and ``extra_tokens`` kept."""
        self._derived = self._extra = None

    def commit(self, new_k: torch.Tensor, new_v: torch.Tensor, valid: torch.Tensor | None) -> None:
        """``extend`` then ``evict``: for a step that attended without the stores' help (the kernel's); nothing is
        read back (a quantized store would dequantize itself for nobody)."""
        self.extend(new_k, new_v, read_full=False, read_short=False)
        self.evict(valid)

    # --- cache protocol
    def rows(self) -> int:
        for tensor in (self.sink_k, self.full_k.tail):
            if tensor is not None:
                return tensor.shape[0]
        return 0

    def apply(self, fn: Any) -> None:
        self._stale()
        for store in (self.full_k, self.full_v, self.recent_k, self.recent_v):
            store.apply(fn)
        if self.sink_k is not None:
            self.sink_k, self.sink_v = fn(self.sink_k), fn(self.sink_v)
            self.comp_k_sum, self.comp_v_sum = fn(self.comp_k_sum), fn(self.comp_v_sum)
            self.comp_count = fn(self.comp_count)

    def crop_to(self, length: int) -> None:
        if length < self.seen:
            raise ValueError("a razor cache cannot be cropped: the tokens it dropped are gone")


def razor_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [b, H, q, d]``, this step's ``key/value [b, Hkv, q, d]``
    (after RoPE). Returns ``[b, q, H, d]`` like transformers' own implementations. The layer's own
    copy of the code does the work (``RazorLayer.attend``, see ``cache_layer_of``)."""
    layer = cache_layer_of(module)
    if hasattr(layer, "retrieval"):
        return layer.attend(query, key, value, attention_mask, scaling)
    if layer is not None:  # a sliding-window layer left stock: its own cache returned the window
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)  # fmt: skip
    return attend_state(query, key, value, attention_mask, scaling, None)  # no cache (use_cache=False)


def attend_state(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    scaling: float | None, layer: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """``razor_attention`` for one layer's state (None: attend over this step's tokens only)."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    seen = layer.seen if layer is not None else 0
    total = seen + q_len
    # bias None: a decode step without padding, every held token visible (a chunk builds its bias a block of query rows
    # at a time, ``attend_chunk``). valid [b, total]: the tokens the last query sees (None: every token; no padding)
    if q_len == 1:
        bias = additive_mask(attention_mask, 1, total, query.dtype, query.device)
        valid = None if bias is None else (bias[:, 0, -1, :] == 0).expand(batch, total)
    else:
        bias, valid = None, last_row_valid(attention_mask, q_len, total, query.device)
        valid = None if valid is None else valid.expand(batch, total)
    # the head-wise kernel reads stores dequantized: token-layout stores go to their own kernel below instead
    if q_len == 1 and layer is not None and not isinstance(layer.full_k, TokenLayoutStore) and use_kernels(query):
        if bias is None:
            bias = torch.zeros(1, 1, 1, total, dtype=query.dtype, device=query.device)
        out = _decode_with_kernel(layer, query, key, value, bias, group, scale)
        layer.commit(key, value, valid)
        return out.transpose(1, 2).contiguous(), None
    if layer is None:  # no cache: plain causal attention over this step
        return prefill_attention(query, key, value, attention_mask, scale).transpose(1, 2).contiguous(), None
    # Work per KV head: the G query heads of a group are adjacent, so ``[b, k·G, q, d]`` views as
    # ``[b, k, G·q, d]`` and one matmul serves the group (no G-fold copy of the keys and values).
    out = query.new_empty(batch, kv_heads, group * q_len, dim)
    grouped_query = query.reshape(batch, kv_heads, group * q_len, dim)
    # comp state before this step (the step's drops are compensated from the next step on)
    comp_k, comp_v, count = layer.derived(key, value)
    kept_bias = None  # the mask of the positions the other heads hold
    if bias is not None and layer.others:
        kept_bias = bias.index_select(-1, _kept_index(layer, total, query.device))
    # retrieval heads read from their codes: in the token layout (torch's int4 kernel), or 2- to 4- and 8-bit in KIVI's
    # layout on a CPU (``kivi_decode`` in torch, as quant does)
    full_reader = layer.token_reader(query) if q_len == 1 else None
    token_codes = full_reader is not None
    kivi_codes = not token_codes and q_len == 1 and bool(layer.retrieval) and query.device.type == "cpu" and (
        kivi_kernel_reads(layer.full_k, layer.full_v, dim, kernel=False))  # fmt: skip
    from_codes = token_codes or kivi_codes
    if from_codes:
        r = layer.retrieval
        at, heads_at = head_span(r), head_span(query_heads(r, group))
        read = (query[:, heads_at], key[:, at], value[:, at], bias, layer.full_k, layer.full_v, scale)
        decoded = full_reader(*read) if full_reader is not None else kivi_decode(*read, kernel=False)
        out[:, at] = decoded.to(query.dtype).view(batch, len(r), group, dim)  # q_len 1: [b, R, G, d]
    window_reader = layer.token_reader(query, full=False) if q_len == 1 and layer.others else None
    window_codes = window_reader is not None
    # or the windows in KIVI's layout on a CPU, the dropped front of their first block masked
    window_kivi = not window_codes and q_len == 1 and bool(layer.others) and query.device.type == "cpu" and (
        layer.sink_k is not None and kivi_kernel_reads(layer.recent_k, layer.recent_v, dim, kernel=False))  # fmt: skip
    if window_codes or window_kivi:  # the other heads' windows too; the sink and the compensation token join exact
        o, sink = layer.others, layer.sink_k.shape[2]
        extra_k, extra_v, log_count, logits = layer.extra_tokens(key, value)
        if kept_bias is not None:
            logits = extra_logits(kept_bias[..., :sink], log_count, len(o), sink)
        extra = extra_k, extra_v, logits
        window_bias = None if kept_bias is None else kept_bias[..., sink:]
        at, heads_at = head_span(o), head_span(query_heads(o, group))
        read = (query[:, heads_at], key[:, at], value[:, at], window_bias, layer.recent_k, layer.recent_v, scale)
        decoded = window_reader(*read, extra) if window_reader is not None else kivi_decode(*read, kernel=False,
                                                                                           extra=extra)  # fmt: skip
        out[:, at] = decoded.to(query.dtype).view(batch, len(o), group, dim)
    full, short = layer.extend(key, value, read_full=not from_codes, read_short=not (window_codes or window_kivi))
    if q_len > 1:
        kept = _kept_index(layer, total, query.device)
        attend_chunk(layer, query, attention_mask, full, short, (comp_k, comp_v, count), kept, scale, out)
        layer.evict(valid)
        return out.view(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None
    # one token: the G query heads of a KV head as one matrix (the window heads through the grouped products: through
    # SDPA, their merge with the sink and compensation token measured slower)
    if full is not None:
        # SDPA's fused kernel too, its G stacked query rows sharing the bias. It reads the store's view with room to
        # grow as it is, where oneDNN's half-precision products copy it, and at batch 1 it is 1.2-2.8x faster than
        # scores, softmax and product apart (SmolLM2's heads at 1K-4K, float32 and bfloat16)
        out[:, layer.retrieval] = F.scaled_dot_product_attention(grouped_query[:, layer.retrieval], full[0], full[1],
                                                                 attn_mask=bias, scale=scale)  # fmt: skip
    if short is not None:
        (sink_k, recent_k), (sink_v, recent_v) = short
        rows = grouped_query[:, layer.others]
        # sink and window scored apart: concatenating the window's keys would copy it every step
        scores = torch.cat([keys_first(rows, sink_k), keys_first(rows, recent_k)], dim=-1) * scale
        if kept_bias is not None:
            scores = grouped_bias(scores, kept_bias, group)
        out[:, layer.others] = compensated_attention(rows, (sink_k, recent_k), (sink_v, recent_v), scores, comp_k,
                                                     comp_v, count, scale)  # fmt: skip
    layer.evict(valid)
    return out.view(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None


def _kept_index(layer: RazorLayer, total: int, device: torch.device) -> torch.Tensor:
    """Logical positions a non-retrieval head still holds: sinks, the recent window, this step's
    tokens (``total``: positions up to this step's end; the same before and after ``extend``)."""
    sink = layer.sink_k.shape[2] if layer.sink_k is not None else 0
    first_recent = layer.seen - len(layer.recent_k)
    return torch.cat([torch.arange(sink, device=device), torch.arange(first_recent, total, device=device)])


def _decode_with_kernel(
    layer: RazorLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, group: int,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """One decode step of every head in one launch (``razor_decode_triton``); ``[b, H, 1, d]``. Retrieval heads
    stored 4-bit in KIVI's layout are read from their codes by the KIVI kernel instead (``kivi_decode``), not
    dequantized for the head-wise kernel (which then gets a zero stand-in for them)."""
    batch, heads, _, dim = query.shape
    total = layer.seen + 1
    row_bias = bias[:, 0, -1, :].expand(batch, total).float()
    empty = query.new_zeros(batch, 1, 1, dim)  # stands in for a kind of head this layer does not have
    r, o = layer.retrieval, layer.others
    from_codes = bool(r) and kivi_kernel_reads(layer.full_k, layer.full_v, dim)
    if from_codes:  # one zero token per retrieval head (each reads its own slot): computed, then replaced below
        full_k = full_v = query.new_zeros(batch, len(r), 1, dim)
    else:
        past = layer.past_full()
        full_k = (key[:, r] if past is None else torch.cat([past[0], key[:, r]], 2)) if r else empty
        full_v = (value[:, r] if past is None else torch.cat([past[1], value[:, r]], 2)) if r else empty
    if o:
        past_k, past_v = layer.past_short()
        short_k, short_v = torch.cat(past_k + [key[:, o]], 2), torch.cat(past_v + [value[:, o]], 2)
        short_bias = row_bias.index_select(-1, _kept_index(layer, total, query.device))
        if layer.comp_count is None:
            comp_k = comp_v = query.new_zeros(batch, len(o), dim)
            count = torch.zeros(batch, device=query.device)
        else:
            denominator = layer.comp_count.clamp(min=1).view(-1, 1, 1)
            comp_k, comp_v = layer.comp_k_sum[:, :, 0] / denominator, layer.comp_v_sum[:, :, 0] / denominator
            count = layer.comp_count
        comp_logit = count_logit(count)
    else:
        short_k = short_v = empty
        short_bias = row_bias[:, :1]
        comp_k = comp_v = query.new_zeros(batch, 1, dim)
        comp_logit = torch.zeros(batch, device=query.device)
    kind, slot = head_tables(r, o, heads, group, query.device)
    # the stand-in's zero token unmasked: heads reading it compute a finite output, replaced below
    full_bias = row_bias if r and not from_codes else row_bias.new_zeros(batch, 1)
    out = razor_decode_triton(query[:, :, 0], full_k, full_v, full_bias, short_k, short_v, short_bias, comp_k, comp_v,
                              comp_logit, kind, slot, scale)  # fmt: skip
    if from_codes:
        at, heads_at = head_span(r), head_span(query_heads(r, group))
        decoded = kivi_decode(query[:, heads_at], key[:, at], value[:, at], bias, layer.full_k, layer.full_v, scale,
                              kernel=True)  # fmt: skip
        out[:, heads_at] = decoded[:, :, 0]
    return out.to(query.dtype)[:, :, None]


AttentionInterface.register(IMPLEMENTATION, razor_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def make_attention(spec: dict[str, Any], layer_idx: int, rotary: Any) -> None:
    """Attention modules stay stock; the work happens in ``razor_attention``."""
    return None


def make_cache(spec: dict[str, Any], max_cache_len: int | None = None) -> LayerStateCache:
    """The head-wise cache; preallocated for ``max_cache_len`` tokens (a static cache asked for) unless
    ``static_refusal`` says why not (then it grows with the sequence, and the caller says so)."""
    from .kvconvert_razor_kivi import StaticRazorKiviLayer  # they build on this module
    from .kvconvert_razor_static import StaticRazorLayer
    from .kvconvert_razor_token import StaticRazorTokenLayer

    razor = spec["razor"]
    kv_heads = int(spec["num_kv_heads"])
    quant = QuantSpec.from_spec(spec)
    static = max_cache_len is not None and static_refusal(spec, static_windows=True) is None
    layers: list[Any] = []
    for layer, retrieval in enumerate(razor["retrieval_kv_heads"]):
        others = [g for g in range(kv_heads) if g not in retrieval]
        heads = list(retrieval), others, razor["sink"], razor["window"], razor["window_frac"]
        if static:  # sliding-window layers (kept stock) get transformers' own static window
            assert max_cache_len is not None
            quantized = StaticRazorTokenLayer if quant.layout == "token" else StaticRazorKiviLayer
            held = quantized(*heads, max_cache_len, quant, layer) if quant.quantized else (
                StaticRazorLayer(*heads, max_cache_len))  # fmt: skip
            layers.append(static_sliding_layer(spec, layer, max_cache_len) or held)
        else:
            layers.append(sliding_layer(spec, layer) or RazorLayer(*heads, quant, layer))
    return LayerStateCache(layers)


def configure(model: Any) -> None:
    """Route every attention module of ``model`` through ``razor_attention``."""
    model.set_attn_implementation(IMPLEMENTATION)
