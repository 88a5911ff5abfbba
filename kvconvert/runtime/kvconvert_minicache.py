"""MiniCache runtime (Liu et al., "MiniCache: KV cache compression in depth dimension for LLMs").

From the start layer S on, layers are paired (S, S+1), (S+2, S+3), … and each pair stores ONE
direction tensor for its keys (and one for its values) instead of two full tensors (§4):

- merge (eq. 3): per token, the two layers' states x^{l-1}, x^l (all KV heads of the layer as one
  vector, the paper's "vectorized cache state of a single token") are split into norm and unit
  direction; the directions are interpolated by SLERP with parameter t (t → 1 leans to layer l);
- retention (eq. 4): tokens whose pair is too far apart to share a direction keep both layers'
  exact states, by index; the rest are merged;
- restore (fig. 3b): direction × each layer's own norm, then the retained tokens put back.

Stored per pair and per token: one direction vector, two float32 norms, and for retained tokens
both exact vectors plus (row, position) as int32, for K and V separately. Prefill merges whole
sequences; in decode the new token of the first layer waits until the second layer has computed
its own, then the pair is merged (appendix D, algorithm 1). Within one forward call every layer
attends to its own exact new states; only the past is merged.

``merge: subspace`` (an extension after xKV, 2025) shares a latent instead of a direction: per pair,
side and token the cache holds ``z = (x_{l-1} − μ_{l-1})·E_{l-1} + (x_l − μ_l)·E_l`` (r channels, in place
of 2·Hkv·dk), and each layer restores its own states as ``μ + z·D`` with its parameters
``subspace_{k,v}_{encoder,decoder,mean}`` (fitted offline on calibration text, registered on the stock
attention module by ``configure`` and loaded from the checkpoint). Layer l-1's share of z waits, as
above, until layer l has added its own.

Weights and attention modules stay stock: a registered attention function reads the cache.
Copied verbatim into every minicache output directory.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kvconvert_codec import QuantSpec
from .kvconvert_common import LayerStateCache, cache_layer_of, softmax_rows, static_refusal
from .kvconvert_folded import folded_channel_mix, folded_scores, kivi_folded_fits
from .kvconvert_merge import MergedStream, merged_decode, merged_reads_codes
from .kvconvert_prefill import additive_mask, last_row_valid
from .kvconvert_products import cache_mix, cache_scores
from .kvconvert_quant import kivi_stock_layer, static_quant_layer
from .kvconvert_storage import KVLayer, select_rows_fn
from .kvconvert_tokenstore import TokenStore

IMPLEMENTATION = "kvconvert_minicache"
# a subspace pair attends from its latents for query blocks up to this long (decoding), else restores the past
LATENT_MAX_QUERIES = 16


class PairedLayer(KVLayer):
    """Base of both members of a pair. The stock attention module calls ``update`` (a no-op
    here); ``minicache_attention`` restores the past and commits the new states. The pair's state
    lives in its second layer, which alone answers the cache protocol (the first holds no rows)."""

    pair: PairedLayer  # the pair's second layer, which holds the state (PairState or SubspaceState)
    seen: int
    member: int  # 0: layer l-1, 1: layer l

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        return key_states, value_states

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        return _paired_attention(self, module, query, key, value, attention_mask, **kwargs)

    def restore(self, member: int, module: Any = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``member``'s past keys and values ``[b, Hkv, n, dk]`` (None before the first token); ``module``:
        that layer's attention module (a subspace pair's parameters live there)."""
        raise NotImplementedError

    def attend_past(self, member: int, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, mask: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        """Attention output ``[b, q, H, dk]`` of ``query`` over the restored past and this step's exact states."""
        past = self.restore(member, module)
        full_k = key if past is None else torch.cat([past[0], key], dim=2)
        full_v = value if past is None else torch.cat([past[1], value], dim=2)
        return sdpa_attention_forward(module, query, full_k, full_v, mask, **kwargs)[0]

    def commit(self, member: int, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
               module: Any = None) -> None:  # fmt: skip
        """Store layer ``member``'s new states ``[b, Hkv, q, dk]`` (``valid [b, q]``: not padding)."""
        raise NotImplementedError

    def get_seq_length(self) -> int:
        return self.pair.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.pair.seen + query_length, 0

    def reset(self) -> None:
        self.pair.reset()

    def rows(self) -> int:
        return 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop() takes a negative number of tokens to remove")

    def apply(self, fn: Any) -> None:
        """The first layer of a pair holds nothing."""


class PairState(PairedLayer):
    """Layer l (second of the pair): owns the pair's merged keys and values, ``seen`` tokens long,
    and, between the two layers of one forward call, layer l-1's new states (``pending``)."""

    _keep_in_fp32 = ("retained",)  # ``merged_decode``'s memo: float32, as the codes reader computes

    def __init__(self, t: float, gamma: float, merge: str, quant: QuantSpec | None = None, layer: int = 0):
        super().__init__()
        self.t, self.gamma, self.merge = t, gamma, merge
        self.quant, self.layer = quant or QuantSpec(), layer  # the pair's second layer: its storage serves both
        self.pair, self.member = self, 1
        self.reset()

    def reset(self) -> None:
        self.seen = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # layer l-1's states, this call only
        self.keys_merged = MergedStream(self.quant.side(self.layer, keys=True), per_channel=True)
        self.values_merged = MergedStream(self.quant.side(self.layer, keys=False), per_channel=False)
        self.retained: dict[Any, Any] = {}  # ``merged_decode``'s memo of the retained tokens' states

    def rows(self) -> int:
        rows = self.keys_merged.distance_range
        return 0 if rows is None else rows.shape[0]

    def select_rows(self, index: torch.Tensor) -> None:
        self.retained.clear()
        self.keys_merged.select_rows(index)
        self.values_merged.select_rows(index)

    def crop(self, tokens_to_remove: int) -> None:
        KVLayer.crop(self, tokens_to_remove)

    def crop_to(self, length: int) -> None:
        self.seen = max(0, length)
        self.retained.clear()
        self.keys_merged.crop(self.seen)
        self.values_merged.crop(self.seen)

    def apply(self, fn: Any) -> None:
        self.retained.clear()
        for stream in (self.keys_merged, self.values_merged):
            stream.direction.apply(fn)
            for name in ("norms", "retained", "retained_at", "distance_range"):
                if getattr(stream, name) is not None:
                    setattr(stream, name, fn(getattr(stream, name)))

    def restore(self, member: int, module: Any = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.seen == 0:
            return None
        return self.keys_merged.restore(member), self.values_merged.restore(member)

    def attend_past(self, member: int, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, mask: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        """A decode step on a CPU reads the merged directions' codes (``merged_decode``: restoring the past would
        dequantize all of it every step); other steps restore the past (``PairedLayer.attend_past``)."""
        dim = query.shape[-1]
        if not (self.seen and query.shape[2] == 1 and query.device.type == "cpu"
                and merged_reads_codes(self.keys_merged, self.values_merged, dim)):  # fmt: skip
            return PairedLayer.attend_past(self, member, module, query, key, value, mask, **kwargs)
        scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or dim**-0.5
        bias = additive_mask(mask, 1, self.seen + 1, torch.float32, query.device)
        out = merged_decode(query, key, value, bias, self.keys_merged, self.values_merged, member, scaling,
                            self.retained)  # fmt: skip
        return out.to(query.dtype).transpose(1, 2).contiguous()

    def commit(self, member: int, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
               module: Any = None) -> None:  # fmt: skip
        if member == 0:
            self.pending = (keys, values)
            return
        assert self.pending is not None, "layer l of a merged pair ran before layer l-1"
        first_k, first_v = self.pending
        self.pending = None
        self.keys_merged.append(first_k, keys, valid, self.seen, self.t, self.gamma, self.merge)
        self.values_merged.append(first_v, values, valid, self.seen, self.t, self.gamma, self.merge)
        self.seen += keys.shape[2]


class SubspaceState(PairedLayer):
    """Layer l of a subspace pair: owns the pair's latents ``[b, n, r_k]`` and ``[b, n, r_v]`` (stores, quantized
    per channel when the checkpoint asks: the latent's channels differ in scale, as principal components do)
    and, between the two layers of one forward call, layer l-1's share of the new tokens' latents."""

    def __init__(self, quant: QuantSpec | None = None, layer: int = 0, sink: int = 0):
        super().__init__()
        self.quant, self.layer, self.sink = quant or QuantSpec(), layer, sink
        self.pair, self.member = self, 1
        self.reset()

    def reset(self) -> None:
        self.seen = self.batch = self.head_dim = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.latents = (TokenStore(self.quant.side(self.layer, keys=True), per_channel=True),
                        TokenStore(self.quant.side(self.layer, keys=False), per_channel=True))  # fmt: skip
        # per member, (keys, values) [b, Hkv, s, dk] of the first s ≤ sink tokens, exact: attention sinks hold
        # near-zero values that most queries read heavily, where a subspace's error is largest relative to them
        self.exact: list[list[torch.Tensor] | None] = [None, None]

    def rows(self) -> int:
        return self.batch

    def _map_exact(self, fn: Any) -> None:
        self.exact = [None if pair is None else [fn(t) for t in pair] for pair in self.exact]

    def select_rows(self, index: torch.Tensor) -> None:
        if self.seen:
            for store in self.latents:
                store.apply(select_rows_fn(index))
            self._map_exact(select_rows_fn(index))
        self.batch = index.numel()

    def crop(self, tokens_to_remove: int) -> None:
        KVLayer.crop(self, tokens_to_remove)

    def crop_to(self, length: int) -> None:
        self.seen = max(0, length)
        for store in self.latents:
            if len(store):
                store.crop(self.seen)
        self._map_exact(lambda t: t[:, :, : self.seen].clone())

    def apply(self, fn: Any) -> None:
        for store in self.latents:
            if len(store):
                store.apply(fn)
        self._map_exact(fn)

    def restore(self, member: int, module: Any = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.seen == 0:
            return None
        return restored_states(module, [store.read() for store in self.latents], self.exact[member], self.head_dim)

    def attend_past(self, member: int, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, mask: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        """Scores and outputs computed from the latents (``latent_attention``), quantized latents read from their
        codes (``_latent_scores``, ``_latent_mix``). Equal to restoring and attending (``PairedLayer.attend_past``) up
        to rounding; that path serves longer query blocks (chunked prefill), where the ``[b, H, q, n]`` scores
        materialised here would outweigh restoring the past once for SDPA."""
        if self.seen == 0 or query.shape[2] > LATENT_MAX_QUERIES:
            return PairedLayer.attend_past(self, member, module, query, key, value, mask, **kwargs)
        scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        bias = additive_mask(mask, query.shape[2], self.seen + query.shape[2], query.dtype, query.device)
        keys, values = self.latents
        return latent_attention(module, query, key, value, bias, self.seen, self.exact[member],
                                lambda x: _latent_scores(keys, x), lambda w: _latent_mix(values, w),
                                scaling)  # fmt: skip

    def commit(self, member: int, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
               module: Any = None) -> None:  # fmt: skip
        shares = (_encode(module, "k", keys), _encode(module, "v", values))
        if self.seen < self.sink:
            # copies: a slice would keep this step's whole key/value tensors alive
            take = [keys[:, :, : self.sink - self.seen].clone(), values[:, :, : self.sink - self.seen].clone()]
            held = self.exact[member]
            self.exact[member] = take if held is None else [torch.cat(p, dim=2) for p in zip(held, take, strict=True)]
        if member == 0:
            self.pending = shares
            return
        assert self.pending is not None, "layer l of a merged pair ran before layer l-1"
        for store, first, second in zip(self.latents, self.pending, shares, strict=True):
            store.append((first + second).to(keys.dtype))
        self.pending = None
        self.seen += keys.shape[2]
        self.batch, self.head_dim = keys.shape[0], keys.shape[3]


def _folded(store: TokenStore) -> bool:
    """A latent store whose quantized blocks ``folded_scores`` / ``folded_channel_mix`` read from their codes."""
    return store.blocks is not None and kivi_folded_fits(store.quant.bits, store.quant.group)


def _latent_scores(store: TokenStore, x: torch.Tensor) -> torch.Tensor:
    """``x [b, R, r]`` times every latent the store holds ``[b, n, r]``: ``[b, R, n]`` in ``x``'s dtype. Quantized
    blocks are read from their codes (``folded_scores``), the exact sink and float tail as they are; a store with no
    block yet is read whole."""
    if not _folded(store):
        return cache_scores(x, store.read().to(x.dtype))
    assert store.blocks is not None and store.tail is not None
    blocks, n_q = store.blocks, store.quantized_tokens
    codes = folded_scores(x[:, None], blocks.codes[:, None], blocks.scale[:, None], blocks.zero[:, None],
                          store.quant.bits)[:, 0]  # fmt: skip
    scores = torch.cat([codes[..., :n_q], x.float() @ store.tail.float().transpose(1, 2)], dim=-1)
    if store.head is not None:  # the sink's exact latents in place of their stand-ins
        scores[..., : store.head.shape[1]] = x.float() @ store.head.float().transpose(1, 2)
    return scores.to(x.dtype)


def _latent_mix(store: TokenStore, weights: torch.Tensor) -> torch.Tensor:
    """``weights [b, R, n]`` times every latent the store holds: ``[b, R, r]`` in the weights' dtype, read as
    ``_latent_scores`` reads them (``folded_channel_mix`` for the quantized blocks)."""
    if not _folded(store):
        return cache_mix(weights, store.read().to(weights.dtype))
    assert store.blocks is not None and store.tail is not None
    blocks, n_q, sink = store.blocks, store.quantized_tokens, (0 if store.head is None else store.head.shape[1])
    p = weights.float()
    in_blocks = p[..., :n_q]
    if sink:  # the sink's stand-ins weigh nothing: its exact latents are added instead
        in_blocks = in_blocks.clone()
        in_blocks[..., :sink] = 0
    mixed = folded_channel_mix(in_blocks, blocks.codes, blocks.scale, blocks.zero, store.quant.bits)
    mixed = mixed + p[..., n_q:] @ store.tail.float()
    if store.head is not None:
        mixed = mixed + p[..., :sink] @ store.head.float()
    return mixed.to(weights.dtype)


def _encode(module: torch.nn.Module, side: str, states: torch.Tensor) -> torch.Tensor:
    """This layer's share ``(x − μ)·E`` ``[b, q, r]`` of the latent of ``states [b, Hkv, q, dk]`` (float32)."""
    b, heads, q, dk = states.shape
    x = states.transpose(1, 2).reshape(b, q, heads * dk).float()
    mean, encoder = getattr(module, f"subspace_{side}_mean"), getattr(module, f"subspace_{side}_encoder")
    return (x - mean.float()) @ encoder.float()


def _group_decoder(
    module: torch.nn.Module, side: str, kv_heads: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """This layer's decoder per KV group ``[Hkv, r, dk]`` and mean ``[Hkv, dk]``, in ``dtype``."""
    decoder, mean = getattr(module, f"subspace_{side}_decoder"), getattr(module, f"subspace_{side}_mean")
    return decoder.to(dtype).view(decoder.shape[0], kv_heads, -1).transpose(0, 1), mean.to(dtype).view(kv_heads, -1)


def _decode(module: torch.nn.Module, side: str, latent: torch.Tensor, head_dim: int) -> torch.Tensor:
    """This layer's states ``μ + z·D`` ``[b, Hkv, n, dk]`` from the pair's latent ``[b, n, r]``."""
    mean, decoder = getattr(module, f"subspace_{side}_mean"), getattr(module, f"subspace_{side}_decoder")
    x = torch.addmm(mean.to(latent.dtype), latent.flatten(0, 1), decoder.to(latent.dtype))  # [b·n, Hkv·dk]
    return x.view(*latent.shape[:2], mean.shape[0] // head_dim, head_dim).transpose(1, 2)  # n may be 0


def restored_states(
    module: torch.nn.Module, latents: list[torch.Tensor], exact: list[torch.Tensor] | None, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A member's past keys and values ``[b, Hkv, n, dk]`` from the pair's latents ``[b, n, r]`` (keys', values'),
    the first tokens replaced by the member's ``exact`` states ``[b, Hkv, s, dk]`` (the sink)."""
    restored = [_decode(module, side, latent, head_dim) for side, latent in zip("kv", latents, strict=True)]
    if exact is not None and exact[0].shape[2]:
        for states, kept in zip(restored, exact, strict=True):
            states[:, :, : kept.shape[2]] = kept
    return restored[0], restored[1]


def latent_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
    past: int, exact: list[torch.Tensor] | None, scores: Any, mix: Any, scaling: float,
) -> torch.Tensor:  # fmt: skip
    """Attention ``[b, q, H, dk]`` of ``query`` over ``past`` tokens held as latents, then this step's exact states
    ``key``/``value`` ``[b, Hkv, q, dk]`` (``bias``: additive ``[b|1, 1, q, past + q]``, or None), never restoring
    the past's states: for query head h of KV group g, ``q·k̂ᵢ = q·μ_g + (q·D_gᵀ)·zᵢ`` and ``Σ pᵢ v̂ᵢ = (Σ pᵢ)·μ_g +
    (Σ pᵢ zᵢ)·D_g``, so a step reads r numbers per past token and side instead of a layer's Hkv·dk (D_g: the
    decoder's columns of group g). ``scores(x [b, R, r]) -> [b, R, past]`` and ``mix(weights [b, R, past]) -> [b, R,
    r]`` read the keys' and values' latents (a growing store from its codes, a static one from its buffer); the
    first ``s`` past tokens are read from ``exact`` (``[b, Hkv, s, dk]`` keys and values) instead."""
    b, heads, q, dk = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    d_k, mu_k = _group_decoder(module, "k", kv_heads, query.dtype)  # [Hkv, r_k, dk], [Hkv, dk]
    d_v, mu_v = _group_decoder(module, "v", kv_heads, query.dtype)
    grouped = query.view(b, kv_heads, group, q, dk)
    q_latent = torch.einsum("bgjqd,grd->bgjqr", grouped, d_k).reshape(b, heads * q, -1)
    latent = scores(q_latent).view(b, heads, q, -1)  # [b, H, q, past]
    latent = latent + torch.einsum("bgjqd,gd->bgjq", grouped, mu_k).reshape(b, heads, q, 1)
    s = 0 if exact is None else exact[0].shape[2]
    exact_k, exact_v = (key[:, :, :0], value[:, :, :0]) if exact is None else exact
    # the first s past tokens are read exactly: their latent scores are replaced, their values added below
    keys = torch.cat([exact_k, key], dim=2).repeat_interleave(group, dim=1)  # [b, H, s + q, dk]
    direct = query @ keys.transpose(2, 3)
    both = torch.cat([direct[..., :s], latent[..., s:], direct[..., s:]], dim=-1) * scaling
    probs = softmax_rows(both if bias is None else both + bias, query.dtype)
    p_latent = probs[..., :past].clone()
    p_latent[..., :s] = 0  # the exact tokens' values are added below
    mixed = mix(p_latent.reshape(b, heads * q, -1)).view(b, kv_heads, group, q, -1)
    out = (
        torch.einsum("bgjqr,grd->bgjqd", mixed, d_v)
        + p_latent.sum(-1).view(b, kv_heads, group, q, 1) * mu_v[None, :, None, None]
    )
    p_direct = torch.cat([probs[..., :s], probs[..., past:]], dim=-1)
    values = torch.cat([exact_v, value], dim=2).repeat_interleave(group, dim=1)
    out = out.reshape(b, heads, q, dk) + p_direct @ values
    return out.transpose(1, 2).contiguous()


class PairFirst(PairedLayer):
    """Layer l-1 (first of the pair): holds no tensors; reads and writes through ``pair``."""

    def __init__(self, pair: PairedLayer):
        super().__init__()
        self.pair, self.member = pair, 0


def minicache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function. Unpaired layers: stock SDPA over what their (stock) cache
    returned, or, quantized in KIVI's layout, their own ``attend`` (decode steps read the codes). Paired layers:
    ``key/value [b, Hkv, q, d]`` are this step's states only; the past is read from the pair's merged state,
    and the new states are committed after attending. The layer's own copy of the code does the work
    (``PairedLayer.attend``, see ``cache_layer_of``)."""
    layer = cache_layer_of(module)
    if getattr(layer, "pair", None) is not None:
        return layer.attend(module, query, key, value, attention_mask, **kwargs)
    if hasattr(layer, "attend"):  # an unpaired layer that reads its own codes (``kivi_stock_layer``)
        scaling = kwargs.pop("scaling", None) or query.shape[-1] ** -0.5
        return layer.attend(module, query, key, value, attention_mask, scaling, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _paired_attention(
    layer: PairedLayer, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    pair, member = layer.pair, layer.member
    out = pair.attend_past(member, module, query, key, value, attention_mask, **kwargs)
    batch, q_len = key.shape[0], key.shape[2]
    # the last query row sees every non-padding token: padding is neither retained nor ranged
    seen = last_row_valid(attention_mask, q_len, pair.seen + q_len, key.device)
    valid = (
        torch.ones(batch, q_len, dtype=torch.bool, device=key.device)
        if seen is None
        else seen[:, -q_len:].expand(batch, q_len)
    )
    pair.commit(member, key, value, valid, module)
    return out, None


AttentionInterface.register(IMPLEMENTATION, minicache_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def make_attention(spec: dict[str, Any], layer_idx: int, rotary: Any) -> None:
    """Attention modules stay stock; the work happens in ``minicache_attention``."""
    return None


def make_cache(spec: dict[str, Any], max_cache_len: int | None = None) -> LayerStateCache:
    """Paired layers' states, stock (or quantized) layers elsewhere; preallocated for ``max_cache_len`` tokens (a
    static cache asked for) unless ``static_refusal`` says why not (then it grows with the sequence, and the caller
    says so)."""
    plan = spec["minicache"]
    quant = QuantSpec.from_spec(spec)
    if max_cache_len is not None and static_refusal(spec) is None:
        from .kvconvert_minicache_static import static_pair_layers  # which builds on this module

        static = [static_quant_layer(quant, i, max_cache_len) for i in range(len(spec["attention_modules"]))]
        static_pair_layers(plan, quant, static, max_cache_len)
        return LayerStateCache(static)
    layers: list[DynamicLayer] = [kivi_stock_layer(quant, i) for i in range(len(spec["attention_modules"]))]
    for first, second in plan["pairs"]:
        state: PairedLayer
        if plan["merge"] == "subspace":
            state = SubspaceState(quant, second, int(plan.get("sink", 0)))
        else:
            state = PairState(float(plan["t"]), float(plan["gamma"]), plan["merge"], quant, second)
        layers[first], layers[second] = PairFirst(state), state
    return LayerStateCache(layers)


def configure(model: Any) -> None:
    """Route every attention module of ``model`` through ``minicache_attention``; a subspace merge's
    paired layers get their (checkpoint-loaded) encoder, decoder and mean per side."""
    spec = model.config.kvconvert
    plan = spec["minicache"]
    if plan["merge"] == "subspace":
        width = int(spec["num_kv_heads"]) * int(spec["head_dim"])
        for pair, ranks in zip(plan["pairs"], plan["ranks"], strict=True):
            for layer in pair:
                module = model.get_submodule(spec["attention_modules"][layer])
                for side, rank in zip("kv", ranks, strict=True):
                    shapes = {"encoder": (width, rank), "decoder": (rank, width), "mean": (width,)}
                    for name, shape in shapes.items():
                        parameter = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
                        module.register_parameter(f"subspace_{side}_{name}", parameter)
    model.set_attn_implementation(IMPLEMENTATION)
