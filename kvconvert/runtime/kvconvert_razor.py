"""RazorAttention runtime (Tang et al., "RazorAttention: efficient KV cache compression through retrieval heads").

Weights and attention modules stay stock. A registered attention function does the work, with a
head-wise cache: retrieval KV heads keep every token; the other KV heads keep the first ``sink``
tokens, the most recent L = max(window, N·window_frac) tokens and one compensation token per head
holding the mean of all dropped keys and values with their count N_d (paper eq. 4), attended as in
eq. 5. Prefill attends over everything and the cache is compressed afterwards (Algorithm 1); decode
attends over the compressed cache. Copied verbatim into every razor output directory.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kvconvert_common import LayerStateCache, additive_mask, cache_layer_of, softmax_rows
from .kvconvert_kernels import razor_decode_triton, use_kernels
from .kvconvert_storage import KVLayer, QuantSpec, TokenStore, sliding_layer

IMPLEMENTATION = "kvconvert_razor"


def compensated_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    comp_key: torch.Tensor,
    comp_value: torch.Tensor,
    comp_count: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Eq. 5: softmax attention over kept tokens plus a compensation token weighted by N_d.

    Shapes: query ``[b, h, q, d]``; keys/values ``[b, h, n, d]``; bias ``[b|1, 1|h, q, n]`` or None;
    comp_key/comp_value ``[b, h, 1, d]`` (means of the dropped tokens); comp_count ``[b]`` (N_d,
    0 where nothing was dropped: the compensation token then takes no weight). Returns ``[b, h, q, d]``.
    """
    scores = (query @ keys.transpose(-1, -2)) * scaling
    if bias is not None:
        scores = scores + bias
    # N_d·exp(q·k̂) = exp(q·k̂ + ln N_d): the count becomes an additive logit
    log_count = torch.where(comp_count > 0, comp_count.clamp(min=1).log(), torch.finfo(scores.dtype).min)
    comp_scores = (query @ comp_key.transpose(-1, -2)) * scaling + log_count.view(-1, 1, 1, 1).to(scores.dtype)
    probs = softmax_rows(torch.cat([scores, comp_scores], dim=-1), values.dtype)
    return probs[..., :-1] @ values + probs[..., -1:] * comp_value


class RazorLayer(KVLayer):
    """One layer's head-wise state. Retrieval KV heads: ``full_k/full_v`` stores of ``[b, R, n, d]``.
    Other KV heads: ``sink_k/v [b, N, ≤sink, d]`` (float), ``recent_k/v`` stores of ``[b, N, ≤L, d]``,
    ``comp_k/v_sum [b, N, 1, d]`` (float32 running sums of dropped tokens) and ``comp_count [b]``
    (dropped non-padding tokens). Stores are quantized when the checkpoint asks for it (keys per
    channel, values per token). ``seen`` is the logical sequence length the masks are built for."""

    def __init__(self, retrieval: list[int], others: list[int], sink: int, window: int, window_frac: float,
                 quant: QuantSpec | None = None, layer: int = 0):  # fmt: skip
        super().__init__()
        self.retrieval, self.others = retrieval, others
        self.sink, self.window, self.window_frac = sink, window, window_frac
        self.quant, self.layer = quant or QuantSpec(), layer
        self.reset()

    def reset(self) -> None:
        self.seen = 0
        keys, values = self.quant.side(self.layer, keys=True), self.quant.side(self.layer, keys=False)
        self.full_k, self.full_v = TokenStore(keys, True), TokenStore(values, False)
        self.recent_k, self.recent_v = TokenStore(keys, True), TokenStore(values, False)
        # tensors once the layer has seen its first tokens (None before); Any keeps the state terse
        self.sink_k: Any = None
        self.sink_v: Any = None
        self.comp_k_sum: Any = None
        self.comp_v_sum: Any = None
        self.comp_count: Any = None
        self.is_initialized = False

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Called by the stock attention module; the attention function reads the cache itself."""
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        return key_states, value_states

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float | None) -> tuple[torch.Tensor, None]:  # fmt: skip
        return _attend(query, key, value, attention_mask, scaling, self)

    def recent_budget(self, total: int) -> int:
        return max(self.window, int(total * self.window_frac))

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

    def commit(self, new_k: torch.Tensor, new_v: torch.Tensor, valid: torch.Tensor) -> None:
        """Append this step's keys/values ``[b, Hkv, q, d]``; move what falls out of the window into the
        compensation sums. ``valid [b, seen + q]``: False for padding tokens (never compensated)."""
        q_len = new_k.shape[2]
        r, o = self.retrieval, self.others
        if r:
            self.full_k.append(new_k[:, r])
            self.full_v.append(new_v[:, r])
        if o:
            k, v = new_k[:, o], new_v[:, o]
            if self.sink_k is None:
                self.sink_k, self.sink_v = k[:, :, :0], v[:, :, :0]
                self.comp_k_sum = torch.zeros_like(k[:, :, :1], dtype=torch.float32)
                self.comp_v_sum = torch.zeros_like(v[:, :, :1], dtype=torch.float32)
                self.comp_count = torch.zeros(k.shape[0], dtype=torch.float32, device=k.device)
            take = max(0, min(self.sink - self.sink_k.shape[2], q_len))
            self.sink_k = torch.cat([self.sink_k, k[:, :, :take]], dim=2)
            self.sink_v = torch.cat([self.sink_v, v[:, :, :take]], dim=2)
            if take < q_len:
                self.recent_k.append(k[:, :, take:])
                self.recent_v.append(v[:, :, take:])
            total = self.seen + q_len
            drop = max(0, len(self.recent_k) - self.recent_budget(total))
            if drop:
                first = total - len(self.recent_k)  # logical index of the oldest recent token
                weight = valid[:, first : first + drop].to(torch.float32)[:, None, :, None]  # [b, 1, drop, 1]
                dropped_k, dropped_v = self.recent_k.take_front(drop), self.recent_v.take_front(drop)
                self.comp_k_sum = self.comp_k_sum + (dropped_k.float() * weight).sum(2, keepdim=True)
                self.comp_v_sum = self.comp_v_sum + (dropped_v.float() * weight).sum(2, keepdim=True)
                self.comp_count = self.comp_count + weight.sum((1, 2, 3))
        self.seen += q_len

    # --- cache protocol
    def rows(self) -> int:
        for tensor in (self.sink_k, self.full_k.tail):
            if tensor is not None:
                return tensor.shape[0]
        return 0

    def apply(self, fn: Any) -> None:
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
    return _attend(query, key, value, attention_mask, scaling, None)  # no cache (use_cache=False)


def _attend(
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
    bias = additive_mask(attention_mask, q_len, total, query.dtype, query.device)
    if bias is None:  # single decode step without padding: everything visible
        bias = torch.zeros(1, 1, q_len, total, dtype=query.dtype, device=query.device)
    valid = bias[:, 0, -1, :] == 0  # [b|1, total]: the last query sees every non-padding token
    valid = valid.expand(batch, total)
    out = torch.empty_like(query)

    def heads_of(kv: list[int]) -> list[int]:
        return [g * group + j for g in kv for j in range(group)]

    def grouped(kv_tensor: torch.Tensor) -> torch.Tensor:  # [b, k, n, d] -> [b, k·G, n, d]
        return kv_tensor.repeat_interleave(group, dim=1)

    retrieval = layer.retrieval if layer is not None else list(range(kv_heads))
    others = layer.others if layer is not None else []
    if q_len == 1 and layer is not None and use_kernels(query):
        out = _decode_with_kernel(layer, query, key, value, bias, group, scale)
        layer.commit(key, value, valid)
        return out.transpose(1, 2).contiguous(), None
    if retrieval:
        past = None if layer is None else layer.past_full()
        k = key[:, retrieval] if past is None else torch.cat([past[0], key[:, retrieval]], 2)
        v = value[:, retrieval] if past is None else torch.cat([past[1], value[:, retrieval]], 2)
        q = query[:, heads_of(retrieval)]
        scores = (q @ grouped(k).transpose(-1, -2)) * scale + bias
        out[:, heads_of(retrieval)] = softmax_rows(scores, value.dtype) @ grouped(v)
    if others:
        assert layer is not None
        index = torch.tensor(_kept_index(layer, total), device=query.device)
        past_k, past_v = layer.past_short()
        k, v = torch.cat(past_k + [key[:, others]], 2), torch.cat(past_v + [value[:, others]], 2)
        if layer.comp_count is None:
            comp_k = torch.zeros_like(k[:, :, :1])
            comp_v, count = comp_k, torch.zeros(batch, device=query.device)
        else:
            denominator = layer.comp_count.clamp(min=1).view(-1, 1, 1, 1)
            comp_k = (layer.comp_k_sum / denominator).to(k.dtype)
            comp_v = (layer.comp_v_sum / denominator).to(v.dtype)
            count = layer.comp_count
        heads_o = heads_of(others)
        out[:, heads_o] = compensated_attention(
            query[:, heads_o], grouped(k), grouped(v), bias.index_select(-1, index), grouped(comp_k), grouped(comp_v),
            count, scale,
        )  # fmt: skip
    if layer is not None:
        layer.commit(key, value, valid)
    return out.transpose(1, 2).contiguous(), None


def _kept_index(layer: RazorLayer, total: int) -> list[int]:
    """Logical positions a non-retrieval head still holds: sinks, the recent window, this step."""
    kept = list(range(layer.sink_k.shape[2] if layer.sink_k is not None else 0))
    kept += list(range(layer.seen - len(layer.recent_k), layer.seen))
    return kept + list(range(layer.seen, total))


def _decode_with_kernel(
    layer: RazorLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, group: int,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """One decode step of every head in one launch (``razor_decode_triton``); ``[b, H, 1, d]``."""
    batch, heads, _, dim = query.shape
    total = layer.seen + 1
    row_bias = bias[:, 0, -1, :].expand(batch, total).float()
    empty = query.new_zeros(batch, 1, 1, dim)  # stands in for a kind of head this layer does not have
    r, o = layer.retrieval, layer.others
    past = layer.past_full()
    full_k = (key[:, r] if past is None else torch.cat([past[0], key[:, r]], 2)) if r else empty
    full_v = (value[:, r] if past is None else torch.cat([past[1], value[:, r]], 2)) if r else empty
    if o:
        index = torch.tensor(_kept_index(layer, total), device=query.device)
        past_k, past_v = layer.past_short()
        short_k, short_v = torch.cat(past_k + [key[:, o]], 2), torch.cat(past_v + [value[:, o]], 2)
        short_bias = row_bias.index_select(-1, index)
        if layer.comp_count is None:
            comp_k = comp_v = query.new_zeros(batch, len(o), dim)
            count = torch.zeros(batch, device=query.device)
        else:
            denominator = layer.comp_count.clamp(min=1).view(-1, 1, 1)
            comp_k, comp_v = layer.comp_k_sum[:, :, 0] / denominator, layer.comp_v_sum[:, :, 0] / denominator
            count = layer.comp_count
        comp_logit = torch.where(count > 0, count.clamp(min=1).log(), torch.finfo(torch.float32).min)
    else:
        short_k = short_v = empty
        short_bias = row_bias[:, :1]
        comp_k = comp_v = query.new_zeros(batch, 1, dim)
        comp_logit = torch.zeros(batch, device=query.device)
    kv_of = [h // group for h in range(heads)]
    kind = torch.tensor([0 if g in r else 1 for g in kv_of], device=query.device)
    slot = torch.tensor([r.index(g) if g in r else o.index(g) for g in kv_of], device=query.device)
    out = razor_decode_triton(query[:, :, 0], full_k, full_v, row_bias if r else row_bias[:, :1], short_k, short_v,
                              short_bias, comp_k, comp_v, comp_logit, kind, slot, scale)  # fmt: skip
    return out.to(query.dtype)[:, :, None]


AttentionInterface.register(IMPLEMENTATION, razor_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def make_attention(spec: dict[str, Any], layer_idx: int, rotary: Any) -> None:
    """Attention modules stay stock; the work happens in ``razor_attention``."""
    return None


def make_cache(spec: dict[str, Any]) -> LayerStateCache:
    razor = spec["razor"]
    kv_heads = int(spec["num_kv_heads"])
    quant = QuantSpec.from_spec(spec)
    layers = []
    for layer, retrieval in enumerate(razor["retrieval_kv_heads"]):
        others = [g for g in range(kv_heads) if g not in retrieval]
        layers.append(
            sliding_layer(spec, layer)
            or RazorLayer(list(retrieval), others, razor["sink"], razor["window"], razor["window_frac"], quant, layer)
        )
    return LayerStateCache(layers)


def configure(model: Any) -> None:
    """Route every attention module of ``model`` through ``razor_attention``."""
    model.set_attn_implementation(IMPLEMENTATION)
